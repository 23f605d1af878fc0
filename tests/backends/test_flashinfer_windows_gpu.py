"""The ``flashinfer`` backend's sliding windows, softcap and sinks on real FlashInfer kernels (GPU, marked
``cuda``; skipped with the reason without flashinfer): against torch_native on the same GPU, the
same cache and queries. A model of two layers (full, sliding), bf16, GQA 16/4 d128 (tensor-core
decode) and 16/16 (CUDA-core decode), page size 16, shuffled pages, raw_bs < bs; windows of 1,
not a page multiple, smaller and larger than the sequences; caps that bind; sinks of large
magnitude (the sink wrapper's JIT variant). Eager in every served mode; tree verify serves the
capped full layer and refuses the windowed one and sinks; decode and chain verify captured in a CUDA
graph and replayed on two other batches, == eager bitwise.

``CLS`` and ``DEVICE`` may be pointed at tests/support/fi_emulation.py's ``EmulatedFlashInfer`` and
the CPU to dry-run the bodies where flashinfer imports (``runtime.graphs`` stands in for graphs).
"""
import importlib.util
import random

import pytest
import torch

from attn_backends import ForwardMode, ModelConfig
from attn_backends.backends.torch_native import TorchNativeBackend
from attn_backends.check.scenarios import (
    Scenario,
    draft_decode_spec,
    draft_extend_spec,
    make_memory,
    materialize,
    verify_spec,
)
from attn_backends.config import FULL, SLIDING
from attn_backends.registry import get_backend_class

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                                   reason="flashinfer is not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CLS = get_backend_class("flashinfer")
BS, RAW = 8, 6
# (window, cap, sinks); 5000 > every sequence
CASES = [(1, 0.5, False), (5, None, False), (100, 30.0, False), (5000, 0.5, False), (5, None, True),
         (128, None, True)]


def _cfg(window, cap, kv_heads=4, sinks=False):
    return ModelConfig(num_layers=2, num_q_heads=16, num_kv_heads=kv_heads, head_dim=128, page_size=16,
                       dtype=torch.bfloat16, sliding_window=window, logit_softcap=cap, sinks=sinks,
                       layer_types=(FULL, SLIDING))


def _layer(cfg, lid):
    sinks = torch.linspace(-12.0, 12.0, cfg.num_q_heads, device=DEVICE) if cfg.sinks else None
    return cfg.layer(lid, sinks=sinks)


def _memory(cfg):               # room for the six modes' batches of one test
    return make_memory(cfg, num_pages=6 * BS * 3104 // 16 + 8, max_reqs=6 * BS, max_context_len=3104,
                       page_order="shuffled", seed=1, device=DEVICE)


def _scenario(mode, rng):
    pre = [rng.randint(0, 3000) for _ in range(RAW)]
    if mode == "decode":
        return Scenario(ForwardMode.DECODE, BS, pre)
    if mode == "verify_chain":
        return Scenario(ForwardMode.TARGET_VERIFY, BS, pre, spec=verify_spec(4, BS, rng, device=DEVICE))
    if mode == "verify_tree":
        return Scenario(ForwardMode.TARGET_VERIFY, BS, pre, spec=verify_spec(8, BS, rng, topk=4, steps=3,
                                                                             device=DEVICE))
    if mode == "draft_extend":
        return Scenario(ForwardMode.DRAFT_EXTEND, BS, pre,
                        spec=draft_extend_spec(4, BS, RAW, [rng.randint(1, 4) for _ in range(RAW)], device=DEVICE))
    if mode == "draft_decode":
        return Scenario(ForwardMode.DECODE, BS, [p + 8 for p in pre], spec=draft_decode_spec(1, 3, 3))
    if mode == "extend":
        return Scenario(ForwardMode.EXTEND, RAW, pre, extend_lens=[rng.randint(1, 40) for _ in range(RAW)])
    raise ValueError(mode)


def _q(cfg, n, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)     # scores of several units: a cap of 0.5 binds
    return 3 * torch.randn(n, cfg.num_q_heads, cfg.qk_dim, generator=g, device=DEVICE, dtype=cfg.dtype)


def _rows(m):
    s = m.scenario
    return m.batch.raw_bs * s.width if s.width else sum(s.extend_lens)


def _check(got, want, what):
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("window,cap,sinks", CASES)
def test_eager_equals_torch_native_in_every_served_mode(window, cap, sinks):
    cfg = _cfg(window, cap, sinks=sinks)
    mem = _memory(cfg)
    be, ref = CLS(cfg, mem), TorchNativeBackend(cfg, mem)
    rng = random.Random(window)
    for mode in ("decode", "verify_chain", "draft_extend", "draft_decode", "extend", "verify_tree"):
        m = materialize(_scenario(mode, rng), mem, be.get_cuda_graph_seq_len_fill_value())
        be.init_forward_metadata(m.batch)
        ref.init_forward_metadata(m.batch)
        q = _q(cfg, m.batch.num_tokens, window)
        for lid in (0, 1):
            if mode == "verify_tree" and (lid == 1 or sinks):
                with pytest.raises(ValueError, match=r"with topk > 1 not supported: FlashInfer's"):
                    be.forward(q, None, None, _layer(cfg, lid), m.batch, save_kv_cache=False)
                continue
            got = be.forward(q, None, None, _layer(cfg, lid), m.batch, save_kv_cache=False)[:_rows(m)]
            want = ref.forward(q, None, None, _layer(cfg, lid), m.batch, save_kv_cache=False)[:_rows(m)]
            _check(got, want, f"{mode} layer {lid} w={window} cap={cap} sinks={sinks}")


def test_cuda_core_decode_equals_torch_native():
    cfg = _cfg(5, 0.5, kv_heads=16)                           # GQA group 1: the CUDA-core decode kernel
    mem = _memory(cfg)
    be, ref = CLS(cfg, mem), TorchNativeBackend(cfg, mem)
    m = materialize(_scenario("decode", random.Random(3)), mem, 1)
    be.init_forward_metadata(m.batch)
    ref.init_forward_metadata(m.batch)
    q = _q(cfg, BS, 3)
    for lid in (0, 1):
        _check(be.forward(q, None, None, _layer(cfg, lid), m.batch, save_kv_cache=False)[:RAW],
               ref.forward(q, None, None, _layer(cfg, lid), m.batch, save_kv_cache=False)[:RAW], f"layer {lid}")


@pytest.mark.parametrize("mode,sinks", [("decode", False), ("verify_chain", False), ("decode", True)])
def test_graph_replay_equals_eager_and_torch_native(mode, sinks):
    """Both layers' wrappers planned at capture, replanned light before each replay."""
    from attn_backends_runtime.graphs import make_graph
    cfg = _cfg(100, None if sinks else 0.5, sinks=sinks)
    mem = _memory(cfg)
    be, eager, ref = CLS(cfg, mem), CLS(cfg, mem), TorchNativeBackend(cfg, mem)
    rng = random.Random(7)
    cap, a, b = (materialize(_scenario(mode, rng), mem, 1) for _ in range(3))
    n = cap.batch.num_tokens
    q_s = _q(cfg, n, 0)
    be.init_cuda_graph_state(BS, n)
    be.init_forward_metadata_capture_cuda_graph(cap.batch.graph_inputs())
    g = make_graph(torch.device(DEVICE), torch.cuda.graph_pool_handle() if DEVICE == "cuda" else None)
    layers = [_layer(cfg, lid) for lid in (0, 1)]
    outs = g.capture(lambda: [be.forward(q_s, None, None, layer, cap.batch, save_kv_cache=False) for layer in layers])
    for i, m in enumerate((a, b)):
        be.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
        q_s.copy_(_q(cfg, n, i + 1))
        g.replay()
        eager.init_forward_metadata(m.batch)
        ref.init_forward_metadata(m.batch)
        for lid in (0, 1):
            same = eager.forward(q_s, None, None, layers[lid], m.batch, save_kv_cache=False)
            want = ref.forward(q_s, None, None, layers[lid], m.batch, save_kv_cache=False)
            assert torch.equal(outs[lid][:_rows(m)], same[:_rows(m)]), f"replay {i} layer {lid} != eager"
            _check(outs[lid][:_rows(m)], want[:_rows(m)], f"replay {i} layer {lid}")
