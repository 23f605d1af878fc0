"""What ``attn-backends check`` prints and writes: the tables with their legend, the failures
(the first few per backend, mode and invariant, each with the command that replays its case),
a summary line per backend, and the ``--json`` file with every result."""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import TextIO

from .cli_progress import duration
from .report import WIDTH, Failure, SuiteReport, invariant_key, suite_of

SHOWN = 3            # failures printed per (backend, mode, invariant) without --verbose
MESSAGE_CHARS = 300  # a message longer than this is cut without --verbose
CASE_CHARS = 200


@dataclass
class BackendResult:
    name: str
    report: SuiteReport
    seconds: float
    crashed: str = ""      # the exception that stopped a suite, if one did

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.crashed


def _cut(text: str, limit: int, verbose: bool) -> str:
    if verbose or len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters with --verbose)"


def format_failure(f: Failure, verbose: bool = False) -> str:
    """Three lines: invariant, where and what; the case; the command that replays it alone."""
    return (f"FAIL {f.invariant} [{f.backend} {f.mode}] {_cut(f.message, MESSAGE_CHARS, verbose)}\n"
            f"  case: {_cut(f.case, CASE_CHARS, verbose)}\n"
            f"  replay: {f.replay()}")


def print_failures(report: SuiteReport, out: TextIO, verbose: bool = False) -> None:
    """The failures grouped by (backend, mode, invariant): all with ``verbose``; else the first
    failure of each of the first :data:`SHOWN` cases in the group, and how many more there are."""
    groups = defaultdict(list)
    for f in report.failures:
        groups[(f.backend, suite_of(f.mode), f.mode, f.invariant)].append(f)
    for key in sorted(groups, key=lambda k: (k[0], k[1] != "layout", k[1], k[2], invariant_key(k[3]))):
        fails = groups[key]
        if verbose:
            shown = fails
        else:
            first = {}
            for f in fails:
                first.setdefault((f.suite, f.seed), f)
            shown = list(first.values())[:SHOWN]
        for f in shown:
            print(format_failure(f, verbose), file=out)
        if len(fails) > len(shown):
            cases = len({(f.suite, f.seed) for f in fails})
            print(f"... and {len(fails) - len(shown)} more {key[3]} failures in {key[0]} {key[2]}, "
                  f"{cases} cases in all (--verbose prints them, --json FILE writes them)", file=out)


def summary(r: BackendResult) -> str:
    rep = r.report
    checks = rep.checks()
    skipped = sum(n for n, _ in rep.not_run.values())
    if r.ok:
        return (f"{r.name}: ok, {checks} checks" + (f", {skipped} not run (declared layout checks only)" if skipped
                                                    else "") + f" in {duration(r.seconds)}")
    parts = []
    if rep.failures:
        invs = ", ".join(sorted(rep.failed_invariants(), key=invariant_key))
        parts.append(f"{len(rep.failures)} of {checks} checks failed ({invs})")
    if r.crashed:
        parts.append(f"a suite crashed: {r.crashed}")
    return f"{r.name}: FAIL, {'; '.join(parts)} in {duration(r.seconds)}"


def print_result(r: BackendResult, out: TextIO, verbose: bool = False) -> None:
    if r.report.counts:
        print(r.report.table(WIDTH), file=out)
        print(file=out)
        print(r.report.legend(WIDTH), file=out)
        print(file=out)
    print_failures(r.report, out, verbose)
    print(summary(r), file=out, flush=True)


def as_json(results: list, *, command: str, device: str, seed: int, cases: int, suite_cases: int,
            status: int) -> dict:
    """Every result: per backend the case counts, the checks per (mode, invariant) and every
    failure with the command that replays it."""
    backends = []
    for r in results:
        rep = r.report
        backends.append({
            "backend": r.name, "ok": r.ok, "seconds": round(r.seconds, 3), "crashed": r.crashed or None,
            "cases": [{"suite": suite_of(m), "mode": m, "cases": n} for (b, m), n in sorted(rep.cases.items())
                      if b == r.name],
            "feature_cases": [{"suite": suite_of(m), "mode": m, "feature": lab, "cases": n}
                              for (b, m, lab), n in sorted(rep.feature_cases.items()) if b == r.name],
            "checks": [{"suite": suite_of(m), "mode": m, "invariant": inv, "passed": p, "failed": f}
                       for (b, m, inv), (p, f) in sorted(rep.counts.items(), key=lambda kv: (
                           kv[0][0], kv[0][1], invariant_key(kv[0][2]))) if b == r.name],
            "not_run": [{"suite": suite_of(m), "mode": m, "invariant": inv, "checks": n, "reason": why}
                        for (b, m, inv), (n, why) in sorted(rep.not_run.items(), key=lambda kv: (
                            kv[0][0], kv[0][1], invariant_key(kv[0][2]))) if b == r.name],
            "failures": [f.as_dict() for f in rep.failures],
        })
    return {"command": command, "device": device, "seed": seed, "cases": cases, "suite_cases": suite_cases,
            "status": status, "backends": backends}


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1)
        fh.write("\n")
