"""The chunk schedule through the backend contract (``triton``: both schedules and both merges;
``triton_mla`` with ``schedule = "chunks"``), with requests long enough that a request's chunks
are merged (the other backend tests' contexts are shorter than a chunk): every uniform mode, eager
against the float64 reference and the graph metadata path (capture another batch, replay this one)
equal to eager bitwise."""
import dataclasses
import random

import pytest
import torch
from reference import dense_reference

from attn_backends import ForwardMode, ModelConfig
from attn_backends.backends.triton_backend import TritonBackend
from attn_backends.backends.triton_mla import TritonMLABackend
from attn_backends.check.scenarios import (
    Scenario,
    draft_decode_spec,
    draft_extend_spec,
    make_memory,
    materialize,
    verify_spec,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter on the CPU; on a GPU these are GPU tests (`pytest -m cuda` picks them)
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []
RNG = random.Random(0)
SCENARIOS = {
    "decode": lambda: Scenario(ForwardMode.DECODE, 5, [2000, 17, 0, 600]),
    "verify_chain": lambda: Scenario(ForwardMode.TARGET_VERIFY, 4, [1900, 3, 700], spec=verify_spec(4, 4, RNG)),
    "verify_tree": lambda: Scenario(ForwardMode.TARGET_VERIFY, 4, [1900, 33, 700],
                                    spec=verify_spec(6, 4, RNG, topk=4, steps=2)),
    "draft_extend": lambda: Scenario(ForwardMode.DRAFT_EXTEND, 4, [1900, 20, 700],
                                     spec=draft_extend_spec(4, 4, 3, [1, 3, 2])),
    "draft_decode_topk4": lambda: Scenario(ForwardMode.DECODE, 3, [1904, 27], spec=draft_decode_spec(4, 3, 2)),
}


def _mla_config():
    return ModelConfig(num_layers=2, num_q_heads=16, num_kv_heads=1, head_dim=16, is_mla=True, kv_lora_rank=32,
                       qk_rope_head_dim=16, page_size=16)


def _gqa_config():
    return ModelConfig(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16)


# (backend, batch_invariant, merge): the triton backend's schedules and merges; triton_mla's chunks
VARIANTS = [("triton", False, "last"), ("triton", True, "last"), ("triton", False, "pass"), ("triton", True, "pass"),
            ("triton_mla", False, "pass")]


@pytest.mark.parametrize("backend,invariant,merge", VARIANTS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_chunk_schedule_through_the_backend(name, backend, invariant, merge, exact=True):
    cfg = _mla_config() if backend == "triton_mla" else _gqa_config()
    mem = make_memory(cfg, num_pages=9000 // 16 + 64, max_reqs=12, max_context_len=3072, page_order="shuffled",
                      seed=1, device=DEVICE)
    if backend == "triton_mla":
        be = TritonMLABackend(cfg, mem)
        be.schedule = "chunks"
    else:
        be = TritonBackend(cfg, mem, batch_invariant=invariant)
        be.chunk_merge = merge
    be.EXACT_CHUNK_SPLITS = exact
    fill = be.get_cuda_graph_seq_len_fill_value()
    m = materialize(SCENARIOS[name](), mem, fill)
    g = torch.Generator().manual_seed(3)
    n = m.batch.num_tokens
    q, k = (torch.randn(n, h, cfg.qk_dim, generator=g).to(DEVICE) for h in (cfg.num_q_heads, cfg.num_kv_heads))
    v = None if cfg.is_mla else torch.randn(n, cfg.num_kv_heads, cfg.v_head_dim, generator=g).to(DEVICE)
    be.init_forward_metadata(m.batch)
    assert be._chunked(be.forward_metadata.layout), f"{name} did not take the chunk schedule"
    out = be.forward(q, k, v, cfg.layer(1), m.batch)
    ref = dense_reference(m.batch, mem, 1, q.cpu(), cfg.layer(1).scaling, cfg.kv_lora_rank)
    real = ~ref[:, 0, 0].isnan()
    err = float((out.cpu()[real].double() - ref[real]).norm() / ref[real].norm())
    assert err < 1e-4, f"relative error {err:.2e}"
    cap = materialize(SCENARIOS[name](), mem, fill)
    be.init_cuda_graph_state(8, 64)
    be.init_forward_metadata_capture_cuda_graph(cap.batch.graph_inputs())
    be.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
    replayed = be.forward(q, k, v, cfg.layer(1), m.batch, save_kv_cache=False)
    assert torch.equal(replayed.cpu()[real], out.cpu()[real]), "the graph path differs from eager on the same batch"


@pytest.mark.parametrize("invariant", [False, True])
def test_few_programs_decode_takes_the_split_pass(monkeypatch, invariant):
    """A decode of one request, or of at most 8 programs (requests x KV heads), takes the split pass (its
    merge in its own launch; chunks left a long request's merge a long chain), eager and through the graph
    path, against float64; five requests of 2 KV heads take the chunks, and the invariant schedule keeps its
    chunks at one request too (its bits must not depend on the batch)."""
    from attn_backends.backends import triton_backend
    monkeypatch.setattr(TritonBackend, "DEEP_TILE", 32)    # this config's 2 rows x 16 columns count as deep
    seen = []
    real = triton_backend.decode_attention_fwd
    monkeypatch.setattr(triton_backend, "decode_attention_fwd", lambda *a, **kw: seen.append(kw["schedule"])
                        or real(*a, **kw))
    cfg = _gqa_config()
    mem = make_memory(cfg, num_pages=11000 // 16 + 64, max_reqs=10, max_context_len=3072, page_order="shuffled",
                      seed=2, device=DEVICE)
    be = TritonBackend(cfg, mem, batch_invariant=invariant)
    for lens in ([2000], [2000, 17, 900, 300], [2000, 17, 900, 300, 1200]):     # 2, 8 and 10 programs
        m = materialize(Scenario(ForwardMode.DECODE, len(lens), lens), mem, be.get_cuda_graph_seq_len_fill_value())
        q = torch.randn(len(lens), cfg.num_q_heads, cfg.qk_dim, generator=torch.Generator().manual_seed(4)).to(DEVICE)
        be.init_forward_metadata(m.batch)
        del seen[:]
        out = be.forward(q, None, None, cfg.layer(1), m.batch, save_kv_cache=False)
        want = "invariant" if invariant else "split" if len(lens) <= 4 else "chunks"
        assert seen == [want], f"bs {len(lens)}: schedules {seen}, expected {want}"
        ref = dense_reference(m.batch, mem, 1, q.cpu(), cfg.layer(1).scaling, cfg.kv_lora_rank)
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert err < 1e-4, f"bs {len(lens)}: relative error {err:.2e}"
        be.init_cuda_graph_state(6, 6)
        be.init_forward_metadata_capture_cuda_graph(m.batch.graph_inputs())
        be.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
        replayed = be.forward(q, None, None, cfg.layer(1), m.batch, save_kv_cache=False)
        assert torch.equal(replayed, out), f"bs {len(lens)}: the graph path differs from eager"


def test_instances_of_other_merges_on_one_step_keep_their_own_launches():
    """Two ``triton`` instances on one eager step (a backend per layer), one merging by a second
    launch and one by the last chunk: each records and replays its own launches (a shared book
    would run one instance's merge for the other, its setting silently ignored); both outputs
    against float64."""
    from attn_backends.step.eager import eager_step
    cfg = _gqa_config()
    mem = make_memory(cfg, num_pages=9000 // 16 + 64, max_reqs=12, max_context_len=3072, page_order="shuffled",
                      seed=1, device=DEVICE)
    a, b = TritonBackend(cfg, mem), TritonBackend(cfg, mem)
    b.chunk_merge = "last" if a.chunk_merge == "pass" else "pass"
    m = materialize(SCENARIOS["decode"](), mem, a.get_cuda_graph_seq_len_fill_value())
    batch = eager_step(m.batch, [a, b])
    a.init_forward_metadata(batch)
    b.init_forward_metadata(batch)
    assert a.forward_metadata.book is not b.forward_metadata.book, "instances of other merges share launches"
    g = torch.Generator().manual_seed(5)
    q = torch.randn(batch.num_tokens, 4, 16, generator=g).to(DEVICE)
    for be, layer in ((a, 0), (b, 1)):
        out = be.forward(q, None, None, cfg.layer(layer), batch, save_kv_cache=False)
        ref = dense_reference(batch, mem, layer, q.cpu(), cfg.layer(layer).scaling, cfg.kv_lora_rank)
        real = ~ref[:, 0, 0].isnan()
        err = float((out.cpu()[real].double() - ref[real]).norm() / ref[real].norm())
        assert err < 1e-4, f"merge {be.chunk_merge}: relative error {err:.2e}"


@pytest.mark.parametrize("attr,value", [("schedule", "invariant"), ("chunk_merge", "last")])
def test_triton_mla_refuses_what_it_has_not(attr, value):
    """triton_mla has no batch-invariant mode and one chunk merge: asked for another, it says so
    at metadata time instead of running something else."""
    cfg = _mla_config()
    mem = make_memory(cfg, num_pages=64, max_reqs=4, max_context_len=256, device=DEVICE)
    be = TritonMLABackend(cfg, mem)
    setattr(be, attr, value)
    m = materialize(Scenario(ForwardMode.DECODE, 2, [40, 7]), mem, be.get_cuda_graph_seq_len_fill_value())
    with pytest.raises(ValueError, match=f"{value!r}"):
        be.init_forward_metadata(m.batch)


@pytest.mark.parametrize("hopper,kv_dtype,chunked", [(True, torch.bfloat16, True), (True, torch.float8_e4m3fn, False),
                                                     (False, torch.bfloat16, False)])
def test_triton_mla_auto_takes_the_chunks_where_the_gluon_kernels_run_them(monkeypatch, hopper, kv_dtype, chunked):
    """The default ``schedule = "auto"``: the chunk schedule for the uniform modes on a 16-bit cache on
    sm_90 (the Gluon kernels), the split on an FP8 cache or elsewhere, and never for ragged extend."""
    from attn_backends.backends import triton_mla
    from attn_backends.backends.triton_mla import SplitTritonMLABackend
    monkeypatch.setattr(triton_mla, "hopper_device", lambda device: hopper)
    cfg = dataclasses.replace(_mla_config(), dtype=torch.bfloat16, kv_dtype=kv_dtype)
    mem = make_memory(cfg, num_pages=64, max_reqs=12, max_context_len=256, device=DEVICE)
    auto, split = TritonMLABackend(cfg, mem), SplitTritonMLABackend(cfg, mem)
    assert auto.schedule == "auto"

    def layout(be, mode):
        extend = [5, 3] if mode == ForwardMode.EXTEND else None
        m = materialize(Scenario(mode, 2, [40, 7], extend_lens=extend), mem, be.get_cuda_graph_seq_len_fill_value())
        be.init_forward_metadata(m.batch)
        return be.forward_metadata.layout
    assert auto._chunked(layout(auto, ForwardMode.DECODE)) is chunked
    assert auto._chunked(layout(auto, ForwardMode.EXTEND)) is False
    assert split._chunked(layout(split, ForwardMode.DECODE)) is False
    if chunked:     # the wrapper gets a schedule it knows ("auto" is the backend's word): a forward runs
        m = materialize(Scenario(ForwardMode.DECODE, 2, [40, 7]), mem, auto.get_cuda_graph_seq_len_fill_value())
        auto.init_forward_metadata(m.batch)
        q = torch.randn(m.batch.num_tokens, cfg.num_q_heads, cfg.qk_dim).to(DEVICE, torch.bfloat16)
        out = auto.forward(q, None, None, cfg.layer(1), m.batch, save_kv_cache=False)
        assert out.shape == (2, cfg.num_q_heads, cfg.kv_lora_rank) and bool(out.float().isfinite().all())


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter takes 2 splits whatever the rule (choose_num_kv_splits)")
@pytest.mark.parametrize("backend", ["triton", "triton_mla"])
@pytest.mark.parametrize("name", ["decode", "verify_chain", "draft_decode_topk4"])
def test_exact_chunk_counts_through_the_backend(monkeypatch, name, backend):
    """``EXACT_CHUNK_SPLITS`` (the default) on a GPU whose SM count (patched to 37) makes the rule's
    counts odd: the chunk schedule at a count that is not a power of two, against the reference and
    replayed; and the power-of-two rule (``Pow2Splits*``) the same way."""
    from attn_backends.backends import triton_common
    monkeypatch.setattr(triton_common, "sm_count", lambda index: 37)
    seen = []
    real_choose = triton_common.choose_num_kv_splits
    monkeypatch.setattr(triton_common, "choose_num_kv_splits", lambda *a: seen.append(real_choose(*a)) or seen[-1])
    test_chunk_schedule_through_the_backend(name, backend, False, "pass", exact=True)
    assert seen and any(n & (n - 1) for n in seen), f"counts {seen}: all powers of two, the case is not exercised"
    test_chunk_schedule_through_the_backend(name, backend, False, "pass", exact=False)


@pytest.mark.parametrize("fits", [True, False])
def test_triton_mla_hands_the_wave_fit_to_the_chunk_pass(monkeypatch, fits, name="decode"):
    """``triton_mla`` passes ``_split_plan``'s fit to the chunk pass as ``fit`` (a launch without it
    would overrun one wave where the rule asks for the fit; a GPU decides it, so it is patched
    here), and the fitted schedule matches the reference and its replay."""
    from attn_backends.backends import triton_mla
    seen = []
    real = triton_mla.mla_chunk_fwd
    monkeypatch.setattr(triton_mla, "mla_chunk_fwd", lambda *a, **kw: seen.append(kw["fit"]) or real(*a, **kw))
    plan = TritonMLABackend._split_plan
    monkeypatch.setattr(TritonMLABackend, "_split_plan", lambda self, lay: (plan(self, lay)[0], fits, False))
    test_chunk_schedule_through_the_backend(name, "triton_mla", False, "pass")
    assert seen and set(seen) == {fits}, seen
