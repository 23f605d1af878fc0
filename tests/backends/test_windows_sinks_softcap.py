"""torch_native's sliding windows, sinks and softcap against an independent float64 brute force.

The brute force loops over rows, heads and keys of each request from the batch's definition: KV
through ``req_to_token``, every row's absolute position (a tree-verify draft token at the prefix
plus its depth, walked up a parent list this file draws; a draft-decode token at the draft prefix
plus its step), the cap on the scaled score before the window and the causal / tree / branch mask,
and the sink in the denominator alone. Ragged lengths, shuffled pages, padded buckets, page sizes
1 and 16, windows of 1, smaller than W, not a multiple of the page size, larger than the sequence.
"""
import math
import random

import pytest
import torch

from attn_backends import ForwardMode, ModelConfig, SpecInfo, get_backend
from attn_backends.check.scenarios import (
    Scenario,
    draft_decode_spec,
    draft_extend_spec,
    make_memory,
    materialize,
)

H, HKV, D = 4, 2, 16
# The Triton backend's cases: on the GPU where there is one (GPU tests), else in the interpreter.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
on_triton_device = pytest.mark.cuda if TRITON_DEVICE == "cuda" else (lambda f: f)


def _parents(n: int, rng: random.Random) -> list:
    """A random tree over n draft tokens rooted at token 0, deep enough for windows to cut it."""
    return [-1] + [rng.randrange(max(0, j - 2), j) for j in range(1, n)]


def _tree_spec(n: int, bs: int, rng: random.Random) -> SpecInfo:
    parents = [_parents(n, rng) for _ in range(bs)]
    masks = torch.zeros(bs, n, n, dtype=torch.bool)
    for i, par in enumerate(parents):
        for j in range(n):
            k = j
            while k >= 0:
                masks[i, j, k] = True
                k = par[k]
    return SpecInfo(num_draft_tokens=n, topk=4, num_steps=n - 1, tree_mask=masks), parents


SCENARIOS = {
    "decode_padded": lambda rng: (Scenario(ForwardMode.DECODE, 4, [5, 17, 40]), None),
    "extend_ragged": lambda rng: (Scenario(ForwardMode.EXTEND, 3, [0, 7, 20], extend_lens=[5, 1, 19]), None),
    "verify_chain_n4": lambda rng: (Scenario(ForwardMode.TARGET_VERIFY, 4, [10, 21, 33],
                                             spec=SpecInfo(num_draft_tokens=4, topk=1, num_steps=3)), None),
    "verify_tree_n8": lambda rng: (lambda sp: (Scenario(ForwardMode.TARGET_VERIFY, 4, [9, 30, 45], spec=sp[0]),
                                               sp[1]))(_tree_spec(8, 4, rng)),
    "draft_extend_n4": lambda rng: (Scenario(ForwardMode.DRAFT_EXTEND, 4, [10, 20, 30],
                                             spec=draft_extend_spec(4, 4, 3, [1, 3, 2])), None),
    "draft_decode_topk4": lambda rng: (Scenario(ForwardMode.DECODE, 3, [9 + 12, 23 + 12],
                                                spec=draft_decode_spec(4, 3, 3)), None),
    "draft_decode_chain": lambda rng: (Scenario(ForwardMode.DECODE, 2, [30], spec=draft_decode_spec(1, 3, 2)), None),
}

# (window, softcap, sinks): None or the value; sinks of large magnitude, caps small enough to bind
FEATURES = {
    "w1": (1, None, None),
    "w3_below_W": (3, None, None),
    "w5_not_page_multiple": (5, None, None),
    "w37_cap": (37, 0.7, None),
    "w1000_over_seq": (1000, None, None),
    "cap_only": (None, 0.5, None),
    "sinks_only": (None, None, [9.0, -11.0, 0.5, 3.0]),
    "w6_cap_sinks": (6, 2.0, [-9.0, 12.0, 1.5, 0.0]),
}


def _positions(mode, spec, parents_i, prefix: int, n: int, seq: int):
    """(query positions [n], key positions [seq], visible [n, seq]) of one request, from the batch's
    definition: every token at its absolute position."""
    kpos, vis = list(range(seq)), [[p <= prefix + j for p in range(seq)] for j in range(n)]
    qpos = [prefix + j for j in range(n)]
    if mode == ForwardMode.TARGET_VERIFY and parents_i is not None:
        def depth(j):
            return 0 if parents_i[j] < 0 else 1 + depth(parents_i[j])

        def ancestors(j):
            return {j} | (ancestors(parents_i[j]) if parents_i[j] >= 0 else set())
        qpos = [prefix + depth(j) for j in range(n)]
        kpos = list(range(prefix)) + [prefix + depth(j) for j in range(n)]
        vis = [[p < prefix or (p - prefix) in ancestors(j) for p in range(seq)] for j in range(n)]
    elif mode == ForwardMode.DECODE and spec is not None and spec.is_draft_decode:
        t, step = spec.topk, spec.draft_step
        base = seq - t * step
        kpos = [p if p < base else base + (p - base) // t for p in range(seq)]
        qpos = [base + step - 1] * n
        vis = [[p < base or (p - base) % t == j for p in range(seq)] for j in range(n)]
    return qpos, kpos, vis


def brute_force(batch, mem, layer_id, q, scaling, window, cap, sinks, parents, rank=None):
    """float64 ``[T, H, Dv]`` for the real rows (pad rows NaN), one score at a time (MLA: the latent
    rows' first ``rank`` entries are the values)."""
    mode, spec = batch.forward_mode, batch.spec_info
    seqs = batch.seq_lens_cpu.tolist()
    new = batch.extend_seq_lens_cpu.tolist() if mode == ForwardMode.EXTEND else [batch.width] * batch.batch_size
    if mem.is_mla:
        kc = mem.pool.kv[layer_id].double().cpu()
        vc = kc[..., :rank]
    else:
        kc, vc = mem.pool.k[layer_id].double().cpu(), mem.pool.v[layer_id].double().cpu()
    hkv = kc.shape[1]
    out = torch.full((q.shape[0], H, vc.shape[-1]), float("nan"), dtype=torch.float64)
    row0 = 0
    for i in range(batch.raw_bs):
        seq, n = seqs[i], new[i]
        slots = mem.req_to_token[int(batch.req_pool_indices[i]), :seq].long().cpu()
        qpos, kpos, vis = _positions(mode, spec, parents[i] if parents else None, seq - n, n, seq)
        for j in range(n):
            for h in range(H):
                qv = q[row0 + j, h].double()
                logits, values = [], []
                for p in range(seq):
                    s = float(qv @ kc[slots[p], h * hkv // H]) * scaling
                    if cap is not None:
                        s = cap * math.tanh(s / cap)
                    if vis[j][p] and (window is None or kpos[p] >= qpos[j] - window + 1):
                        logits.append(s)
                        values.append(vc[slots[p], h * hkv // H])
                extra = [sinks[h]] if sinks is not None else []
                m = max(logits + extra)
                den = sum(math.exp(x - m) for x in logits + extra)
                out[row0 + j, h] = sum(math.exp(x - m) * v for x, v in zip(logits, values)) / den
        row0 += n
    return out


def _run(scn_name, feat, ps, seed, graph=False, mla=False, backend="torch_native", device="cpu"):
    window, cap, sinks = FEATURES[feat]
    rng = random.Random(seed)
    kind = dict(num_kv_heads=1, is_mla=True, kv_lora_rank=D, qk_rope_head_dim=8) if mla else \
        dict(num_kv_heads=HKV, head_dim=D)
    cfg = ModelConfig(num_layers=2, num_q_heads=H, **kind, page_size=ps,
                      sliding_window=window, logit_softcap=cap, sinks=sinks is not None,
                      layer_types=None if window is None else ("full_attention", "sliding_attention"))
    mem = make_memory(cfg, num_pages=4096 // ps + 4, max_reqs=16, max_context_len=1024,
                      page_order="shuffled", seed=seed, device=device)
    be = get_backend(backend, cfg, mem)
    scn, parents = SCENARIOS[scn_name](rng)
    m = materialize(scn, mem, be.get_cuda_graph_seq_len_fill_value())
    gen = torch.Generator().manual_seed(seed)
    n = m.batch.num_tokens
    q = (3 * torch.randn(n, H, cfg.qk_dim, generator=gen)).to(device)   # scores of several units: the cap binds
    k = torch.randn(n, cfg.num_kv_heads, cfg.qk_dim, generator=gen).to(device)
    v = None if mla else torch.randn(n, HKV, D, generator=gen).to(device)
    layer = cfg.layer(1, sinks=None if sinks is None else torch.tensor(sinks, device=device))
    assert (layer.window, layer.softcap) == (window, cap)
    if graph:
        cap_m = materialize(SCENARIOS[scn_name](rng)[0], mem, be.get_cuda_graph_seq_len_fill_value())
        be.init_cuda_graph_state(8, 64)
        be.init_forward_metadata_capture_cuda_graph(cap_m.batch.graph_inputs())
        be.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
    else:
        be.init_forward_metadata(m.batch)
    out = be.forward(q, k, v, layer, m.batch).cpu()
    ref = brute_force(m.batch, mem, 1, q.cpu(), layer.scaling, window, cap, sinks, parents, cfg.kv_lora_rank)
    real = ~ref[:, 0, 0].isnan()
    assert torch.isfinite(out).all(), "pad rows must stay finite"
    for h in range(H):        # per head: a large sink shrinks one head's output by orders of magnitude
        err = (out[real, h].double() - ref[real, h]).norm() / ref[real, h].norm()
        assert err < 1e-5, f"head {h}: relative error {err:.2e}"


@pytest.mark.parametrize("feat", ["w1", "w5_not_page_multiple", "w6_cap_sinks"])
@pytest.mark.parametrize("scn_name", list(SCENARIOS))
@on_triton_device
def test_triton_matches_brute_force(scn_name, feat):
    """The Triton kernels in every mode: decode and verify rows through the chunk schedule, extend
    and draft rows through the split pass; a tree's and a draft branch's window by depth and step."""
    _run(scn_name, feat, 16, seed=7 + len(feat), backend="triton", device=TRITON_DEVICE)


@pytest.mark.parametrize("scn_name", ["verify_tree_n8", "draft_decode_topk4", "decode_padded"])
@on_triton_device
def test_triton_graph_path_matches_brute_force(scn_name):
    _run(scn_name, "w6_cap_sinks", 16, seed=5, graph=True, backend="triton", device=TRITON_DEVICE)


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("feat", list(FEATURES))
@pytest.mark.parametrize("scn_name", list(SCENARIOS))
def test_reference_matches_brute_force(scn_name, feat, ps):
    _run(scn_name, feat, ps, seed=ps * 31 + len(feat))


@pytest.mark.parametrize("scn_name", ["verify_tree_n8", "draft_decode_topk4", "draft_extend_n4"])
def test_graph_path_matches_brute_force(scn_name):
    """Capture one batch, replay another: the static key extent changes nothing."""
    _run(scn_name, "w6_cap_sinks", 16, seed=5, graph=True)


@pytest.mark.parametrize("feat", ["w3_below_W", "w6_cap_sinks"])
@pytest.mark.parametrize("scn_name", ["extend_ragged", "verify_tree_n8", "draft_decode_topk4"])
def test_mla_reference_matches_brute_force(scn_name, feat):
    """The reference's semantics hold for absorbed MLA too (no MLA model uses them; no MLA backend
    declares them), over the latent cache."""
    _run(scn_name, feat, 16, seed=3, mla=True)
