"""Runner-level invariants (I7-I12, I14, I16; legend in attn_backends/check/report.py) over random
cases, each built on a :class:`~.rig.Rig` (a tiny model, a KV memory with shuffled pages, per-layer
backend instances, one runner of a given kind, and requests that can be assembled into batches at
any bucket).

``run_runner_suite(backend)`` draws ``cases`` random cases (runner kind, buckets, raw_bs,
page size and layout, hidden mode), at least one of each runner kind the backend declares
whatever ``cases`` says (the count rule of :mod:`.runner_cases`), and records, per
(backend, "runner:<kind>", invariant),
passes and failures in a :class:`SuiteReport`, as ``attn_backends.check.suite`` does:

- I7  outputs cut to raw rows; real rows bit-identical when the pad rows' static inputs are
      poisoned differently just before the replay;
- I8  tensors returned by one replay unchanged after the next replay;
- I9  replay == eager model forward (bitwise where ``exact``, else within ``tol``);
- I10 a request's logits do not depend on bucket, slot or the others' accept lengths;
- I11 ``can_run`` is true exactly when a replay happens (counted); refusals raise
      :class:`RunnerRefusal`; every graph carries the captured hidden mode;
- I12 every per-layer (and per-step) backend instance is refreshed once per replay;
- I14 replaying A, B, A gives A's output twice;
- I17 NaN in the sliding layers' KV pages wholly before each request's window start leaves A's outputs
      bitwise unchanged (:mod:`.runner_checks`);
- I16 KV slots other than the raw rows' new slots and the reserved slot 0 unchanged by a step
      (replay and eager), and the checks of :mod:`.runner_checks` (the one hidden rule, I7; the
      float64 reference, I9).
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
from typing import Callable, Optional

import torch

from attn_backends import CaptureHiddenMode, ForwardMode, SpecInfo
from attn_backends.check.numbers import mismatch, spans_of
from attn_backends.check.report import SuiteReport
from attn_backends.check.scenarios import random_tree_mask
from attn_backends.registry import get_backend_class, unavailable_reason

from ..runner_base import RunnerOutput, RunnerRefusal
from .rig import I32, I64, KINDS, RUNNER_KINDS, Req, Rig, RigSpec, piecewise_eager  # noqa: F401 (re-exported)
from .runner_cases import kinds_for, plan_cases, random_spec  # noqa: F401 (kinds_for re-exported)
from .runner_checks import (
    against_float64,
    executor_graph_messages,
    hidden_rule,
    kv_snapshot,
    kv_writes_outside,
    new_slots,
    window_poison,
)

H = CaptureHiddenMode
SUITE = "runner"     # its name in the attn_backends.suites entry-point group (pyproject.toml)


# --------------------------------------------------------------------------- probes

@contextlib.contextmanager
def poisoned_pads(rig: Rig, n_raw: int, rng: random.Random):
    """Write other (valid) values into the pad rows of the runner's static inputs right before
    each replay: token ids, positions, embeddings, tree masks, accept lengths."""
    r, s = rig.runner, rig.spec
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    rand = lambda hi, n: torch.randint(0, hi, (n,), generator=g).to(rig.device)  # noqa: E731

    def poison(bucket: int) -> None:
        if rig.kind == "piecewise":
            lo, hi = n_raw, bucket
            r.embeds[lo:hi] = torch.randn(hi - lo, r.embeds.shape[1], generator=g).to(r.embeds)
            r.positions[lo:hi] = rand(s.max_ctx, hi - lo)
            return
        w = rig.width
        lo, hi = n_raw * w, bucket * w
        r.input_ids[lo:hi] = rand(rig.tc.vocab_size - 1, hi - lo) + 1
        if rig.kind == "draft_decode":
            for p in r.steps:
                p.positions[lo:hi] = rand(s.max_ctx, hi - lo)
            return
        r.positions[lo:hi] = rand(s.max_ctx, hi - lo)
        if rig.kind == "verify_tree":
            for i in range(n_raw, bucket):
                r.tree_mask[i] = random_tree_mask(w, rng).to(rig.device)
        if rig.kind == "draft_extend":
            r.accept_lens[n_raw:bucket] = rand(w, bucket - n_raw).to(I32) + 1

    wrapped = []
    for key, entry in r.graphs.items():
        g0 = entry[0][0] if rig.kind == "piecewise" else entry[0]
        bucket = key if rig.kind == "piecewise" else key.bs
        orig = g0.replay
        g0.replay = lambda orig=orig, bucket=bucket: (poison(bucket), orig())
        wrapped.append(g0)
    try:
        yield
    finally:
        for g0 in wrapped:
            del g0.replay


@contextlib.contextmanager
def refresh_counts(backends: list):
    """Count metadata refreshes per backend instance (replay-prep or eager init)."""
    counts = {id(b): 0 for b in backends}
    names = ("init_forward_metadata_replay_cuda_graph", "init_forward_metadata")
    for b in backends:
        for nm in names:
            orig = getattr(b, nm)

            def spy(*a, _orig=orig, _id=id(b), **k):
                counts[_id] += 1
                return _orig(*a, **k)
            setattr(b, nm, spy)
    try:
        yield counts
    finally:
        for b in backends:
            for nm in names:
                delattr(b, nm)


def outputs(o: RunnerOutput) -> dict:
    return {k: v for k, v in (("logits", o.logits), ("hidden", o.hidden), ("input_embeds", o.input_embeds),
                              ("rows", o.rows)) if isinstance(v, torch.Tensor)}


def compare(got: RunnerOutput, want: RunnerOutput, tol: float, what: str, counts: Optional[list] = None) -> list:
    """Messages for every output field that differs (``tol`` 0: bitwise). ``counts``: the valid
    rows of each request; a field holds either all of them or one row per request, and its
    message then names the request and row of the worst element (``numbers.mismatch``)."""
    g, w = outputs(got), outputs(want)
    msgs = [f"{what}: field {k} is {'missing' if k not in g else 'unexpected'}" for k in set(g) ^ set(w)]
    for k in sorted(set(g) & set(w)):
        a, b = g[k], w[k]
        if a.shape != b.shape:
            msgs.append(f"{what}: {k} has shape {tuple(a.shape)}, expected {tuple(b.shape)}")
        elif not a.is_floating_point():
            if not torch.equal(a, b):
                bad = (a != b).nonzero()
                msgs.append(f"{what}: {k} differs at {bad.shape[0]} of {a.numel()} entries, first {bad[0].tolist()}")
        else:
            msg = mismatch(a, b, tol, _field_spans(a.shape[0], counts))
            if msg:
                msgs.append(f"{what}: {k} {msg}")
    return msgs


def _field_spans(rows: int, counts: Optional[list]) -> Optional[list]:
    if counts and rows == sum(counts):
        return spans_of(counts)
    if counts and rows == len(counts):
        return spans_of([1] * rows)
    return None


def clone(o: RunnerOutput) -> RunnerOutput:
    return RunnerOutput(**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(o).items()})


# --------------------------------------------------------------------------- one case

def refusal_batches(rig: Rig, rng: random.Random, reqs: list) -> list:
    """(what, batch) pairs the runner must refuse, each with the text its message must hold."""
    r, k, out = rig.runner, rig.kind, []
    b = rig.batch(reqs, hidden=H.NULL)
    over = rig.runner.max_bs + 1
    if k == "piecewise":
        big = rig.new_requests(1, rng, tokens=1)
        big[0].ids = torch.zeros(over, dtype=I64, device=rig.device)   # only the count matters to the guard
        big[0].loc = torch.zeros(over, dtype=I64, device=rig.device)
        out.append(("tokens over the largest bucket", rig.batch(big), str(r.max_bs)))
        out.append(("TARGET_VERIFY", dataclasses.replace(b, forward_mode=ForwardMode.TARGET_VERIFY,
                                                         spec_info=SpecInfo(2, 1, 1)), "EXTEND"))
    else:
        out.append((f"bs={over} over the largest bucket", rig.batch(rig.new_requests(over, rng)), str(r.max_bs)))
        out.append(("input embeddings", dataclasses.replace(b, input_embeds=torch.zeros(1)), "embed"))
        if k == "draft_decode":
            out.append(("out_cache_loc of another num_steps*topk",
                        dataclasses.replace(b, out_cache_loc=b.out_cache_loc[:, :-1]), "num_steps*topk"))
            out.append(("mode TARGET_VERIFY", dataclasses.replace(b, forward_mode=ForwardMode.TARGET_VERIFY),
                        "TARGET_VERIFY"))
        else:
            other = ForwardMode.DRAFT_EXTEND if rig.mode != ForwardMode.DRAFT_EXTEND else ForwardMode.TARGET_VERIFY
            out.append((f"mode {other.name}", dataclasses.replace(b, forward_mode=other), other.name))
        if rig.mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND):
            s = b.spec_info
            out.append(("spec N mismatch", dataclasses.replace(b, spec_info=dataclasses.replace(
                s, num_draft_tokens=s.num_draft_tokens + 1, num_steps=s.num_steps + 1)), f"N={s.num_draft_tokens + 1}"))
        if rig.mode == ForwardMode.DECODE and k != "draft_decode":
            out.append(("draft decode batch", dataclasses.replace(
                b, spec_info=SpecInfo(3, 2, 1, draft_step=1)), "draft"))
    if r.capture_hidden_mode < H.FULL:
        out.append(("hidden mode above the captured one", dataclasses.replace(
            b, capture_hidden_mode=H(r.capture_hidden_mode + 1)), "hidden mode"))
    return out


def check_case(rig: Rig, rng: random.Random, judge: Callable[[str, list], None], *, tol: float,
               exact: bool = False) -> None:
    """Every runner invariant on one rig. ``judge(invariant, messages)`` records the outcome;
    ``exact``: compare replay with the eager forward of the same padded batch bitwise."""
    c = _Case(rig, rng, judge, tol, exact)
    keep_a = c.history()
    window_poison(c, keep_a, compare)
    c.poisoned_pads(keep_a)
    c.batch_invariance(keep_a)
    hidden_rule(c, compare)
    c.refusals()


class _Case:
    """One runner case: two request sets A and B drawn on the rig, and the checks run on them."""

    def __init__(self, rig: Rig, rng: random.Random, judge, tol: float, exact: bool) -> None:
        self.rig, self.rng, self.judge, self.tol, self.exact = rig, rng, judge, tol, exact
        r, maxb = rig.runner, rig.runner.max_bs
        budget = max(rig.spec.buckets)
        if rig.kind == "piecewise":
            self.reqs_a = rig.new_requests(rng.randint(1, 3), rng, tokens=budget - 1)   # raw tokens < bucket
            self.reqs_b = rig.new_requests(rng.randint(1, 3), rng, tokens=max(1, budget // 2))
        else:
            padded = [n for n in range(1, maxb) if n not in r.buckets]   # raw_bs < its bucket where possible
            ra = rng.choice(padded) if padded else rng.randint(1, maxb - 1) if maxb > 1 else 1
            rb = rng.choice([ra, rng.randint(1, maxb)])     # half the time B replays A's own graph
            self.reqs_a, self.reqs_b = rig.new_requests(ra, rng), rig.new_requests(rb, rng)
        self.ha, self.hb = (H(rng.randint(0, int(r.capture_hidden_mode))) for _ in range(2))
        if rig.kind == "piecewise":     # given input embeddings in A or B: a runner must load them
            g = torch.Generator().manual_seed(rng.randrange(1 << 30))
            for q in self.reqs_a if rng.random() < 0.5 else self.reqs_b:
                q.embeds = torch.randn(len(q.ids), rig.tc.hidden_size, generator=g).to(rig.device, rig.tc.dtype)
        self.backends = rig.flat(rig.backends)

    def counts(self, reqs) -> list:
        """The valid rows of each request (what ``compare`` names a row of an output by)."""
        return [c for _, c in self.rig.row_spans(reqs)]

    def run(self, reqs, hidden, padded_input=True) -> RunnerOutput:
        """One run, judged for I11 (can_run, one replay counted) and I12 (each backend refreshed once)."""
        rig, r = self.rig, self.rig.runner
        uniform = rig.kind not in ("draft_decode", "piecewise")
        b = rig.batch(reqs, rig.bucket(reqs) if padded_input and uniform else None, hidden)
        before, can = r.replay_count, r.can_run(b)
        kv = kv_snapshot(rig.mem)
        with refresh_counts(self.backends) as counts:
            try:
                out = r.run(b)
            finally:   # judged when the run raises too (a stale delegate fails its forward's key check)
                self.judge("I12", [f"backend {i} ({type(be).__name__}) refreshed {counts[id(be)]} times in one "
                                   "replay, expected 1" for i, be in enumerate(self.backends) if counts[id(be)] != 1])
        self.judge("I16", kv_writes_outside(rig.mem, kv, new_slots(rig, reqs)))
        msgs = [] if can else ["can_run was False for a batch the runner ran"]
        if r.replay_count != before + 1:
            msgs.append(f"replay_count went {before} -> {r.replay_count} for one run")
        self.judge("I11", msgs)
        return out

    def eager(self, reqs, hidden) -> RunnerOutput:
        """The eager reference forward, judged for I16 like a replay."""
        kv = kv_snapshot(self.rig.mem)
        out = self.rig.expected(reqs, hidden, self.exact)
        self.judge("I16", kv_writes_outside(self.rig.mem, kv, new_slots(self.rig, reqs)))
        return out

    def history(self) -> RunnerOutput:
        """I9 (replay == eager), I8 (no aliasing), I14 (A, B, A); returns A's outputs."""
        tol = 0 if self.exact else self.tol
        out_a = self.run(self.reqs_a, self.ha)
        keep_a = clone(out_a)
        ca, cb = self.counts(self.reqs_a), self.counts(self.reqs_b)
        self.judge("I9", compare(out_a, self.eager(self.reqs_a, self.ha), tol, "A replay vs eager", ca))
        against_float64(self, out_a, self.ha, compare)
        out_b = self.run(self.reqs_b, self.hb, padded_input=False)
        self.judge("I9", compare(out_b, self.eager(self.reqs_b, self.hb), tol, "B replay vs eager", cb))
        self.judge("I8", compare(out_a, keep_a, 0, "A's outputs after B's replay", ca))
        self.judge("I14", compare(self.run(self.reqs_a, self.ha), keep_a, 0, "A replayed after B", ca))
        return keep_a

    def poisoned_pads(self, keep_a: RunnerOutput) -> None:
        """I7: pad rows poisoned differently leave the real rows bit-identical."""
        rig, reqs = self.rig, self.reqs_a
        n_raw = sum(len(q.ids) for q in reqs) if rig.kind == "piecewise" else len(reqs)
        with poisoned_pads(rig, n_raw, self.rng):
            out_p = self.run(reqs, self.ha)
        self.judge("I7", compare(out_p, keep_a, 0, "A with poisoned pad rows", self.counts(reqs)))

    def batch_invariance(self, keep_a: RunnerOutput) -> None:
        """I10: the same request reordered among fewer others (another bucket and slot), the
        others' accept lengths changed."""
        rig, rng, reqs_a = self.rig, self.rng, self.reqs_a
        target = reqs_a[0]
        others = [dataclasses.replace(q, accept=rng.randint(1, rig.spec.n)) for q in reqs_a[1:]]
        rng.shuffle(others)
        others = others[:rng.randint(0, len(others))]
        slot = rng.randint(0, len(others))
        sub = others[:slot] + [target] + others[slot:]
        got = rig.per_request(self.run(sub, H.NULL), sub)[slot]
        want = rig.per_request(keep_a, reqs_a)[0]
        what = f"request row {target.row} in slot {slot} of {len(sub)} (was slot 0 of {len(reqs_a)})"
        tol10 = 3e-2 if self.exact else self.tol    # other buckets run other GEMM shapes: bf16 rounding differs
        if rig.kind == "draft_decode":
            msgs = compare(RunnerOutput(got[0]), RunnerOutput(want[0]), tol10, what)
            if not self.exact and not torch.equal(got[1], want[1]):
                msgs.append(f"{what}: draft tokens {got[1].tolist()} != {want[1].tolist()}")
        else:
            msgs = compare(RunnerOutput(got), RunnerOutput(want), tol10, what)
        self.judge("I10", msgs)

    def refusals(self) -> None:
        """I11: every refused batch raises RunnerRefusal naming the reason, nothing replays; every
        graph carries the captured hidden mode."""
        r = self.rig.runner
        keys = [k for k in r.graphs if not isinstance(k, int)]
        self.judge("I11", [f"graph {k} captured with hidden mode {k.capture_hidden_mode.name}, runner has "
                           f"{r.capture_hidden_mode.name}" for k in keys
                           if k.capture_hidden_mode != r.capture_hidden_mode])
        got = sorted({k if isinstance(k, int) else k.bs for k in r.graphs})   # a capped ladder: vLLM #53407
        self.judge("I11", [] if got == sorted(set(self.rig.spec.buckets)) else
                   [f"captured buckets {got}, asked {sorted(set(self.rig.spec.buckets))}: the others run eagerly"])
        for what, b, needle in refusal_batches(self.rig, self.rng, self.reqs_b):
            before, msgs = r.replay_count, []
            if r.can_run(b):
                msgs.append(f"can_run is True for {what}")
            try:
                r.run(b)
                msgs.append(f"run accepted {what}")
            except RunnerRefusal as e:
                if needle.lower() not in str(e).lower():
                    msgs.append(f"refusal of {what} does not name {needle!r}: {e}")
            except Exception as e:  # noqa: BLE001 - anything else is a crash, not a refusal
                msgs.append(f"{what}: {type(e).__name__} instead of RunnerRefusal: {e}")
            if r.replay_count != before:
                msgs.append(f"replay_count moved for a refused batch ({what})")
            self.judge("I11", msgs)


# --------------------------------------------------------------------------- the suite

def run_runner_suite(backend: str, *, device: str = "cpu", cases: int = 20, seed: int = 0,
                     progress: Optional[Callable[[int, int], None]] = None,
                     report: Optional[SuiteReport] = None, kv_dtype: Optional[torch.dtype] = None,
                     kinds: Optional[tuple] = None) -> SuiteReport:
    """Run random runner cases on ``backend`` (a registered name, ``module:Class`` or
    ``file.py:Class``) and record I7-I12, I14 and I16 per (backend, "runner:<kind>"): ``cases``
    of them, or one of each runner kind the backend declares where that is more (the count rule
    of :mod:`.runner_cases`: every run draws every kind). Failures carry the seed of their case:
    ``cases=1, seed=s`` runs that case first. On the GPU: bf16 and bitwise equality with the
    eager forward of the same padded batch (torch_native: float32 within 1e-4). ``kv_dtype``: the
    rigs' and the tiny engine's KV caches in that dtype (``fp8_scales``); the backend must read it. ``kinds``:
    those runner kinds alone (``rig.KINDS`` names; None: every kind the backend declares)."""
    cls = get_backend_class(backend)
    reason = unavailable_reason(cls, device)
    if reason:
        raise ValueError(f"backend {backend!r} is not available on {device}: {reason}")
    caps = cls.capabilities
    report = report or SuiteReport()
    cuda = device == "cuda"
    plan = plan_cases(caps, cases, seed, kinds)
    for i, (case_seed, kind, mla) in enumerate(plan):
        rng = random.Random(case_seed)
        spec = random_spec(rng, kind, backend, caps, mla, device, case_seed)
        # torch_native's shapes follow host max lengths; a backend without float32 runs bf16 everywhere
        exact = (cuda and backend != "torch_native") or torch.float32 not in caps.dtypes
        spec.dtype = torch.bfloat16 if exact else torch.float32
        spec.kv_dtype = kv_dtype
        mode = RUNNER_KINDS[spec.kind].label
        report.cases[(backend, mode)] += 1
        for label in spec.features.labels():
            report.feature_cases[(backend, mode, label)] += 1

        def judge(inv: str, msgs: list, _mode=mode, _spec=spec, _seed=case_seed) -> None:
            report.check(backend, _mode, inv, msgs, case=_spec.describe(), seed=_seed, suite=SUITE, device=device)

        try:
            rig = Rig(spec)
            check_case(rig, rng, judge, tol=1e-5 if backend == "torch_native" and not cuda else 1e-4, exact=exact)
        except Exception as e:  # noqa: BLE001 - a crash is a finding with its seed, not the end of the run
            judge("I9", [f"crashed: {type(e).__name__}: {e}"])
        if progress:
            progress(i + 1, len(plan))
    try:                                                 # once a run: what an engine captures
        msgs = executor_graph_messages(backend, device, kv_dtype)
    except Exception as e:  # noqa: BLE001 - a crash is a finding, as in a case
        msgs = [f"crashed: {type(e).__name__}: {e}"]
    report.cases[(backend, "runner:executor")] += 1
    report.check(backend, "runner:executor", "I11", msgs, case="tiny engine, plain and eagle", seed=seed,
                 suite=SUITE, device=device)
    return report


__all__ = ["KINDS", "RUNNER_KINDS", "Req", "Rig", "RigSpec", "check_case", "compare", "poisoned_pads",
           "refresh_counts", "refusal_batches", "run_runner_suite", "piecewise_eager"]
