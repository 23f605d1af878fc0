"""The suites can fail: every planted bug is reported, and the unmodified code passes the very
same cases. tests/support/planted_bugs.py holds backend-level copies (issue #2 item 8); tests/support/planted_mutants.py
plants every known bug class into our own code (issue #11), its docstring maps each mutant to the
invariant that reports it."""
import random

import pytest
from planted_bugs import PLANTED
from planted_mutants import MUTANTS
from test_builder_padding import garbage_pad_messages

from attn_backends.backends.torch_native import TorchNativeBackend
from attn_backends.check.suite import run_suite
from attn_backends_runtime.testing.rig import Rig, RigSpec
from attn_backends_runtime.testing.runner_checks import fallback_messages
from attn_backends_runtime.testing.runner_suite import check_case

CASES = 12
MUTANT_CASES = 8


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


# --------------------------------------------------------------------------- mutants of our own code

def _runner_failures(kw: dict) -> dict:
    """{invariant: [messages]} of the runner checks on one rig (a crash is reported as I9, as
    ``run_runner_suite`` does)."""
    kw = dict(kw)
    seed = kw.pop("seed", 0)
    found: dict = {}
    judge = lambda inv, msgs: msgs and found.setdefault(inv, []).extend(msgs)  # noqa: E731
    try:
        check_case(Rig(RigSpec(**kw, seed=seed)), random.Random(seed), judge, tol=1e-5)
    except Exception as e:  # noqa: BLE001 - a clear error raised by a guard is a report too
        found.setdefault("I9", []).append(f"crashed: {type(e).__name__}: {e}")
    return found


def _found(scope: str, cases: list) -> dict:
    if scope == "layout":
        rep = run_suite(TorchNativeBackend, cases=MUTANT_CASES, seed=7, modes=cases)
        return {inv: [str(f) for f in rep.failures if f.invariant == inv] for inv in rep.failed_invariants()}
    if scope == "runner":
        out: dict = {}
        for kw in cases:
            for inv, msgs in _runner_failures(kw).items():
                out.setdefault(inv, []).extend(msgs)
        return out
    if scope == "builder":
        msgs = [m for mode in cases for m in garbage_pad_messages(mode)]
        return {"I3": msgs} if msgs else {}
    msgs = fallback_messages()
    return {"I9": msgs} if msgs else {}


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: f"{m.name}-{m.scope}")
def test_planted_mutant_is_reported(mutant):
    with pytest.MonkeyPatch.context() as mp:
        mutant.plant(mp)
        found = _found(mutant.scope, mutant.cases)
    assert mutant.expect & set(found), (f"{mutant.name}: none of {sorted(mutant.expect)} reported "
                                        f"(got {sorted(found)})")


def _control_scopes() -> list:
    layout = sorted({m for mu in MUTANTS if mu.scope == "layout" for m in mu.cases})
    runner = list({repr(sorted(kw.items())): kw for mu in MUTANTS if mu.scope == "runner" for kw in mu.cases}.values())
    return [("layout", layout), ("builder", ["decode", "verify_tree", "draft_extend"]), ("executor", [])] + \
        [("runner", [kw]) for kw in runner]


@pytest.mark.parametrize("scope,cases", _control_scopes(), ids=lambda x: x if isinstance(x, str) else None)
def test_control_unmodified_code_passes_the_mutants_cases(scope, cases):
    found = _found(scope, cases)
    assert not found, {k: v[:3] for k, v in found.items()}
