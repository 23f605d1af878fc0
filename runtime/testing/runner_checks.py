"""Runner checks beside those of :mod:`.runner_suite`:

- I16 KV slots: after a step, every KV slot other than the raw rows' new slots and the reserved
  slot 0 is bitwise unchanged (a padding row pointed at a real slot corrupts another request's
  cache silently);
- I7 the one hidden rule, against rows derived from first principles (LAST: the last valid row
  of each raw request, FULL: every valid row, in order), not against the runner's own slicing;
- I9 against the independent float64 reference (:mod:`.reference`), which catches what replay ==
  eager on the same backend cannot: a wrong causal or tree mask in a kernel;
- I9 of the executor's eager fallback, in every mode it serves: its outputs come from the eager
  forward, never from a graph's static buffers (sgl #22832), checked by value;
- I17 the window's poison: NaN in every sliding layer's KV pages wholly before each request's window start
  leaves the replay's outputs bitwise unchanged;
- I11 of the executors an engine builds: a graph runner for exactly the uniform modes whose graph
  support the backend declares (sgl #30944 built the draft-extend graph for a list of names).
"""
from __future__ import annotations

import dataclasses
import random

import torch

from attn_backends import CaptureHiddenMode as H
from attn_backends import get_backend
from attn_backends.check.features import layer_pools, poisoned, slots_before_window
from attn_backends.check.numbers import batch_spans, mismatch

from ..attention_hook import splitting
from ..executor import ModelExecutor
from ..runner_base import RunnerOutput


def kv_pools(mem) -> list:
    """``[(name, tensor [slots, ...])]``: every KV pool tensor of ``mem``."""
    pool = mem.pool
    if mem.is_mla:
        return [(f"kv[{i}]", t) for i, t in enumerate(pool.kv)]
    return [(f"{n}[{i}]", t) for n in ("k", "v") for i, t in enumerate(getattr(pool, n))]


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``[slots, ...]`` integers with the bits of ``t`` (NaN compares equal to itself)."""
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()]).reshape(t.shape[0], -1)


def kv_snapshot(mem) -> list:
    return [_bits(t).clone() for _, t in kv_pools(mem)]


def new_slots(rig, reqs: list) -> torch.Tensor:
    """The KV slots a step of ``reqs`` may write: its raw rows' new slots and the reserved slot 0."""
    return torch.cat([r.loc.reshape(-1).cpu() for r in reqs] + [torch.zeros(1, dtype=torch.int64)])


def kv_writes_outside(mem, before: list, allowed: torch.Tensor) -> list:
    """I16 messages: slots written since ``before`` (a :func:`kv_snapshot`) other than ``allowed``."""
    msgs = []
    for (name, t), old in zip(kv_pools(mem), before):
        changed = (_bits(t) != old).any(-1).cpu()
        changed[allowed] = False
        if bool(changed.any()):
            bad = changed.nonzero()[:, 0]
            msgs.append(f"KV pool {name}: {bad.numel()} slot(s) {bad[:6].tolist()} written, none of them a raw "
                        "row's new slot or the reserved slot 0")
    return msgs


def hidden_rule(case, compare) -> None:
    """I7: LAST and FULL of the runner against the rows the one rule selects from the eager
    forward's every row (spans from :meth:`Rig.row_spans`), for each mode the runner captured."""
    rig = case.rig
    reqs = case.reqs_a
    spans = rig.row_spans(reqs)
    every = rig.eager_rows(reqs, padded=case.exact)
    want = {H.LAST: every[[s + c - 1 for s, c in spans]], H.FULL: every[[s + j for s, c in spans for j in range(c)]]}
    for mode in (H.LAST, H.FULL):
        if mode > rig.runner.capture_hidden_mode:
            continue
        out = case.run(reqs, mode)
        got = RunnerOutput(out.hidden) if out.hidden is not None else RunnerOutput(torch.empty(0))
        case.judge("I7", compare(got, RunnerOutput(want[mode]), 0 if case.exact else case.tol,
                                 f"hidden {mode.name} by the one rule ({len(spans)} requests)"))


def window_poison(case, keep_a: RunnerOutput, compare) -> None:
    """I17: A replayed with NaN in the KV pages of every sliding layer wholly before each request's
    window start (its first row's position minus the window plus one; later rows, draft steps and
    deeper tree tokens see no earlier) gives A's outputs bitwise."""
    rig, cfg = case.rig, case.rig.tc.attention()
    w = rig.tc.sliding_window
    if w is None:
        return
    slots = torch.cat([slots_before_window(rig.mem, r.row, r.prefix - w + 1) for r in case.reqs_a])
    if not slots.numel():
        return
    layers = [i for i in range(rig.tc.num_layers) if cfg.window(i) is not None]
    with poisoned(layer_pools(rig.mem, layers), slots):
        out = case.run(case.reqs_a, case.ha)
    case.judge("I17", compare(out, keep_a, 0, f"A with NaN in {slots.numel()} KV slots of layers {layers} before "
                              f"the windows (w={w})", case.counts(case.reqs_a)))


def against_float64(case, out: RunnerOutput, hidden, compare) -> None:
    """I9: the replay's outputs against the float64 reference on the unpadded batch; where they
    differ, the first attention call whose output differs too (:func:`attention_diagnosis`)."""
    rig = case.rig
    if case.exact and rig.kind == "draft_decode":
        return          # bf16 greedy branches may pick other tokens than float64 ones: no common ground
    tol = 8e-2 if rig.tc.dtype == torch.bfloat16 else 2e-3
    want = rig.expected(case.reqs_a, hidden, float64=True)
    msgs = compare(out, want, tol, "A replay vs the float64 reference", case.counts(case.reqs_a))
    case.judge("I9", msgs + [attention_diagnosis(rig, case.reqs_a, hidden, tol)] if msgs else [])


class _TwinAttention:
    """An attention hook (``attention_hook.splitting``) that answers every call with the float64
    reference and runs a fresh instance of the backend under test beside it, eagerly, on the same
    q and KV: the first call where the two differ is where the numbers go wrong."""

    def __init__(self, rig, tol: float) -> None:
        self.rig, self.tol, self.found = rig, tol, None

    def on_attention(self, backend, q, k, v, layer, batch):
        out = backend.forward(q, k, v, layer, batch)          # the reference stores this step's K/V
        if self.found is None:
            ours = get_backend(self.rig.backend_name, self.rig.tc.attention(), self.rig.mem)
            own = dataclasses.replace(batch, step=None)           # its own layout, not the reference's step
            ours.init_forward_metadata(own)
            got = ours.forward(q, k, v, layer, own, save_kv_cache=False)
            spans = batch_spans(batch)
            real = sum(n for _, n in spans)
            msg = mismatch(got[:real], out[:real], self.tol, spans)
            if msg:
                spec = batch.spec_info
                step = f" of draft step {spec.draft_step}" if spec is not None and spec.is_draft_decode else ""
                self.found = f"attention of layer {layer.layer_id}{step}, eager, vs the float64 reference: {msg}"
        return out


def attention_diagnosis(rig, reqs: list, hidden, tol: float) -> str:
    """Where the backend's eager attention first leaves the float64 reference on ``reqs``: the
    layer, request, query row, head and element, both values."""
    twin = _TwinAttention(rig, tol)
    with splitting(twin):
        rig.expected(reqs, hidden, float64=True)
    return twin.found or ("the eager attention of every layer agrees with the float64 reference: "
                          "the difference comes from the replay")


FALLBACK_KINDS = ("decode", "verify", "verify_tree", "draft_extend", "draft_decode", "piecewise")
_EXECUTOR_KEY = {"decode": "decode", "verify": "verify", "verify_tree": "verify", "draft_extend": "draft_extend",
                 "draft_decode": "draft_decode", "piecewise": "extend"}


def _fallback_rig(kind: str):
    """A rig of ``kind`` captured with hidden mode NULL, and an executor serving its mode with
    its runner (multi-step draft decode through ``draft``)."""
    from .rig import Rig, RigSpec
    rig = Rig(RigSpec(kind, buckets=(8, 16) if kind == "piecewise" else (2, 4), hidden=H.NULL, n=3, seed=1))
    multi = rig.runner if kind == "draft_decode" else None
    return rig, ModelExecutor("fallback", rig.model, rig._backends(), {_EXECUTOR_KEY[kind]: rig.runner}, multi)


def _fallback_of(kind: str, compare) -> list:
    """One mode: replay A, then run B (new requests, A's count) with hidden LAST, which the
    runner refuses: the executor's eager fallback. Stale static outputs of A's replay would have
    B's shape, so B is judged by value against an independent eager forward."""
    rig, ex = _fallback_rig(kind)
    key, rng = _EXECUTOR_KEY[kind], random.Random(2)
    run = ex.draft if kind == "draft_decode" else ex.forward
    count = 2 if kind == "piecewise" else 3
    run(rig.batch(rig.new_requests(count, rng)))
    msgs = [] if ex.counts[key]["graph"] == 1 else [f"{kind}: batch A did not replay ({dict(ex.counts[key])})"]
    cases = [("a batch of A's size with hidden LAST above the captured NULL", rig.new_requests(count, rng), H.LAST)]
    if kind == "decode":
        cases.append(("bs=5 over the largest bucket", rig.new_requests(5, rng), H.NULL))
    for what, reqs, hidden in cases:
        eager = ex.counts[key]["eager"]
        out = run(rig.batch(reqs, hidden=hidden))
        if ex.counts[key]["eager"] != eager + 1:
            msgs.append(f"{kind}, {what}: not counted as an eager fallback")
        want = rig.expected(reqs, hidden)
        msgs += compare(out, want, 1e-5, f"{kind}, {what}: executor output vs the eager forward",
                        [n for _, n in rig.row_spans(reqs)])
    return msgs


def fallback_messages(kinds=FALLBACK_KINDS) -> list:
    """The executor's eager fallback in every mode it serves (``FALLBACK_KINDS``: decode, chain
    and tree verify, draft extend, multi-step draft decode, piecewise extend): each refused
    batch's outputs by value against an independent eager forward (sgl #22832: a fallback that
    returns a graph's static outputs has the right shape; only the values tell)."""
    from .runner_suite import compare
    msgs = []
    for kind in kinds:
        try:
            msgs += _fallback_of(kind, compare)
        except Exception as e:  # noqa: BLE001 - a crash is a finding of this mode; the others still run
            msgs.append(f"{kind}: crashed: {type(e).__name__}: {e}")
    return msgs


def executor_graph_messages(backend: str, device: str = "cpu", kv_dtype=None) -> list:
    """I11: the executors of a tiny engine on ``backend`` (plain and, where it serves verify and
    draft extend, EAGLE; built, not captured) hold a graph runner for a uniform mode exactly where
    the backend's capabilities declare graph support for it; EXTEND always runs piecewise."""
    from attn_backends import ForwardMode as M
    from attn_backends import GraphSupport
    from attn_backends.check.scenarios import dims_for
    from attn_backends.check.suite import fp8_scales
    from attn_backends.registry import get_backend_class

    from ..eagle import SpecConfig
    from ..engine import Engine, EngineConfig
    from ..models import TinyConfig
    caps = get_backend_class(backend).capabilities
    full = lambda mode: mode in caps.modes and caps.graph_for(mode) >= GraphSupport.UNIFORM_BATCH  # noqa: E731
    want = {None: {"target": {"extend"} | ({"decode"} if full(M.DECODE) else set())}}
    if {M.TARGET_VERIFY, M.DRAFT_EXTEND} <= caps.modes:
        want[SpecConfig("eagle", 1, 3, 4)] = {
            "target": {"extend"} | ({"verify"} if full(M.TARGET_VERIFY) else set()),
            "draft": {"extend"} | {k for k, m in (("draft_extend", M.DRAFT_EXTEND), ("draft_decode", M.DECODE))
                                   if full(m)}}
    msgs = []
    for spec, runners in want.items():
        mla = not caps.mha                                # a model the backend serves, as the rig builds it
        cfg = TinyConfig(is_mla=mla, page_size=caps.page_sizes[0], **dims_for(caps, mla),
                         dtype=torch.float32 if torch.float32 in caps.dtypes else torch.bfloat16,
                         kv_dtype=kv_dtype, kv_scale=fp8_scales(mla))
        eng = Engine(EngineConfig(cfg, backend, spec, device, max_batch=2, max_context_len=64,
                                  max_prefill_tokens=16), capture=False)
        for ex in eng.executors:
            got = set(ex.runners)
            if got != runners[ex.name]:
                msgs.append(f"{'eagle' if spec else 'plain'} engine, {ex.name} executor: graph runners for "
                            f"{sorted(got)}, the capabilities declare {sorted(runners[ex.name])}")
    return msgs
