"""Backends under real CUDA graphs (GPU only): capture each backend's forward with one batch,
replay different ragged batches (raw_bs < bs, shuffled pages, outputs poisoned first).
Replay == eager bitwise on real rows, both within bf16 tolerance of float64; replay
preparation runs under torch.cuda.set_sync_debug_mode("error"); history A, B, A."""
import random

import pytest
import torch
from reference import dense_reference

from attn_backends import ForwardMode, ModelConfig, get_backend
from attn_backends.check.scenarios import (
    Scenario,
    draft_decode_spec,
    draft_extend_spec,
    make_memory,
    materialize,
    verify_spec,
)

pytestmark = pytest.mark.cuda
BS = 8


def _scenarios(mode, rng, raw, bs=BS):
    pick = lambda lo=0: [rng.randint(lo, 3000) for _ in range(raw)]  # noqa: E731
    if mode == "decode":
        return Scenario(ForwardMode.DECODE, bs, pick())
    if mode == "verify_chain":
        return Scenario(ForwardMode.TARGET_VERIFY, bs, pick(), spec=verify_spec(4, bs, rng, device="cuda"))
    if mode == "verify_tree":
        spec = verify_spec(8, BS, rng, topk=4, steps=3, device="cuda")
        return Scenario(ForwardMode.TARGET_VERIFY, BS, pick(), spec=spec)
    if mode == "draft_extend":
        return Scenario(ForwardMode.DRAFT_EXTEND, BS, pick(),
                        spec=draft_extend_spec(4, BS, raw, [rng.randint(1, 4) for _ in range(raw)], device="cuda"))
    if mode == "draft_decode":
        return Scenario(ForwardMode.DECODE, BS, pick(8), spec=draft_decode_spec(4, 3, 3))
    raise ValueError(mode)


def _config(backend, ps, dtype):
    if backend == "triton_mla":
        return ModelConfig(num_layers=1, num_q_heads=16, is_mla=True, page_size=ps, dtype=dtype)
    return ModelConfig(num_layers=1, num_q_heads=16, num_kv_heads=4, head_dim=128, page_size=ps, dtype=dtype)


def _qkv(cfg, n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=cfg.dtype)  # noqa: E731
    v = None if cfg.is_mla else mk(n, cfg.num_kv_heads, cfg.v_head_dim)
    return mk(n, cfg.num_q_heads, cfg.qk_dim), mk(n, cfg.num_kv_heads, cfg.qk_dim), v


MODES = {"triton": ["decode", "verify_chain", "verify_tree", "draft_extend", "draft_decode"],
         "triton_mla": ["decode", "verify_chain", "verify_tree", "draft_extend"]}
# bs 1 (decode, chain verify) takes the most KV splits (triton_common: 64, a decode of few programs up to
# 256, never past the pages): the merge at its widest, most splits holding tokens at contexts up to 3000
CASES = ([pytest.param(b, m, ps, BS, id=f"{b}-{m}-{ps}") for b, ms in MODES.items() for m in ms for ps in (1, 16, 64)]
         + [pytest.param(b, m, 16, 1, id=f"{b}-{m}-16-bs1") for b in MODES for m in ("decode", "verify_chain")])


@pytest.mark.parametrize("backend,mode,ps,bs", CASES)
def test_replay_equals_eager_and_reference(backend, mode, ps, bs):
    rng = random.Random(hash((backend, mode, ps, bs)) & 0xFFFF)
    cfg = _config(backend, ps, torch.bfloat16)
    mem = make_memory(cfg, num_pages=4 * BS * 3200 // ps + 8, max_reqs=4 * BS, max_context_len=3200 + 64,
                      page_order="shuffled", seed=ps, device="cuda")
    graph_be, eager_be = get_backend(backend, cfg, mem), get_backend(backend, cfg, mem)
    fill = graph_be.get_cuda_graph_seq_len_fill_value()
    cap = materialize(_scenarios(mode, rng, bs, bs), mem, fill)
    a = materialize(_scenarios(mode, rng, min(5, bs), bs), mem, fill)
    b = materialize(_scenarios(mode, rng, min(3, bs), bs), mem, fill)
    n = cap.batch.num_tokens
    layer = cfg.layer(0)
    q_s, k_s, v_s = _qkv(cfg, n, 0)
    batch_s = cap.batch
    loc_s = batch_s.out_cache_loc                         # the static out_cache_loc the graph reads
    graph_be.init_cuda_graph_state(bs, n)
    graph_be.init_forward_metadata_capture_cuda_graph(cap.batch.graph_inputs())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        graph_be.forward(q_s, k_s, v_s, layer, batch_s)  # warm-up (Triton compiles outside capture)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_s = graph_be.forward(q_s, k_s, v_s, layer, batch_s)
    seen = {}
    for tag, m in [("A", a), ("B", b), ("A", a)]:
        q, k, v = _qkv(cfg, n, 1 if tag == "A" else 2)
        q_s.copy_(q), k_s.copy_(k), loc_s.copy_(m.batch.out_cache_loc)
        if v is not None:
            v_s.copy_(v)
        out_s.fill_(float("nan"))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph_be.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        g.replay()
        replayed = out_s.clone()
        eager_be.init_forward_metadata(m.batch)
        eager = eager_be.forward(q, k, v, layer, m.batch)
        rows = m.batch.raw_bs * m.scenario.width
        assert torch.equal(replayed[:rows], eager[:rows]), "replay != eager (bitwise) on real rows"
        ref = dense_reference(m.batch, mem, 0, q.cpu(), layer.scaling, cfg.kv_lora_rank)[:rows]
        err = float((replayed[:rows].double().cpu() - ref).norm() / ref.norm())
        assert err < 2e-2, f"{tag}: relative error {err:.3e} vs float64"
        if tag in seen:
            assert torch.equal(seen[tag], replayed[:rows]), "history A, B, A: A differs"
        seen[tag] = replayed[:rows]


@pytest.mark.parametrize("backend", ["triton", "triton_mla"])
@pytest.mark.parametrize("ps", [1, 64])
def test_extend_real_sizes(backend, ps):
    """Ragged EXTEND (prefill chunks after a cached prefix) at model sizes, bf16, eager."""
    cfg = _config(backend, ps, torch.bfloat16)
    mem = make_memory(cfg, num_pages=6 * 2048 // ps + 8, max_reqs=8, max_context_len=2048,
                      page_order="shuffled", seed=ps, device="cuda")
    be = get_backend(backend, cfg, mem)
    ext = [1, 37, 300, 129]
    m = materialize(Scenario(ForwardMode.EXTEND, 4, [0, 1500, 64, 333], extend_lens=ext), mem, 1)
    q, k, v = _qkv(cfg, m.batch.num_tokens, 5)
    be.init_forward_metadata(m.batch)
    out = be.forward(q, k, v, cfg.layer(0), m.batch)
    ref = dense_reference(m.batch, mem, 0, q.cpu(), cfg.layer(0).scaling, cfg.kv_lora_rank)
    err = float((out.double().cpu() - ref).norm() / ref.norm())
    assert err < 2e-2, f"relative error {err:.3e}"
