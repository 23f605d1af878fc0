"""Results of the suites: checks per (backend, mode, invariant), the failures, and the table.

A *check* is one judgement of one invariant (I1 is checked on each of a case's three
replays, I15 on its capture and three replays): it passes, or it fails with its messages as
one :class:`Failure`, which carries what replays exactly its case.
"""
from __future__ import annotations

import re
import shlex
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field

INVARIANTS = {
    "I1": "layout equality: replay == eager == runner layout, whole buffers",
    "I2": "address stability: data_ptr, shape, dtype unchanged",
    "I3": "pad safety: canonical pad rows after poisoning",
    "I4": "derived consistency: sums, indptrs, maxima recomputed",
    "I5": "KV extent: seq_lens_k == prefix + W, pages == cdiv",
    "I6": "capacity: indices in range, buffers large enough",
    "I7": "slicing: outputs cut to raw rows, hidden states by the one LAST/FULL rule; pad rows never reach real rows",
    "I8": "no aliasing: returned tensors survive the next replay",
    "I9": "replay == eager (bitwise on the GPU for the same padded batch); runner suite: == a float64 reference "
          "(a failure names the worst request, row and element, both values, and the first layer whose "
          "eager attention differs from the reference's)",
    "I9n": "numbers: eager and replayed outputs within tolerance of torch_native on the same batch "
           "(float32 1e-4, float16 2e-3, bfloat16 2e-2 of the largest reference value; a failure names "
           "the worst request, query row, head and element, both values, and the rows and heads off)",
    "I10": "batch invariance: bucket, slot, others' accept lengths",
    "I11": "dispatch: can_run == replay happened; refusals; captured hidden mode and buckets; an engine's "
           "graph runners are the modes whose graph support the backend declares (column executor)",
    "I12": "fan-out: every backend instance refreshed per replay",
    "I13": "valid capture: the capture batch passes the validator",
    "I14": "history independence: A, B, A gives A twice",
    "I15": "no host sync in capture/replay preparation",
    "I16": "KV slots: a step writes only its raw rows' new slots and the reserved slot 0",
    "I17": "window poison: NaN in the KV pages wholly before each request's window start leaves the outputs "
           "bitwise unchanged",
}
# The table's rows of feature cases (``check.features``): cases whose layer used a window of each
# kind, a softcap, sinks; drawn only for the features the backend declares.
FEATURE_ROW = "  with "
LAYOUT_SUITE = "layout"
# Column order of the table; modes not listed here follow in alphabetical order.
MODE_ORDER = ("decode", "extend", "verify", "verify_chain", "verify_tree", "draft_extend", "draft_decode",
              "piecewise", "breakable")
WIDTH = 100


def invariant_key(inv: str) -> tuple:
    """Sort key: I2 before I10, I9 before I9n; ids of another shape last."""
    m = re.fullmatch(r"I(\d+)(.*)", inv)
    return (int(m[1]), m[2]) if m else (1 << 30, inv)


@dataclass
class Failure:
    """One failed check. ``seed`` is the case seed: with ``--cases 1`` (layout) the suite runs
    exactly this case, with ``--suite-cases 1`` (another suite) this case first (the runner suite
    then one case of each other runner kind: every run draws each), so :meth:`replay` is the
    command that re-runs it."""

    backend: str
    mode: str
    invariant: str
    message: str
    case: str
    seed: int
    suite: str = LAYOUT_SUITE
    device: str = "cpu"
    kv_dtype: str = "model"        # check's --kv-dtype name

    def replay(self) -> str:
        """The ``attn-backends check`` command line that runs this failure's case, and only it."""
        head = f"attn-backends check --backend {shlex.quote(self.backend)} --device {self.device}"
        if self.kv_dtype != "model":
            head += f" --kv-dtype {self.kv_dtype}"
        if self.suite == LAYOUT_SUITE:
            return f"{head} --suite {LAYOUT_SUITE} --mode {self.mode} --seed {self.seed} --cases 1"
        return f"{head} --suite {shlex.quote(self.suite)} --seed {self.seed} --suite-cases 1"

    def as_dict(self) -> dict:
        return {"suite": self.suite, "backend": self.backend, "device": self.device, "kv_dtype": self.kv_dtype,
                "mode": self.mode,
                "invariant": self.invariant, "message": self.message, "case": self.case,
                "seed": self.seed, "replay": self.replay()}

    def __str__(self) -> str:
        return (f"[{self.backend} {self.mode} {self.invariant}] {self.message}\n"
                f"    case: {self.case}\n    replay: {self.replay()}")


@dataclass
class SuiteReport:
    counts: dict = field(default_factory=lambda: defaultdict(lambda: [0, 0]))  # key -> [passed, failed] checks
    failures: list = field(default_factory=list)
    cases: dict = field(default_factory=lambda: defaultdict(int))               # (backend, mode) -> cases
    feature_cases: dict = field(default_factory=lambda: defaultdict(int))       # (backend, mode, label) -> cases
    not_run: dict = field(default_factory=dict)    # (backend, mode, invariant) -> [checks not run, the declared reason]

    def record(self, backend: str, mode: str, invariant: str, ok: bool) -> None:
        self.counts[(backend, mode, invariant)][0 if ok else 1] += 1

    def skip(self, backend: str, mode: str, invariant: str, reason: str) -> None:
        """One check not run because the backend declares it cannot (``Capabilities.layout_only``)."""
        self.not_run.setdefault((backend, mode, invariant), [0, reason])[0] += 1

    def fail(self, f: Failure) -> None:
        """Record one failed check."""
        self.failures.append(f)
        self.record(f.backend, f.mode, f.invariant, False)

    def check(self, backend: str, mode: str, invariant: str, messages: list, *, case: str, seed: int,
              suite: str = LAYOUT_SUITE, device: str = "cpu") -> bool:
        """Record one check of ``invariant``: it holds when ``messages`` is empty; otherwise one
        failure carrying them all. Returns whether it held."""
        if messages:
            self.fail(Failure(backend, mode, invariant, "; ".join(messages), case, seed, suite, device))
        else:
            self.record(backend, mode, invariant, True)
        return not messages

    @property
    def ok(self) -> bool:
        return not self.failures

    def failed_invariants(self) -> set:
        return {f.invariant for f in self.failures}

    def checks(self) -> int:
        return sum(p + f for p, f in self.counts.values())

    def table(self, width: int = WIDTH) -> str:
        """One block per (backend, suite): a row per invariant, a column per mode, cells
        ``ok N`` (all N checks passed) or ``FAIL F of N``; wrapped to ``width`` columns."""
        blocks = []
        for (backend, suite), modes in _sections(self.counts):
            mine = {(backend, m) for m in modes}
            invs = sorted({k[2] for k in [*self.counts, *self.not_run] if (k[0], k[1]) in mine}, key=invariant_key)
            head = ["invariant"] + [_column(m) for m in modes]
            rows = [["cases"] + [str(self.cases.get((backend, m), 0)) for m in modes]]
            labels = sorted({k[2] for k in self.feature_cases if k[0] == backend and k[1] in modes})
            rows += [[FEATURE_ROW + lab] + [str(self.feature_cases.get((backend, m, lab), 0)) for m in modes]
                     for lab in labels]
            rows += [[inv] + [_cell(*self.counts.get((backend, m, inv), (0, 0)), self.not_run.get((backend, m, inv)))
                              for m in modes] for inv in invs]
            blocks.append(f"{backend}, {suite} suite:\n" + grid(head, rows, width))
        return "\n\n".join(blocks)

    def legend(self, width: int = WIDTH) -> str:
        """What each invariant of the table means, and how to read a cell."""
        ids = sorted({k[2] for k in [*self.counts, *self.not_run]}, key=invariant_key)
        pad = max([len(i) for i in ids] + [3]) + 2
        lines = ["cells: checks of an invariant in a mode; ok N = all N passed, FAIL F of N = F of them failed"]
        for reason in sorted({r for _, r in self.not_run.values()}):
            lines += textwrap.wrap(f"not run N: N checks the backend declares it cannot run ({reason})", width)
        if self.feature_cases:
            lines += textwrap.wrap(f"'{FEATURE_ROW.strip()} ...' rows: cases whose layer used that feature (w=1, "
                                   "w<W: below the query width, w%page: not a page multiple, w>seq: beyond the "
                                   "sequence; the features the backend's capabilities declare)", width)
        for inv in ids:
            lines += textwrap.wrap(INVARIANTS.get(inv, "(not described in attn_backends.check.report)"),
                                   width, initial_indent=inv.ljust(pad), subsequent_indent=" " * pad,
                                   break_on_hyphens=False)
        return "\n".join(lines)


def suite_of(mode: str) -> str:
    """``runner:decode`` belongs to the runner suite; a mode without a prefix to the layout suite."""
    return mode.split(":", 1)[0] if ":" in mode else LAYOUT_SUITE


def _column(mode: str) -> str:
    return mode.split(":", 1)[1] if ":" in mode else mode


def _mode_key(mode: str) -> tuple:
    col = _column(mode)
    return (MODE_ORDER.index(col), "") if col in MODE_ORDER else (len(MODE_ORDER), col)


def _sections(counts: dict) -> list:
    """[((backend, suite), [modes in column order])], layout first, then other suites by name."""
    groups = defaultdict(set)
    for backend, mode, _ in counts:
        groups[(backend, suite_of(mode))].add(mode)
    order = lambda k: (k[0], k[1] != LAYOUT_SUITE, k[1])  # noqa: E731
    return [(k, sorted(groups[k], key=_mode_key)) for k in sorted(groups, key=order)]


def _cell(passed: int, failed: int, not_run=None) -> str:
    total = passed + failed
    if total == 0 and not_run:
        return f"not run {not_run[0]}"
    return "-" if total == 0 else f"ok {total}" if failed == 0 else f"FAIL {failed} of {total}"


def grid(head: list, rows: list, width: int = WIDTH) -> str:
    """Left-aligned columns two spaces apart; the first column is repeated on each band when the
    others do not fit ``width`` at once."""
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    bands, cur = [], []
    for i in range(1, len(head)):
        if cur and widths[0] + sum(widths[j] + 2 for j in cur + [i]) > width:
            bands.append(cur)
            cur = []
        cur.append(i)
    bands.append(cur)
    out = []
    for band in bands:
        cols = [0] + band
        fmt = lambda r: "  ".join(r[j].ljust(widths[j]) for j in cols).rstrip()  # noqa: E731
        out += ([""] if out else []) + [fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    return "\n".join(out)
