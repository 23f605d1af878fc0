"""The suites draw windows, sinks and softcap (issue #42.4): every window kind in every mode, caps
that bind, sinks of large magnitude, only the features a backend's capabilities declare; check
reports the feature cases; the window's poison invariant (I17) fails a backend that reads KV
outside the windows."""
import dataclasses
import random

import pytest

from attn_backends.backends.torch_native import TorchNativeBackend
from attn_backends.check.features import CAPS, SINK_PEAK, WINDOW_KINDS, draw_features
from attn_backends.check.suite import MAX_CTX, MODES, _width, random_case, run_suite

NATIVE = TorchNativeBackend.capabilities


def _cases(mode: str, caps, n: int = 20) -> list:
    return [random_case(random.Random(s), mode, caps, False, s) for s in range(n)]


@pytest.mark.parametrize("mode", MODES)
def test_every_window_kind_cap_and_sinks_drawn_in_every_mode(mode):
    """Twenty consecutive seeds draw each window kind with and without cap and sinks, each kind
    as it says: 1; below W (1 where W is 1); not a page multiple; beyond the longest sequence."""
    seen = set()
    for c in _cases(mode, NATIVE):
        f, w, ps = c.features, _width(c), c.page_size
        seen.add((f.window_kind, f.softcap is not None, f.sinks is not None))
        check = {"w=1": lambda x: x == 1, "w<W": lambda x: x < w or x == w == 1,
                 "w%page": lambda x: x % ps != 0 or ps == 1, "w>seq": lambda x: x > MAX_CTX,
                 None: lambda x: x is None}
        assert check[f.window_kind](f.window), (f.window_kind, f.window, w, ps)
        assert f.softcap is None or f.softcap in CAPS
        if f.sinks is not None:
            assert max(abs(x) for x in f.sinks) == SINK_PEAK and len(f.sinks) == 4
    assert seen == {(k, cap, sinks) for k in WINDOW_KINDS for cap in (False, True) for sinks in (False, True)}


@pytest.mark.parametrize("declared", [(), ("windows",), ("sinks",), ("softcap",), ("windows", "softcap")])
def test_only_declared_features_are_drawn(declared):
    caps = dataclasses.replace(NATIVE, windows="windows" in declared, sinks="sinks" in declared,
                               softcap="softcap" in declared)
    drawn = set()
    for s in range(20):
        f = draw_features(caps, s, random.Random(s), 4, 3, 16, MAX_CTX)
        drawn |= {n for n, v in (("windows", f.window), ("sinks", f.sinks), ("softcap", f.softcap)) if v is not None}
    assert drawn == set(declared)


def test_check_runs_and_reports_feature_cases():
    """The layout suite on torch_native in tree verify and multi-step draft decode: every window
    kind counted per mode, I17 judged on the windowed cases, all passing."""
    rep = run_suite("torch_native", cases=5, modes=["verify_tree", "draft_decode"])
    assert rep.ok, rep.failures[:2]
    for mode in ("verify_tree", "draft_decode"):
        labels = {k[2] for k in rep.feature_cases if k[:2] == ("torch_native", mode)}
        assert {f"window {k}" for k in WINDOW_KINDS if k} | {"softcap", "sinks"} <= labels, labels
        assert rep.counts[("torch_native", mode, "I17")][0] == 4     # the windowed cases, each checked once
    assert "  with window w=1" in rep.table()


class WindowBlind(TorchNativeBackend):
    """Planted: a kernel that declares windows and reads the whole KV (the window dropped)."""

    def _run(self, q, layer, meta):
        return super()._run(q, dataclasses.replace(layer, window=None), meta)


def test_window_poison_fails_a_backend_that_reads_outside_the_window():
    rep = run_suite(WindowBlind, cases=5, modes=["verify_chain"])
    assert {"I9n", "I17"} <= rep.failed_invariants()
    assert any("before the windows" in f.message and "nan" in f.message for f in rep.failures if f.invariant == "I17")
