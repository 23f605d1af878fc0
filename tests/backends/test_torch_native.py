"""torch_native against the independent float64 dense attention, every mode, MHA and MLA,
page sizes 1/16/64, shuffled pages, ragged lengths, padded buckets; eager and through the
graph metadata path (capture one batch, replay another)."""
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

RNG = random.Random(0)


def named_batches():
    """(name, scenario factory) pairs: each factory draws fresh specs."""
    return {
        "decode_padded": lambda: Scenario(ForwardMode.DECODE, 4, [5, 17, 40]),
        "decode_len1": lambda: Scenario(ForwardMode.DECODE, 2, [0, 63]),
        "extend_ragged": lambda: Scenario(ForwardMode.EXTEND, 3, [0, 7, 20], extend_lens=[5, 1, 19]),
        "extend_chunked": lambda: Scenario(ForwardMode.EXTEND, 2, [64, 15], extend_lens=[16, 33]),
        "verify_n2": lambda: Scenario(ForwardMode.TARGET_VERIFY, 4, [10, 20, 30], spec=verify_spec(2, 4, RNG)),
        "verify_n8": lambda: Scenario(ForwardMode.TARGET_VERIFY, 3, [63, 1], spec=verify_spec(8, 3, RNG)),
        "verify_tree": lambda: Scenario(ForwardMode.TARGET_VERIFY, 4, [10, 33, 65],
                                        spec=verify_spec(6, 4, RNG, topk=4, steps=2)),
        "draft_extend": lambda: Scenario(ForwardMode.DRAFT_EXTEND, 4, [10, 20, 30],
                                         spec=draft_extend_spec(4, 4, 3, [1, 3, 2])),
        "draft_decode_topk4": lambda: Scenario(ForwardMode.DECODE, 3, [9 + 4, 23 + 4],
                                               spec=draft_decode_spec(4, 3, 2)),
        "draft_decode_chain": lambda: Scenario(ForwardMode.DECODE, 2, [30], spec=draft_decode_spec(1, 3, 3)),
    }


def _setup(mla: bool, ps: int):
    cfg = ModelConfig(num_layers=2, num_q_heads=4, num_kv_heads=1 if mla else 2, head_dim=32, is_mla=mla,
                      kv_lora_rank=64, qk_rope_head_dim=16, page_size=ps)
    mem = make_memory(cfg, num_pages=2048 // ps + 4, max_reqs=16, max_context_len=128,
                      page_order="shuffled", seed=ps + mla)
    return cfg, mem, get_backend("torch_native", cfg, mem)


def _qkv(cfg, n, gen):
    q = torch.randn(n, cfg.num_q_heads, cfg.qk_dim, generator=gen)
    k = torch.randn(n, cfg.num_kv_heads, cfg.qk_dim, generator=gen)
    v = None if cfg.is_mla else torch.randn(n, cfg.num_kv_heads, cfg.v_head_dim, generator=gen)
    return q, k, v


def _check(out, ref, batch):
    real = ~ref[:, 0, 0].isnan()
    assert real.sum() > 0
    err = (out[real].double() - ref[real]).norm() / ref[real].norm()
    assert err < 1e-5, f"relative error {err:.2e}"
    assert torch.isfinite(out).all(), "pad rows must stay finite"


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("name", list(named_batches()))
def test_eager_matches_float64(mla, ps, name):
    cfg, mem, be = _setup(mla, ps)
    m = materialize(named_batches()[name](), mem, be.get_cuda_graph_seq_len_fill_value())
    gen = torch.Generator().manual_seed(ps)
    q, k, v = _qkv(cfg, m.batch.num_tokens, gen)
    be.init_forward_metadata(m.batch)
    out = be.forward(q, k, v, cfg.layer(1), m.batch)
    _check(out, dense_reference(m.batch, mem, 1, q, cfg.layer(1).scaling, cfg.kv_lora_rank), m.batch)


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("ps", [1, 64])
@pytest.mark.parametrize("name", ["decode_padded", "verify_n8", "verify_tree", "draft_extend", "draft_decode_topk4"])
def test_graph_path_matches_eager_and_float64(mla, ps, name):
    """Capture with one batch, replay a different one: replay output == eager (float32
    rounding aside: the static max_seq_len_k pads the key axis) == float64 reference."""
    cfg, mem, be = _setup(mla, ps)
    fill = be.get_cuda_graph_seq_len_fill_value()
    cap = materialize(named_batches()[name](), mem, fill)
    m = materialize(named_batches()[name](), mem, fill)
    gen = torch.Generator().manual_seed(7)
    q, k, v = _qkv(cfg, m.batch.num_tokens, gen)
    be.init_cuda_graph_state(8, 64)
    be.init_forward_metadata_capture_cuda_graph(cap.batch.graph_inputs())
    be.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
    out_graph = be.forward(q, k, v, cfg.layer(0), m.batch)
    be.init_forward_metadata(m.batch)
    out_eager = be.forward(q, k, v, cfg.layer(0), m.batch, save_kv_cache=False)
    ref = dense_reference(m.batch, mem, 0, q, cfg.layer(0).scaling, cfg.kv_lora_rank)
    _check(out_graph, ref, m.batch)
    real = ~ref[:, 0, 0].isnan()
    torch.testing.assert_close(out_graph[real], out_eager[real], rtol=1e-6, atol=1e-6)


def test_kv_written_at_out_cache_loc():
    cfg, mem, be = _setup(False, 16)
    m = materialize(named_batches()["verify_n2"](), mem, 1)
    q, k, v = _qkv(cfg, m.batch.num_tokens, torch.Generator().manual_seed(1))
    be.init_forward_metadata(m.batch)
    be.forward(q, k, v, cfg.layer(1), m.batch)
    real = m.batch.out_cache_loc[: m.scenario.raw_bs * 2]
    assert torch.equal(mem.pool.k[1][real], k[: len(real)])
    assert torch.equal(mem.pool.v[1][real], v[: len(real)])
