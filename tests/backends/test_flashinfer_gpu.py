"""The FlashInfer family under real CUDA graphs (GPU only, marked ``cuda``; the FlashInfer
backends also need ``import flashinfer``, skipped with the reason otherwise).

bf16 only, GQA 16 q / 4 KV heads d128 (tensor-core decode: the prefill kernels) and MLA 16 heads
512 + 64 (also on an e4m3 cache, sm_90), so that few FlashInfer kernel families compile (each JIT
compile takes tens of seconds on a fresh machine). For each backend and mode: capture one batch,
then replay A, B, A (raw_bs < bs, shuffled pages) with every graph buffer and the output poisoned
before replay preparation, which runs under ``torch.cuda.set_sync_debug_mode("error")``; replay == eager bitwise on real
rows, within bf16 tolerance of float64. EXTEND eagerly at real sizes. A tiny model with a
different backend per layer under the full-graph runner: replay == eager bitwise, one
FlashInfer plan per step.

The bodies also run on the CPU (``runtime.graphs`` stand-ins for the graphs; ``NAMES`` maps the
FlashInfer backends to the emulated ones of tests/support/fi_emulation.py): call them directly
where flashinfer imports to check them without a GPU.
"""
import contextlib
import importlib.util
import random

import pytest
import torch
from reference import dense_reference

from attn_backends import ForwardMode, ModelConfig
from attn_backends import get_backend as _get_backend
from attn_backends.check.layout_checks import poison
from attn_backends.check.scenarios import (
    Scenario,
    draft_decode_spec,
    draft_extend_spec,
    make_memory,
    materialize,
    verify_spec,
)

HAS_FI = importlib.util.find_spec("flashinfer") is not None
needs_fi = pytest.mark.skipif(not HAS_FI,
                              reason="flashinfer is not installed (pip install 'attn-backends[flashinfer]')")
pytestmark = pytest.mark.cuda
BS = 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES: dict = {}              # backend name -> the one to build (the CPU dry run's emulated FlashInfer)


def get_backend(name, cfg, mem):
    return _get_backend(NAMES.get(name, name), cfg, mem)


@contextlib.contextmanager
def no_sync():
    """Replay preparation under CUDA's sync debug mode: a host sync raises."""
    if DEVICE != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
MODES = {"flashinfer": ["decode", "verify_chain", "verify_tree", "draft_extend", "draft_decode"],
         "flashinfer_mla": ["decode", "verify_chain", "draft_extend"],
         "trtllm_mla": ["decode", "verify_chain", "verify_tree", "draft_extend"],
         "hybrid": ["decode", "verify_chain"]}
MLA_BACKENDS = ("flashinfer_mla", "trtllm_mla")
CASES = [pytest.param(b, m, ps, marks=needs_fi if b != "trtllm_mla" else ())
         for b, ms in MODES.items() for m in ms for ps in (1, 16, 64)]


def _scenario(mode, rng, raw):
    pick = lambda lo=0: [rng.randint(lo, 3000) for _ in range(raw)]  # noqa: E731
    if mode == "decode":
        return Scenario(ForwardMode.DECODE, BS, pick())
    if mode == "verify_chain":
        return Scenario(ForwardMode.TARGET_VERIFY, BS, pick(), spec=verify_spec(4, BS, rng, device=DEVICE))
    if mode == "verify_tree":
        return Scenario(ForwardMode.TARGET_VERIFY, BS, pick(), spec=verify_spec(8, BS, rng, topk=4, steps=3,
                                                                                device=DEVICE))
    if mode == "draft_extend":
        return Scenario(ForwardMode.DRAFT_EXTEND, BS, pick(),
                        spec=draft_extend_spec(4, BS, raw, [rng.randint(1, 4) for _ in range(raw)], device=DEVICE))
    if mode == "draft_decode":
        return Scenario(ForwardMode.DECODE, BS, pick(8), spec=draft_decode_spec(4, 3, 3))
    raise ValueError(mode)


def _config(backend, ps, kv=None):
    if backend in MLA_BACKENDS:             # an FP8 cache's scale is no bf16 value: the kernel rounds it
        return ModelConfig(num_layers=1, num_q_heads=16, is_mla=True, page_size=ps, dtype=torch.bfloat16,
                           kv_dtype=kv, kv_scales=((0.0372, 0.0372),) if kv else None)
    return ModelConfig(num_layers=1, num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=ps,
                       dtype=torch.bfloat16)


def _qkv(cfg, n, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, device=DEVICE, dtype=cfg.dtype)  # noqa: E731
    v = None if cfg.is_mla else mk(n, cfg.num_kv_heads, cfg.v_head_dim)
    return mk(n, cfg.num_q_heads, cfg.qk_dim), mk(n, cfg.num_kv_heads, cfg.qk_dim), v


def _capture(be, cfg, cap):
    """Capture ``be.forward`` of the capture batch (``runtime.graphs``: a warm-up on a side
    stream, then the capture; on the CPU the stand-in re-runs it at replay); returns (graph,
    static q/k/v, output)."""
    from attn_backends_runtime.graphs import make_graph
    n = cap.batch.num_tokens
    q_s, k_s, v_s = _qkv(cfg, n, 0)
    be.init_cuda_graph_state(BS, n)
    be.init_forward_metadata_capture_cuda_graph(cap.batch.graph_inputs())
    layer = cfg.layer(0)
    g = make_graph(torch.device(DEVICE), torch.cuda.graph_pool_handle() if DEVICE == "cuda" else None)
    out_s = g.capture(lambda: be.forward(q_s, k_s, v_s, layer, cap.batch))
    return g, (q_s, k_s, v_s), out_s


@pytest.mark.parametrize("backend,mode,ps", CASES)
def test_replay_equals_eager_and_reference(backend, mode, ps):
    _replay_case(backend, mode, ps)


@needs_fi
@pytest.mark.parametrize("mode", MODES["flashinfer_mla"])
@pytest.mark.parametrize("ps", [1, 64])
def test_fp8_mla_replay_equals_eager_and_reference(mode, ps):
    """flashinfer_mla on an e4m3 cache (FlashInfer reads it on sm_90 alone): the plan's KV dtype and
    the run's scales captured with the kernels."""
    if DEVICE == "cuda" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashInfer's MLA reads FP8 on sm_90 only")
    _replay_case("flashinfer_mla", mode, ps, torch.float8_e4m3fn)


def _replay_case(backend, mode, ps, kv=None):
    rng = random.Random(hash((backend, mode, ps)) & 0xFFFF)
    cfg = _config(backend, ps, kv)
    mem = make_memory(cfg, num_pages=4 * BS * 3200 // ps + 8, max_reqs=4 * BS, max_context_len=3200 + 64,
                      page_order="shuffled", seed=ps, device=DEVICE)
    graph_be, eager_be = get_backend(backend, cfg, mem), get_backend(backend, cfg, mem)
    fill = graph_be.get_cuda_graph_seq_len_fill_value()
    cap = materialize(_scenario(mode, rng, BS), mem, fill)
    a, b = materialize(_scenario(mode, rng, 5), mem, fill), materialize(_scenario(mode, rng, 3), mem, fill)
    g, (q_s, k_s, v_s), out_s = _capture(graph_be, cfg, cap)
    loc_s, layer, seen = cap.batch.out_cache_loc, cfg.layer(0), {}
    for tag, m in [("A", a), ("B", b), ("A", a)]:
        q, k, v = _qkv(cfg, cap.batch.num_tokens, 1 if tag == "A" else 2)
        q_s.copy_(q), k_s.copy_(k), loc_s.copy_(m.batch.out_cache_loc)
        if v is not None:
            v_s.copy_(v)
        poison(graph_be.graph_buffers())          # every buffer a captured run reads is rewritten below
        out_s.fill_(float("nan"))
        with no_sync():
            graph_be.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
        g.replay()
        replayed = out_s.clone()
        eager_be.init_forward_metadata(m.batch)
        eager = eager_be.forward(q, k, v, layer, m.batch)
        rows = m.batch.raw_bs * m.scenario.width
        assert torch.equal(replayed[:rows], eager[:rows]), f"{tag}: replay != eager (bitwise) on real rows"
        ref = dense_reference(m.batch, mem, 0, q.cpu(), layer.scaling, cfg.kv_lora_rank, layer.k_scale,
                              layer.v_scale)[:rows]
        err = float((replayed[:rows].double().cpu() - ref).norm() / ref.norm())
        assert err < 2e-2, f"{tag}: relative error {err:.3e} vs float64"
        if tag in seen:
            assert torch.equal(seen[tag], replayed[:rows]), "history A, B, A: A differs"
        seen[tag] = replayed[:rows]


@needs_fi
@pytest.mark.parametrize("backend", ["flashinfer", "flashinfer_mla", "hybrid"])
@pytest.mark.parametrize("ps", [1, 64])
def test_extend_real_sizes(backend, ps):
    """Ragged EXTEND (prefill chunks after a cached prefix), eager, against float64."""
    cfg = _config("flashinfer_mla" if backend == "flashinfer_mla" else "flashinfer", ps)
    mem = make_memory(cfg, num_pages=6 * 2048 // ps + 8, max_reqs=8, max_context_len=2048,
                      page_order="shuffled", seed=ps, device=DEVICE)
    be = get_backend(backend, cfg, mem)
    m = materialize(Scenario(ForwardMode.EXTEND, 4, [0, 1500, 64, 333], extend_lens=[1, 37, 300, 129]), mem, 1)
    q, k, v = _qkv(cfg, m.batch.num_tokens, 5)
    be.init_forward_metadata(m.batch)
    out = be.forward(q, k, v, cfg.layer(0), m.batch)
    ref = dense_reference(m.batch, mem, 0, q.cpu(), cfg.layer(0).scaling, cfg.kv_lora_rank)
    err = float((out.double().cpu() - ref).norm() / ref.norm())
    assert err < 2e-2, f"relative error {err:.3e}"


def _per_layer_runner(which, mode):
    from attn_backends_runtime.full_graph import UniformGraphRunner
    from attn_backends_runtime.models import TinyConfig, TinyModel
    tc = TinyConfig.gpu_mla() if which == "mla" else TinyConfig.gpu_gqa()
    names = (["flashinfer_mla", "triton_mla", "trtllm_mla", "flashinfer_mla"] if which == "mla"
             else ["flashinfer", "triton", "flashinfer", "triton"])
    model, cfg = TinyModel(tc, DEVICE), tc.attention()
    mem = make_memory(cfg, num_pages=40 * 1024 // tc.page_size + 8, max_reqs=40, max_context_len=1024,
                      seed=3, device=DEVICE, fill=False)
    layers = [get_backend(n, cfg, mem) for n in names]
    spec = verify_spec(4, 8, random.Random(0), device=DEVICE) if mode == ForwardMode.TARGET_VERIFY else None
    runner = UniformGraphRunner(model, layers, mem, mode, [4, 8], spec=spec)
    runner.capture()
    return tc, model, mem, names, runner


@pytest.fixture
def fi_plans(monkeypatch):
    """Counts FlashInfer's scheduling per wrapper: full ``plan()`` calls and the light replans of
    replays (the backends' ``replan``, FlashInfer's scheduler call alone), whichever a step takes."""
    import flashinfer

    from attn_backends.backends import flashinfer_backend, flashinfer_mla
    counts = []
    for cls, meth in ((flashinfer.BatchDecodeWithPagedKVCacheWrapper, "plan"),
                      (flashinfer.BatchPrefillWithPagedKVCacheWrapper, "plan"),
                      (flashinfer.mla.BatchMLAPagedAttentionWrapper, "plan"),
                      (flashinfer_backend.DecodeCall, "replan"), (flashinfer_backend.PrefillCall, "replan"),
                      (flashinfer_mla.MLACall, "replan")):
        real = getattr(cls, meth)

        def counting(self, *a, _real=real, _name=f"{cls.__name__}.{meth}", **k):
            counts.append(_name)
            return _real(self, *a, **k)
        monkeypatch.setattr(cls, meth, counting)
    return counts


@needs_fi
@pytest.mark.parametrize("which", ["gqa", "mla"])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY], ids=["decode", "verify"])
def test_tiny_model_with_a_backend_per_layer_replays_like_eager(which, mode, fi_plans):
    """4 layers on 2-3 backends (FlashInfer on two of them): one FlashInfer plan per step, replay
    preparation without a host sync, replay == eager on the same padded batch bitwise, A, B, A."""
    from attn_backends_runtime.runner_base import run_eager
    tc, model, mem, names, runner = _per_layer_runner(which, mode)
    w = 1 if mode == ForwardMode.DECODE else 4
    batches = {}
    for tag, raw, bucket in [("A", 7, 8), ("B", 3, 4)]:
        rng = random.Random(raw)
        spec = None if w == 1 else verify_spec(4, bucket, rng, device=DEVICE)
        m = materialize(Scenario(mode, bucket, [rng.randint(0, 900) for _ in range(raw)], spec=spec), mem, 1)
        m.batch.input_ids = torch.randint(0, tc.vocab_size, (m.batch.num_tokens,), device=DEVICE)
        batches[tag] = m.batch
    seen = {}
    for tag in ("A", "B", "A"):
        batch = batches[tag]
        fi_plans.clear()
        with no_sync():
            key, sb = runner.prepare(batch)
        assert len(fi_plans) == 1, f"{fi_plans}: FlashInfer planned {len(fi_plans)} times for {names} in one step"
        runner.graphs[key][0].replay()
        out = runner._slice(runner.graphs[key][1], batch, sb).logits
        want = run_eager(model, runner.layer_backends, batch, w).logits
        assert torch.equal(out, want), f"{tag}: replay != eager (bitwise)"
        if tag in seen:
            assert torch.equal(seen[tag], out), "history A, B, A: A differs"
        seen[tag] = out

