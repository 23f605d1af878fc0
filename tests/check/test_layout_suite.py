"""The layout-equivalence suite over every built-in backend available here, every mode it
declares; the worked example of issue #2; hypothesis over page sizes, layouts, buckets,
accept lengths, topk and histories."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attn_backends import ForwardMode, ModelConfig, get_backend, list_backends, select_rows
from attn_backends.backends.torch_native import TorchNativeBackend
from attn_backends.check.report import SuiteReport
from attn_backends.check.scenarios import PAGE_ORDERS, Scenario, draft_extend_spec, make_memory, materialize
from attn_backends.check.suite import CaseSpec, declared_modes, random_case, run_case, run_suite
from attn_backends.registry import builtin_names, get_backend_class

# Our built-ins only: a plugin installed on this machine is checked by `attn-backends check`, not here.
AVAILABLE = [b.name for b in list_backends("cpu") if b.available and b.name in builtin_names()]
PAIRS = [(b, m) for b in AVAILABLE for m in declared_modes(get_backend_class(b).capabilities)]
# Cases per run: the layout logic is the step's, shared by every LayoutBackend, so torch_native
# takes the many cases; a Triton backend on the CPU runs its kernels in the interpreter (seconds a
# case at MLA's 512 + 64 dims) and takes a few, its own metadata and numbers checked in each. On
# CUDA, `attn-backends check` runs 200 cases per mode on each (bench/run_gpu.sh, stage check).
INTERPRETED = [b for b in AVAILABLE if b != "torch_native" and not torch.cuda.is_available()]
NATIVE = [b for b in AVAILABLE if b not in INTERPRETED]
INTERPRETED_CASES = 2   # per mode: what fits the CPU suite in CI's time (the GPU runs 40)


def _assert_ok(report: SuiteReport):
    assert report.ok, report.table() + "\n" + "\n".join(map(str, report.failures[:5]))


@pytest.mark.parametrize("name", sorted(builtin_names()))
def test_cases_stay_within_the_capabilities(name):
    """The suite draws only cases a backend declares: a topk > 1 case for a backend without
    topk_gt1 fails capture with a LayoutError that is the suite's fault, not the backend's."""
    import random
    caps = get_backend_class(name).capabilities
    rng = random.Random(5)
    for mode in declared_modes(caps):
        for seed in range(60):
            c = random_case(rng, mode, caps, caps.mla and not caps.mha, seed)
            assert c.page_size in caps.page_sizes
            assert c.topk == 1 or caps.topk_gt1, (name, mode, c.topk)


@pytest.mark.parametrize("backend,mode", PAIRS, ids=[f"{b}-{m}" for b, m in PAIRS])
def test_suite_per_backend_and_mode(backend, mode):
    _assert_ok(run_suite(backend, cases=INTERPRETED_CASES if backend in INTERPRETED else 40, seed=11, modes=[mode]))


def test_worked_example():
    """bucket 4, raw_bs 3, N=4, accept [1,3,2], prefixes [10,20,30]."""
    cfg = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16)
    mem = make_memory(cfg, num_pages=40, max_reqs=8, max_context_len=256, page_order="shuffled", seed=3)
    be = get_backend("torch_native", cfg, mem)
    spec = draft_extend_spec(4, 4, 3, [1, 3, 2])
    fill = be.get_cuda_graph_seq_len_fill_value()
    m = materialize(Scenario(ForwardMode.DRAFT_EXTEND, 4, [10, 20, 30], spec), mem, fill)
    be.init_cuda_graph_state(8, 32)
    be.init_forward_metadata_capture_cuda_graph(m.batch.graph_inputs())
    be.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
    graph = be.forward_metadata.as_layout()
    be.init_forward_metadata(m.batch)
    eager = be.forward_metadata.as_layout()
    for lay in (graph, eager):
        assert lay["cu_seqlens_q"].tolist() == [0, 4, 8, 12, 16]
        assert lay["seq_lens_k"][:3].tolist() == [14, 24, 34]
        assert lay["seq_lens_k"][3] >= 4
        assert lay["max_seq_len_q"] == 4
    assert select_rows(4, 4, spec.accept_lens)[:3].tolist() == [0, 6, 9]


LAYOUT_CASES = [(ps, order, mode) for ps in (1, 16, 64) for order in PAGE_ORDERS
                for mode in ("decode", "verify_chain", "verify_tree", "draft_extend", "draft_decode")]


@pytest.mark.parametrize("ps,order,mode", LAYOUT_CASES)
def test_page_layouts(ps, order, mode):
    """Every page size x {contiguous, shuffled, reversed (non-monotonic), interleaved}, prefixes
    straddling page boundaries, raw_bs < bs, a shrinking history."""
    c = CaseSpec(mode, ps, order, mla=(ps == 16), bs=4, seed=ps)
    if mode in ("verify_chain", "draft_extend"):
        c.n, c.steps = 4, 3
    elif mode == "verify_tree":
        c.n, c.topk, c.steps = 6, 4, 2
    elif mode == "draft_decode":
        c.topk, c.steps, c.draft_step = 4, 3, 2
    lo = 8 if mode == "draft_decode" else 0
    c.batches = [([ps + lo, 2 * ps - 1 + lo, lo, ps + 1 + lo], [1, 4, 2, 3] if mode == "draft_extend" else None),
                 ([ps - 1 + lo, 3 * ps + 1 + lo, 7 + lo], [2, 1, 4] if mode == "draft_extend" else None),
                 ([lo + 1], [4] if mode == "draft_extend" else None)]
    rep = SuiteReport()
    run_case(get_backend_class("torch_native"), c, rep)
    _assert_ok(rep)


@pytest.mark.parametrize("accept", ["all_zero_accepted", "all_max", "ragged"])
def test_draft_extend_accept_lengths(accept):
    """accept_lens = valid tokens incl. the bonus: zero accepted drafts -> 1, maximal -> N."""
    n = 5
    acc = {"all_zero_accepted": [1, 1, 1], "all_max": [n, n, n], "ragged": [1, 5, 3]}[accept]
    c = CaseSpec("draft_extend", 16, "shuffled", mla=False, bs=4, n=n, steps=n - 1, seed=1,
                 batches=[([3, 40, 17, 90], [2, 2, 2, 2]), ([10, 20, 30], acc), ([5, 6], acc[:2])])
    rep = SuiteReport()
    run_case(get_backend_class("torch_native"), c, rep)
    _assert_ok(rep)


PAGE_PICKS = lambda ps: st.sampled_from(sorted({0, ps - 1, ps, ps + 1, 2 * ps - 1, 2 * ps + 1, 3 * ps}))  # noqa: E731


@st.composite
def case_specs(draw, modes):
    mode = draw(st.sampled_from(modes))
    ps = draw(st.sampled_from([1, 16, 64]))
    c = CaseSpec(mode, ps, draw(st.sampled_from(PAGE_ORDERS)), draw(st.booleans()),
                 bs=draw(st.integers(2, 8)), seed=draw(st.integers(0, 2 ** 20)))
    if mode == "verify_chain":
        c.steps = draw(st.integers(1, 5))
        c.n = c.steps + 1
    elif mode == "draft_extend":          # topk > 1 too: the stride is N, never num_steps + 1
        c.steps, c.topk = draw(st.integers(1, 5)), draw(st.sampled_from([1, 2, 4]))
        c.n = c.steps + 1 if c.topk == 1 else draw(st.integers(c.steps + 1, min(c.steps * c.topk + 1, 16)))
    elif mode in ("verify_tree", "draft_decode"):
        c.steps = draw(st.integers(1, 5))
        c.topk = draw(st.sampled_from([2, 4, 8]))
        c.n = draw(st.integers(c.steps + 1, min(c.steps * c.topk + 1, 16)))
        c.draft_step = draw(st.integers(1, c.steps))
    w = {"decode": 1, "draft_decode": c.topk}.get(mode, c.n)
    lo = w * (c.draft_step - 1) if mode == "draft_decode" else 0
    raw = draw(st.integers(1, c.bs))
    for r in [draw(st.integers(1, c.bs)), raw, draw(st.integers(1, raw))]:
        prefixes = [min(lo + p, 200) for p in draw(st.lists(PAGE_PICKS(ps), min_size=r, max_size=r))]
        extra = None
        if mode == "draft_extend":
            kind = draw(st.sampled_from(["zero", "max", "ragged"]))
            extra = {"zero": [1] * r, "max": [c.n] * r}.get(kind) or \
                draw(st.lists(st.integers(1, c.n), min_size=r, max_size=r))
        c.batches.append((prefixes, extra))
    return c


def _hypothesis_case(backend, data):
    cls = get_backend_class(backend)
    modes = [m for m in declared_modes(cls.capabilities) if m != "extend"]
    c = data.draw(case_specs(modes))
    if c.mla and not cls.capabilities.mla or not c.mla and not cls.capabilities.mha:
        c.mla = not c.mla
    if c.page_size not in cls.capabilities.page_sizes:
        c.page_size = cls.capabilities.page_sizes[0]
    rep = SuiteReport()
    run_case(cls, c, rep)
    _assert_ok(rep)


@pytest.mark.parametrize("backend", NATIVE)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_hypothesis_layout_contract(backend, data):
    _hypothesis_case(backend, data)


@pytest.mark.parametrize("backend", INTERPRETED)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_hypothesis_layout_contract_interpreted(backend, data):
    """The same for the Triton backends in the interpreter: a few examples (see ``INTERPRETED``)."""
    _hypothesis_case(backend, data)


class DoubledOutput(TorchNativeBackend):
    """A backend whose layouts are right and whose numbers are not (issue #12): twice the answer."""

    name = "bug_doubled_output"

    def _run(self, q, layer, meta):
        return 2 * super()._run(q, layer, meta)


def test_numbers_invariant_catches_a_doubled_output():
    report = run_suite(DoubledOutput, cases=3, seed=1, modes=["decode", "extend", "verify_tree"])
    assert report.failed_invariants() == {"I9n"}, report.failed_invariants()
    assert "relative error 1 > 0.0001" in str(report.failures[0])
    ok = run_suite(TorchNativeBackend, cases=3, seed=1, modes=["decode", "extend", "verify_tree"])
    assert ok.ok and any(k[2] == "I9n" for k in ok.counts)
