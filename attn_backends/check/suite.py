"""The layout-equivalence suite: invariants I1-I6 and I13-I15 (the legend of report.py), at metadata level,
for any backend, in every mode it declares.

One *case* = one backend instance, one GraphKey (mode, bucket, W), a capture batch C and a
history A, B, A of different ragged batches with the same key. Before each replay the static
buffers are poisoned; after it ``as_layout()`` is compared with the eager metadata of the
same padded batch (a second backend instance), with the layout the runner wrote (stride W,
positions, out_cache_loc) and with the scenario's own numbers. EXTEND, which is never
captured, is checked eagerly (I1 against the runner, I3-I6, I14).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..batch import GraphInputs
from ..config import ModelConfig
from ..kinds import BATCH_KINDS, kinds_served
from ..registry import get_backend_class, unavailable_reason
from ..step import Prep, Step, prep_placement
from .features import Features, draw_features, window_poison
from .hostsync import GuardedTensor, HostSyncError, guard, no_host_sync
from .layout_checks import check_layout, compare_layouts, poison, snapshot
from .numbers import NumbersCheck
from .report import SuiteReport
from .scenarios import (
    PAGE_ORDERS,
    Scenario,
    dims_for,
    draft_decode_spec,
    draft_extend_spec,
    make_memory,
    materialize,
    verify_spec,
)

MODES = tuple(BATCH_KINDS)
MAX_CTX = 256
MAX_BS = 8
HEADS = 4


def declared_modes(caps) -> list:
    """The batch kinds (``kinds.BATCH_KINDS``) a backend declares, i.e. the suite's modes."""
    return kinds_served(caps)


@dataclass
class CaseSpec:
    """Everything one case needs; random_case draws it, hypothesis can build it too."""

    mode: str
    page_size: int
    page_order: str
    mla: bool
    bs: int
    n: int = 1                      # N (verify, draft extend)
    topk: int = 1
    steps: int = 1
    draft_step: int = 1
    batches: list = field(default_factory=list)   # [capture, A, B] of (prefixes, accept/extend)
    seed: int = 0
    kv_dtype: Optional[torch.dtype] = None          # the KV cache's (None: the model's), FP8_SCALES
    features: Features = field(default_factory=Features)   # window, softcap, sinks the layer uses

    def describe(self) -> str:
        kv = f" kv={str(self.kv_dtype)[6:]}" if self.kv_dtype is not None else ""
        feat = f" {self.features.describe()}" if self.features.labels() else ""
        return (f"mode={self.mode} page={self.page_size} layout={self.page_order} "
                f"{'MLA' if self.mla else 'GQA'} bucket={self.bs} N={self.n} topk={self.topk} "
                f"steps={self.steps} draft_step={self.draft_step} batches={self.batches}{kv}{feat}")


def _width(c: CaseSpec) -> int:
    return {"decode": 1, "draft_decode": c.topk}.get(c.mode, c.n)


def _prefix(rng: random.Random, ps: int, lo: int, hi: int) -> int:
    k = rng.randint(1, max(1, hi // max(ps, 1)))
    pick = rng.choice([0, ps - 1, ps, ps + 1, k * ps - 1, k * ps + 1, rng.randint(0, hi)])
    return min(max(pick, lo), hi)


def random_case(rng: random.Random, mode: str, caps, mla: bool, seed: int) -> CaseSpec:
    ps = caps.page_sizes[rng.randrange(len(caps.page_sizes))]
    c = CaseSpec(mode, ps, rng.choice(PAGE_ORDERS), mla, bs=rng.randint(2, MAX_BS), seed=seed)
    if mode == "verify_chain" or (mode == "draft_extend" and (rng.random() < 0.5 or not caps.topk_gt1)):
        c.n = rng.randint(2, 8)
        c.steps = c.n - 1
    elif mode == "draft_extend":   # topk > 1: N is the tree size, never num_steps + 1 (sgl #19807)
        c.topk, c.steps = rng.choice([2, 4]), rng.randint(1, 3)
        c.n = rng.randint(c.steps + 2, min(c.steps * c.topk + 1, 8))
    elif mode == "verify_tree":
        c.topk = rng.choice([2, 4, 8])
        c.steps = rng.randint(1, 5)
        c.n = rng.randint(c.steps + 1, min(c.steps * c.topk + 1, 16))
    elif mode == "draft_decode":
        c.topk = rng.choice([1, 2, 4, 8] if caps.topk_gt1 else [1])
        c.steps = rng.randint(1, 5)
        c.draft_step = rng.randint(1, c.steps)
    w = _width(c)
    c.features = draw_features(caps, seed, rng, HEADS, w, ps, MAX_CTX, c.topk)
    lo = w * (c.draft_step - 1) if mode == "draft_decode" else 0
    raw_a = rng.randint(1, c.bs)
    raws = [rng.randint(1, c.bs), raw_a, rng.randint(1, raw_a)]   # history biased to shrink
    top = MAX_CTX - max(w, 8)
    for b, raw in enumerate(raws):
        # capture short, replay long: a host bound (max_seq_len_k) kept from the capture shows
        prefixes = [_prefix(rng, ps, lo, lo + ps + 1 if b == 0 else top) for _ in range(raw)]
        if b == 1:
            prefixes[rng.randrange(raw)] = top - rng.randint(0, ps)
        if mode == "extend":
            extra = [rng.randint(1, min(8, MAX_CTX - p)) for p in prefixes]
        elif mode == "draft_extend":
            kind = rng.random()
            extra = ([1] * raw if kind < 0.2 else [c.n] * raw if kind < 0.4
                     else [rng.randint(1, c.n) for _ in range(raw)])
        else:
            extra = None
        c.batches.append((prefixes, extra))
    return c


def _scenario(c: CaseSpec, prefixes, extra, rng: random.Random, device) -> Scenario:
    mode = BATCH_KINDS[c.mode].mode
    spec = None
    raw = len(prefixes)
    bs = raw if c.mode == "extend" else c.bs
    if c.mode in ("verify_chain", "verify_tree"):
        spec = verify_spec(c.n, bs, rng, topk=c.topk, steps=c.steps, device=device)
    elif c.mode == "draft_extend":
        spec = draft_extend_spec(c.n, bs, raw, extra, device=device, topk=c.topk, steps=c.steps)
    elif c.mode == "draft_decode":
        spec = draft_decode_spec(c.topk, c.steps, c.draft_step)
    return Scenario(mode, bs, list(prefixes), spec, extra if c.mode == "extend" else None, name=c.mode)


def fp8_scales(mla: bool) -> tuple:
    """The (k, v) scales of the suites' FP8 caches: other than 1, so that a scale left out shows
    (MLA's one latent cache: k == v)."""
    return (0.5, 0.5) if mla else (0.5, 0.25)


def _config(c: CaseSpec, caps=None) -> ModelConfig:
    """A small model the backend accepts (``caps``: its head dims and dtypes; float32 first)."""
    dtype = torch.float32 if caps is None or torch.float32 in caps.dtypes else caps.dtypes[-1]
    dims = dims_for(caps, c.mla) if caps is not None else {}
    if c.kv_dtype is not None:
        dims.update(kv_dtype=c.kv_dtype, kv_scales=(fp8_scales(c.mla),))
    dims.update(c.features.config_kwargs())
    if c.mla:
        return ModelConfig(num_layers=1, num_q_heads=HEADS, is_mla=True, page_size=c.page_size, dtype=dtype, **dims)
    return ModelConfig(num_layers=1, num_q_heads=HEADS, num_kv_heads=2, page_size=c.page_size, dtype=dtype,
                       **{"head_dim": 16, **dims})


def _guarded_inputs(gi: GraphInputs) -> GraphInputs:
    spec = gi.spec_info
    if spec is not None:
        spec = type(spec)(**{**vars(spec), "accept_lens": guard(spec.accept_lens), "tree_mask": guard(spec.tree_mask)})
    return GraphInputs(gi.key, guard(gi.req_pool_indices), guard(gi.seq_lens), gi.seq_lens_cpu, spec, gi.raw_bs,
                       gi.step)


def _plain(d: dict) -> dict:
    return {k: (v.as_subclass(torch.Tensor).clone() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def run_case(cls, c: CaseSpec, report: SuiteReport, device="cpu", name: Optional[str] = None) -> None:
    """One case: capture C, then replay A, B, A with poisoned buffers (EXTEND: eager only)."""
    run = _CaseRun(cls, c, report, device, name or getattr(cls, "name", cls.__name__))
    if c.mode == "extend":
        run.eager_history()
    elif run.capture():
        run.replay_history()


class _CaseRun:
    """The state of one case: its memory, a graph and an eager backend instance, its batches."""

    def __init__(self, cls, c: CaseSpec, report: SuiteReport, device, name: str) -> None:
        self.c, self.report, self.name, self.device = c, report, name, device
        rng = random.Random(c.seed)
        cfg = _config(c, cls.capabilities)
        per_req = -(-MAX_CTX // c.page_size)
        self.mem = make_memory(cfg, num_pages=3 * MAX_BS * per_req + 2, max_reqs=3 * MAX_BS, max_context_len=MAX_CTX,
                               page_order=c.page_order, seed=c.seed, device=device)   # random KV: I9n
        self.graph_be, self.eager_be = cls(cfg, self.mem), cls(cfg, self.mem)
        self.layout_only = cls.capabilities.layout_only
        self.numbers = NumbersCheck(cfg, self.mem, c.seed, c.features.sinks_tensor(device))
        self.fill = self.graph_be.get_cuda_graph_seq_len_fill_value()
        self.mats = [materialize(_scenario(c, p, e, rng, device), self.mem, self.fill) for p, e in c.batches]
        self.step: Optional[Step] = None          # the graph side's step, driven as a runner drives it
        report.cases[(name, c.mode)] += 1
        for label in c.features.labels():
            report.feature_cases[(name, c.mode, label)] += 1

    def judge(self, inv: str, msgs: list) -> bool:
        return self.report.check(self.name, self.c.mode, inv, msgs, case=self.c.describe(), seed=self.c.seed,
                                 device=str(self.device))

    def _numbers(self, be, batch, what: str) -> None:
        due = self.numbers.due(what)                     # once per case on the CPU: asked once
        if due and self.layout_only:                     # declared: no forward here, the layout checks alone
            self.report.skip(self.name, self.c.mode, "I9n", self.layout_only)
            if what == "eager" and self.numbers.layer.window is not None:
                self.report.skip(self.name, self.c.mode, "I17", self.layout_only)
        elif due:
            msgs = self.numbers.check(be, batch, what)
            if what == "eager" and self.numbers.layer.window is not None:
                self.judge("I17", window_poison(be, self.numbers.layer, batch, self.mem, self.numbers.last_q))
            if msgs and what == "replayed" and self.step.prep is Prep.IN_STEP_GRAPH:
                msgs = [f"{m} (the step's layout was built in its graph, after the backend's replay update: "
                        "what the backend derived from the view outside the graph is one step stale)" for m in msgs]
            self.judge("I9n", msgs)

    def _steps(self) -> list:
        return [self.step] if self.step is not None else []

    def eager_history(self) -> None:
        layouts = []
        for m in [self.mats[1], self.mats[2], self.mats[1]]:
            self.eager_be.init_forward_metadata(m.batch)
            lay = _plain(self.eager_be.forward_metadata.as_layout())
            _judge_layout(self.judge, lay, None, m, self.mem, self.fill)
            self._numbers(self.eager_be, m.batch, "eager")
            layouts.append(lay)
        self.judge("I14", compare_layouts(layouts[2], layouts[0], exact=True))

    def capture(self) -> bool:
        """I13 (a valid capture batch is accepted) and I15 under a (simulated) stream capture. The
        graph side runs as a runner runs it: the suite's step holds the inputs and the layout, its
        prep placed as a runner over this backend places it (``prep_placement``)."""
        be, w = self.graph_be, _width(self.c)
        be.init_cuda_graph_state(MAX_BS, MAX_BS * max(w, 1))
        self.step = Step(self.mem, self.fill, max_bs=MAX_BS, max_width=max(w, 1), prep=prep_placement([be]))
        cap = self.mats[0].batch.graph_inputs()
        try:
            be.init_forward_metadata_capture_cuda_graph(self._capture_inputs(cap))
            ok13 = []
        except Exception as e:  # noqa: BLE001 - any refusal of a valid capture batch is the finding
            ok13 = [f"capture of a valid batch failed: {type(e).__name__}: {e}"]
        if not self.judge("I13", ok13):
            return False
        found = check_layout(_plain(be.forward_metadata.as_layout()), self.mats[0], self.mem, self.fill)
        self.judge("I13", [f"captured layout: {m}" for ms in found.values() for m in ms])  # as replays' (vLLM #32645)
        self._guarded("capture", lambda: be.init_forward_metadata_capture_cuda_graph(
            _guarded_inputs(self._capture_inputs(cap))), simulate_capture=True)
        return True

    def _capture_inputs(self, cap: GraphInputs) -> GraphInputs:
        """What a runner hands its backends at capture: the step loaded with the capture batch."""
        return self.step.graph_inputs(cap.key, self.step.capture_inputs(cap))

    def _replay_inputs(self, inputs: GraphInputs) -> GraphInputs:
        """What a runner hands its backends at a replay: the rows loaded, the step updated."""
        return self.step.graph_inputs(inputs.key, self.step.update_inputs(inputs))

    def _replay(self, gi: GraphInputs) -> None:
        """The backend's replay update, then what the graph's replay starts with where the step's
        prep runs in it (so what the backend derived outside the graph is one step stale there)."""
        self.graph_be.init_forward_metadata_replay_cuda_graph(gi)
        if self.step.prep is Prep.IN_STEP_GRAPH:
            self.step.run_prep(gi.key)

    def _guarded(self, what: str, fn, simulate_capture: bool = False) -> bool:
        """Run ``fn`` with every device input guarded (I15); False if it synced."""
        try:
            with no_host_sync(self.mem, simulate_capture=simulate_capture, steps=self._steps()):
                fn()
            return self.judge("I15", [])
        except (HostSyncError, RuntimeError) as e:
            if not _is_sync_error(e):
                raise
            return self.judge("I15", [f"{what}: {e}"])

    def replay_history(self) -> None:
        """Replay A, B, A, each after poisoning every graph buffer: I1-I6, I2, I14, I15."""
        be = self.graph_be
        bufs0 = snapshot(be.graph_buffers())
        ptrs = {k: v.data_ptr() for k, v in be.forward_metadata.as_layout().items() if isinstance(v, torch.Tensor)}
        spacer = torch.empty(4096, dtype=torch.int32, device=self.device)  # an allocation between capture and replay
        layouts = []
        for m in [self.mats[1], self.mats[2], self.mats[1]]:
            poison(be.graph_buffers())
            inputs = m.batch.graph_inputs()
            if not self._guarded("replay", lambda: self._replay(_guarded_inputs(self._replay_inputs(inputs)))):
                self._replay(self._replay_inputs(inputs))
            rep = _plain(be.forward_metadata.as_layout())
            moved = [f"layout field {k} moved: data_ptr {ptrs.get(k)} at capture, {v.data_ptr()} at replay"
                     for k, v in be.forward_metadata.as_layout().items()
                     if isinstance(v, torch.Tensor) and ptrs.get(k) != v.data_ptr()]
            self.judge("I2", moved + [f"graph buffer {k}: {a} at capture, {b} now" for k, a, b in
                                      _snapshot_diff(bufs0, snapshot(be.graph_buffers()))])
            self._numbers(be, m.batch, "replayed")
            self.eager_be.init_forward_metadata(m.batch)
            eager = _plain(self.eager_be.forward_metadata.as_layout())
            _judge_layout(self.judge, rep, eager, m, self.mem, self.fill)
            self._numbers(self.eager_be, m.batch, "eager")
            layouts.append(rep)
        self.judge("I14", compare_layouts(layouts[2], layouts[0], exact=True))
        del spacer  # held through the replays: a re-allocating replay would not get the captured address


def _is_sync_error(e: Exception) -> bool:
    """Our guard's error, or CUDA's sync debug mode ("called a synchronizing CUDA operation")."""
    return isinstance(e, HostSyncError) or "synchroniz" in str(e)


def _snapshot_diff(a: dict, b: dict):
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            yield k, a.get(k), b.get(k)


def _judge_layout(judge, lay: dict, eager: Optional[dict], m, mem, fill) -> None:
    res = check_layout(lay, m, mem, fill)
    i1 = res.pop("I1")
    if eager is not None:
        i1 = compare_layouts(lay, eager, exact=False) + i1
    judge("I1", i1)
    for inv in ("I3", "I4", "I5", "I6"):
        judge(inv, res[inv])


def layout_modes(caps, modes: Optional[list] = None) -> list:
    """The modes a run of the layout suite covers, in running order: those ``caps`` declares,
    narrowed to ``modes`` where given."""
    return [m for m in declared_modes(caps) if modes is None or m in modes]


def run_suite(backend: str, *, device: str = "cpu", cases: int = 200, seed: int = 0,
              modes: Optional[list] = None, progress: Optional[Callable[[int, int], None]] = None,
              report: Optional[SuiteReport] = None, shard: tuple = (0, 1),
              kv_dtype: Optional[torch.dtype] = None) -> SuiteReport:
    """Run ``cases`` random cases per declared mode of ``backend`` (a name, ``module:Class``,
    ``file.py:Class``, or a class). The failures carry the seed that replays each case alone:
    with ``cases=1`` the one case of each mode has the seed ``seed`` itself. ``shard=(k, n)``:
    only every n-th case of that order from the k-th on (the same seeds), so that n processes
    together run the cases of one run (``attn-backends check --jobs n``). ``kv_dtype``: every case's
    KV cache in that dtype (``fp8_scales``); the backend must read it."""
    cls = backend if isinstance(backend, type) else get_backend_class(backend)
    name = backend if isinstance(backend, str) else getattr(cls, "name", cls.__name__)
    reason = unavailable_reason(cls, device)
    if reason:
        raise ValueError(f"backend {name!r} is not available on {device}: {reason}")
    caps = cls.capabilities
    report = report or SuiteReport()
    todo = layout_modes(caps, modes)
    part, parts = shard
    if not 0 <= part < parts:
        raise ValueError(f"shard {shard}: want (k, n) with 0 <= k < n")
    total, done = len(range(part, len(todo) * cases, parts)), 0
    kinds = [k for k, ok in (("mha", caps.mha), ("mla", caps.mla)) if ok]
    for mi, mode in enumerate(todo):
        for i in range(cases):
            if (mi * cases + i) % parts != part:
                continue
            case_seed = seed + 1_000_003 * mi + i if cases > 1 else seed
            rng = random.Random(case_seed)
            c = random_case(rng, mode, caps, kinds[case_seed % len(kinds)] == "mla", case_seed)
            c.kv_dtype = kv_dtype
            run_case(cls, c, report, device, name)
            done += 1
            if progress:
                progress(done, total)
    return report


__all__ = ["CaseSpec", "GuardedTensor", "declared_modes", "layout_modes", "random_case", "run_case", "run_suite",
           "MODES"]
