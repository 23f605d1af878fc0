"""The bug classes of 2026 (docs/bug-classes.md): each planted in
a backend, a runner or the executor of ours (tests/support/planted_classes.py) is reported by the check
that the class concerns, and the unmodified code passes the very same case.

Each case is fixed, not drawn, so that it holds what exposes the class in every run: the
full-default ``attn-backends check`` runs of each plant are recorded in docs/bug-classes.md."""
import random

import planted_classes as PC
import pytest
from planted_mutants import pad_kv_into_real_slots
from test_planted_bugs import _runner_failures

from attn_backends import registry
from attn_backends.backends.torch_native import TorchNativeBackend
from attn_backends.check.report import SuiteReport
from attn_backends.check.suite import CaseSpec, run_case
from attn_backends_runtime import executor
from attn_backends_runtime.testing.rig import Rig, RigSpec


def _verify(bs=4, n=3, prefixes=(30, 40, 50)) -> CaseSpec:
    # capture 2 of bs rows (pad rows at capture), replay A, B, A with raw_bs < bs
    return CaseSpec("verify_chain", 16, "shuffled", False, bs=bs, n=n, steps=n - 1,
                    batches=[([5, 17], None), (list(prefixes), None), ([7], None)])


# plant -> (the layout case that exposes it, or a rig's keywords; the invariant; text its message holds)
BACKEND_PLANTS = {
    "QLenOneGraphs": (_verify(), "I13", "only q_len 1"),
    "CaptureBatchUnpadded": (_verify(), "I13", "captured layout: cu_seqlens_q"),
    "ContextSizedBuffers": (_verify(n=4, prefixes=(250, 40)), "I6", "page_table has 15 columns, a row needs 16"),
    "TreeMaskDoubleCounted": (CaseSpec("verify_tree", 16, "shuffled", False, bs=6, n=4, topk=2, steps=2,
                                       batches=[([5, 17], None), ([30, 40, 50, 60, 70], None), ([7], None)]),
                              "I2", "layout field custom_mask moved"),
    "HostListInCapture": (CaseSpec("draft_extend", 16, "shuffled", False, bs=4, n=3, steps=2,
                                   batches=[([5, 17], [3, 3]), ([30, 40, 50], [1, 2, 3]), ([7], [2])]),
                          "I15", "tolist()"),
    "ForeignCaptureMetadata": (dict(kind="decode", buckets=(2, 4)), "I9", "prepared for DECODE bs=4"),
    "UnboundReplaySlice": (dict(kind="decode", buckets=(2, 4)), "I9", "A replay vs eager"),
}


def _layout_failures(cls, c: CaseSpec) -> dict:
    rep = SuiteReport()
    run_case(cls, c, rep)
    return {inv: [str(f) for f in rep.failures if f.invariant == inv] for inv in rep.failed_invariants()}


def _failures(backend: str, case) -> dict:
    if isinstance(case, CaseSpec):
        cls = TorchNativeBackend if backend == "torch_native" else getattr(PC, backend)
        return _layout_failures(cls, case)
    name = backend if backend == "torch_native" else f"planted_classes:{backend}"
    return _runner_failures(dict(case, backend=name))


@pytest.mark.parametrize("plant", list(BACKEND_PLANTS))
def test_backend_plant_reported(plant):
    case, inv, needle = BACKEND_PLANTS[plant]
    found = _failures(plant, case)
    assert any(needle in m for m in found.get(inv, [])), f"{plant}: no {inv} failure naming {needle!r}: {found}"


@pytest.mark.parametrize("plant", list(BACKEND_PLANTS))
def test_control_passes_the_backend_plants_cases(plant):
    found = _failures("torch_native", BACKEND_PLANTS[plant][0])
    assert not found, {k: v[:2] for k, v in found.items()}


RUNNER_PLANTS = {
    "dispatch_by_shape": (dict(kind="verify"), "I11", "can_run is True for mode DRAFT_EXTEND"),
    "capture_ladder_capped": (dict(kind="verify", buckets=(2, 4)), "I11", "captured buckets [2], asked [2, 4]"),
}


@pytest.mark.parametrize("plant", list(RUNNER_PLANTS))
def test_runner_plant_reported(plant):
    kw, inv, needle = RUNNER_PLANTS[plant]
    with pytest.MonkeyPatch.context() as mp:
        getattr(PC, plant)(mp)
        found = _runner_failures(kw)
    assert any(needle in m for m in found.get(inv, [])), f"{plant}: no {inv} failure naming {needle!r}: {found}"


@pytest.mark.parametrize("plant", list(RUNNER_PLANTS))
def test_control_passes_the_runner_plants_cases(plant):
    found = _runner_failures(RUNNER_PLANTS[plant][0])
    assert not found, {k: v[:2] for k, v in found.items()}


BREAKABLE = dict(kind="breakable_decode", seed=3)


def test_pad_slots_of_the_breakable_runner():
    """SGLang #33253 (pad tokens of a breakable graph write real KV slots): the plan's pad rows
    pointed at a real slot, which the breakable runner shares, is I16; the unmodified runner passes."""
    with pytest.MonkeyPatch.context() as mp:
        pad_kv_into_real_slots(mp)
        found = _runner_failures(BREAKABLE)
    assert any("written, none of them a raw row's new slot" in m for m in found.get("I16", [])), found
    assert not _runner_failures(BREAKABLE)


def graph_decision_messages(monkeypatch) -> list:
    """SGLang #30944: a backend that declares uniform-batch graphs for DRAFT_EXTEND, under a name
    no list of ours holds (a plugin), gets the draft executor's draft-extend graph: a DRAFT_EXTEND
    forward replays, nothing falls back to eager."""
    monkeypatch.setitem(registry._extra, "plugin_native", "attn_backends.backends.torch_native:TorchNativeBackend")
    rig = Rig(RigSpec("draft_extend", n=3, buckets=(2, 4)), capture=False)
    ex = executor.draft_executor(rig.model, rig.mem, "plugin_native", rig.tc.attention(), buckets=(2, 4),
                                 token_buckets=(8,), graphs=True, topk=1, num_steps=1, num_draft_tokens=3)
    ex.capture()
    ex.forward(rig.batch(rig.new_requests(2, random.Random(0))))
    counts = dict(ex.counts["draft_extend"])
    return [] if counts == {"graph": 1, "eager": 0} else [f"DRAFT_EXTEND ran {counts}, declared graphable"]


def test_draft_extend_graph_follows_capabilities(monkeypatch):
    assert graph_decision_messages(monkeypatch) == []


def test_draft_extend_graph_whitelist_is_reported(monkeypatch):
    PC.draft_extend_graph_whitelist(monkeypatch)
    assert graph_decision_messages(monkeypatch) == ["DRAFT_EXTEND ran {'graph': 0, 'eager': 1}, declared graphable"]


def test_every_class_has_a_plant_and_a_test():
    """The table of the thirteen classes: each plant exists, each test it names exists, and the
    document lists every row."""
    import importlib
    from pathlib import Path
    assert len(PC.CLASSES) == 13
    doc = (Path(__file__).parents[2] / "docs" / "bug-classes.md").read_text()
    for thread, _, _, plant, test in PC.CLASSES:
        mod, name = plant.split(".")
        assert hasattr(importlib.import_module(mod), name), plant
        path, func = test.split("::")
        assert f"def {func.split('[')[0]}(" in (Path(__file__).parent / path).read_text(), test
        assert thread in doc and name in doc and func.split("[")[0] in doc, (thread, name)


def test_whitelist_reported_by_the_runner_suite(monkeypatch):
    """`check`'s runner suite builds a tiny engine's executors (plain and EAGLE) and holds their
    graph runners to the capabilities (I11): the whitelist drops a plugin's draft-extend graph."""
    from attn_backends_runtime.testing.runner_checks import executor_graph_messages
    monkeypatch.setitem(registry._extra, "plugin_native", "attn_backends.backends.torch_native:TorchNativeBackend")
    assert executor_graph_messages("plugin_native") == []
    PC.draft_extend_graph_whitelist(monkeypatch)
    assert executor_graph_messages("plugin_native") == [
        "eagle engine, draft executor: graph runners for ['draft_decode', 'extend'], the capabilities declare "
        "['draft_decode', 'draft_extend', 'extend']"]
