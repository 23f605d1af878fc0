"""Results of the layout-equivalence suite: counts per (backend, mode, invariant) and failures."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

INVARIANTS = {
    "I1": "layout equality: replay == eager == runner layout, whole buffers",
    "I2": "address stability: data_ptr, shape, dtype unchanged",
    "I3": "pad safety: canonical pad rows after poisoning",
    "I4": "derived consistency: sums, indptrs, maxima recomputed",
    "I5": "KV extent: seq_lens_k == prefix + W, pages == cdiv",
    "I6": "capacity: indices in range, buffers large enough",
    "I7": "slicing: outputs cut to raw rows; pad rows never reach real rows",
    "I8": "no aliasing: returned tensors survive the next replay",
    "I9": "replay == eager (bitwise on the GPU for the same padded batch)",
    "I10": "batch invariance: bucket, slot, others' accept lengths",
    "I11": "dispatch: can_run == replay happened; refusals; captured hidden mode",
    "I12": "fan-out: every backend instance refreshed per replay",
    "I13": "valid capture: the capture batch passes the validator",
    "I14": "history independence: A, B, A gives A twice",
    "I15": "no host sync in capture/replay preparation",
}


@dataclass
class Failure:
    backend: str
    mode: str
    invariant: str
    message: str
    case: str
    seed: int

    def __str__(self) -> str:
        return (f"[{self.backend} {self.mode} {self.invariant}] {self.message}\n"
                f"    case: {self.case}\n    replay with: --seed {self.seed} --cases 1")


@dataclass
class SuiteReport:
    counts: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))  # key -> [passed, failed]
    failures: list = field(default_factory=list)
    cases: dict = field(default_factory=lambda: defaultdict(int))               # (backend, mode) -> cases

    def record(self, backend: str, mode: str, invariant: str, ok: bool) -> None:
        self.counts[(backend, mode, invariant)][0 if ok else 1] += 1

    def fail(self, f: Failure) -> None:
        self.failures.append(f)
        self.record(f.backend, f.mode, f.invariant, False)

    @property
    def ok(self) -> bool:
        return not self.failures

    def failed_invariants(self) -> set:
        return {f.invariant for f in self.failures}

    def table(self) -> str:
        """backend x mode rows, one column per invariant: passed/total (or FAIL n/total)."""
        invs = sorted({k[2] for k in self.counts}, key=lambda s: int(s[1:]))
        rows = sorted({(k[0], k[1]) for k in self.counts})
        head = ["backend", "mode", "cases"] + invs
        lines = []
        for b, m in rows:
            cells = [b, m, str(self.cases[(b, m)])]
            for inv in invs:
                p, f = self.counts.get((b, m, inv), (0, 0))
                cells.append("-" if p + f == 0 else (f"{p}/{p + f}" if f == 0 else f"FAIL {f}/{p + f}"))
            lines.append(cells)
        widths = [max(len(r[i]) for r in [head] + lines) for i in range(len(head))]
        fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
        return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in lines])
