"""The suite can fail: every planted bug of issue #2 item 8 is reported."""
import pytest
from planted_bugs import PLANTED

from attn_backends.backends.torch_native import TorchNativeBackend
from attn_backends.testing.suite import run_suite

CASES = 12


@pytest.mark.parametrize("bug", list(PLANTED), ids=lambda c: c.name)
def test_suite_reports_planted_bug(bug):
    modes, expected = PLANTED[bug]
    report = run_suite(bug, cases=CASES, seed=7, modes=modes)
    found = report.failed_invariants()
    assert expected <= found, f"{bug.name}: expected {sorted(expected)} reported, got {sorted(found)}\n{report.table()}"
    # the report says which case failed and how to replay it
    first = str(report.failures[0])
    assert "--seed" in first and "case:" in first


def test_control_same_cases_pass():
    """The unmodified backend passes the very cases that expose the bugs."""
    modes = sorted({m for ms, _ in PLANTED.values() for m in ms})
    report = run_suite(TorchNativeBackend, cases=CASES, seed=7, modes=modes)
    assert report.ok, "\n".join(map(str, report.failures[:5]))
