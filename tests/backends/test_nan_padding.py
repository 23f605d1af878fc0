"""Issue #11 defect 1: NaN that padding rows write into the reserved slot 0 never reaches a real
row, in graph mode (every uniform mode, MHA and MLA: ``max_seq_len_k`` is the capacity, so every
request gathers positions past its length through the reserved page) and eagerly (a request
shorter than the batch's longest). Static buffers of a captured graph hold garbage in their pad
rows in real engines; ``0 * NaN`` must not turn that into a real row's output."""
import random

import pytest
import torch

from attn_backends import ForwardMode, ModelConfig, get_backend
from attn_backends.check.scenarios import (
    Scenario,
    draft_decode_spec,
    draft_extend_spec,
    make_memory,
    materialize,
    verify_spec,
)

MHA = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16)
MLA = ModelConfig(num_layers=1, num_q_heads=4, is_mla=True, kv_lora_rank=32, qk_rope_head_dim=8, page_size=16)
MODES = ["decode", "verify_chain", "verify_tree", "draft_extend", "draft_decode"]


def _scenario(mode: str, bs: int, prefixes: list, rng) -> Scenario:
    raw = len(prefixes)
    spec = {"decode": None,
            "verify_chain": verify_spec(3, bs, rng),
            "verify_tree": verify_spec(4, bs, rng, topk=2, steps=2),
            "draft_extend": draft_extend_spec(3, bs, raw, [2] * raw),
            "draft_decode": draft_decode_spec(2, 2, 2)}[mode]
    kind = {"verify_chain": ForwardMode.TARGET_VERIFY, "verify_tree": ForwardMode.TARGET_VERIFY,
            "draft_extend": ForwardMode.DRAFT_EXTEND}.get(mode, ForwardMode.DECODE)
    return Scenario(kind, bs, prefixes, spec, name=mode)


def _qkv(cfg: ModelConfig, rows: int, raw_rows: int, pad_value: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, cfg.num_q_heads, cfg.qk_dim, generator=g)
    k = torch.randn(rows, cfg.num_kv_heads, cfg.qk_dim, generator=g)
    v = None if cfg.is_mla else torch.randn(rows, cfg.num_kv_heads, cfg.out_dim, generator=g)
    k[raw_rows:] = pad_value                       # what a padding row's static input may hold
    if v is not None:
        v[raw_rows:] = pad_value
    return q, k, v


def _run(backend_name, cfg, mode, graph: bool, pad_value: float):
    """The real rows' output of one forward whose padding rows carry ``pad_value`` K/V."""
    mem = make_memory(cfg, num_pages=40, max_reqs=8, max_context_len=128, seed=3)
    be = get_backend(backend_name, cfg, mem)
    rng = random.Random(5)
    prefixes = [21] if graph else [37, 4]          # eager: a request shorter than the longest
    bs = 2 if graph else 3
    m = materialize(_scenario(mode, bs, prefixes, rng), mem, be.get_cuda_graph_seq_len_fill_value())
    b = m.batch
    if graph:
        be.init_cuda_graph_state(4, 4 * 4)
        be.init_forward_metadata_capture_cuda_graph(b.graph_inputs())
        be.init_forward_metadata_replay_cuda_graph(b.graph_inputs())
    else:
        be.init_forward_metadata(b)
    w = b.width
    q, k, v = _qkv(cfg, b.num_tokens, b.raw_bs * w, pad_value, seed=11)
    out = be.forward(q, k, v, cfg.layer(0), b)
    assert torch.isnan(mem.pool.kv[0] if cfg.is_mla else mem.pool.k[0])[0].all() == (pad_value != pad_value)
    return out[:b.raw_bs * w]


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("cfg", [MHA, MLA], ids=["mha", "mla"])
@pytest.mark.parametrize("mode", MODES)
def test_nan_in_padding_rows_never_reaches_real_rows(mode, cfg, graph):
    got = _run("torch_native", cfg, mode, graph, float("nan"))
    assert torch.isfinite(got).all(), f"{mode}: NaN stored by padding rows reached a real row"
    clean = _run("torch_native", cfg, mode, graph, 0.0)
    assert torch.equal(got, clean), f"{mode}: the padding rows' K/V changed a real row"


@pytest.mark.parametrize("cfg", [MHA, MLA], ids=["mha", "mla"])
@pytest.mark.parametrize("mode", ["decode", "verify_tree"])
def test_triton_backends_are_immune_too(mode, cfg):
    name = "triton_mla" if cfg.is_mla else "triton"
    got = _run(name, cfg, mode, True, float("nan"))
    assert torch.isfinite(got).all()
    assert torch.equal(got, _run(name, cfg, mode, True, 0.0))
