"""``Capabilities.layout_only``: a backend whose forward cannot run where the check runs (an engine's
CUDA-only kernel) declares it; the layout suite then checks its layout invariants alone, reports the
numbers checks as not run with the reason (table, legend, JSON), the runner suite is not run, and
``select`` refuses it for serving. The declaration hides no layout failure."""
import dataclasses
import json

from planted_bugs import PackedReplay

from attn_backends import ForwardMode, ModelConfig
from attn_backends.backends.torch_native import TorchNativeBackend
from attn_backends.check.suite import run_suite

REASON = "its forward is a kernel of another machine"


class LayoutOnly(TorchNativeBackend):
    name = "layout_only_native"
    capabilities = dataclasses.replace(TorchNativeBackend.capabilities, layout_only=REASON)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(REASON)


class LayoutOnlyPacked(PackedReplay):
    name = "layout_only_packed"
    capabilities = dataclasses.replace(PackedReplay.capabilities, layout_only=REASON)


def test_the_numbers_checks_are_reported_not_run():
    report = run_suite(LayoutOnly, cases=2, seed=3, modes=["decode", "draft_extend"])
    assert report.ok, "\n".join(map(str, report.failures[:3]))
    assert not any(k[2] == "I9n" for k in report.counts), "a forward was checked"
    assert report.not_run[("layout_only_native", "decode", "I9n")] == [4, REASON], report.not_run
    table, legend = report.table(), report.legend()
    assert "not run 4" in table and REASON in legend, table + legend
    assert {"I1", "I5", "I13"} <= {k[2] for k in report.counts}
    control = run_suite(TorchNativeBackend, cases=2, seed=3, modes=["decode"])   # undeclared: the numbers run
    assert control.counts[("torch_native", "decode", "I9n")] == [4, 0] and not control.not_run, control.table()


def test_a_layout_bug_still_fails():
    """The declaration skips the forward, not the layout: a packed replay still fails I1."""
    report = run_suite(LayoutOnlyPacked, cases=4, seed=7, modes=["draft_extend"])
    assert "I1" in report.failed_invariants(), report.table()
    assert "I9n" not in report.failed_invariants()


def test_check_and_select(tmp_path, capsys):
    from attn_backends.check.cli import main
    out = tmp_path / "r.json"
    rc = main(["check", "--backend", f"{__file__}:LayoutOnly", "--cases", "1", "--suite-cases", "1",
               "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "the runner suite runs forwards: not run" in err and REASON in err, err
    (be,) = json.loads(out.read_text())["backends"]
    assert {(n["mode"], n["invariant"], n["reason"]) for n in be["not_run"]} >= {("decode", "I9n", REASON)}, be
    assert not any(c["invariant"] == "I9n" for c in be["checks"])
    cfg = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16)
    refusal = LayoutOnly.capabilities.refusal(cfg, ForwardMode.DECODE, "cpu")
    assert refusal is not None and REASON in refusal, refusal
    assert TorchNativeBackend.capabilities.refusal(cfg, ForwardMode.DECODE, "cpu") is None


def test_a_composition_with_a_layout_only_part_is_layout_only(monkeypatch):
    """A hybrid whose decode is a layout-only backend cannot serve either: the declaration carries over."""
    from attn_backends import registry
    from attn_backends.backends.hybrid import compose_capabilities
    monkeypatch.setitem(registry._extra, "layout_only_native", "test_layout_only:LayoutOnly")
    caps = compose_capabilities({ForwardMode.DECODE: ("layout_only_native", None),
                                 ForwardMode.EXTEND: ("torch_native", None)})
    assert caps.layout_only == REASON
    assert compose_capabilities({ForwardMode.DECODE: ("torch_native", None)}).layout_only == ""
