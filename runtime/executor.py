"""One model's forwards, each through a runner: the captured graph where the runner can run
the batch (``try_run``: the refusal checked once), the eager path otherwise, both counted per
mode so that a silent fallback to eager shows in the summary. Outputs always come from
the path that ran; nothing reads a runner's buffers.

Every runner owns its backend instance(s) (a runner's ``init_cuda_graph_state`` re-binds its
backends' static buffers); the eager path has its own.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Optional

from attn_backends import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    GraphSupport,
    KVMemory,
    SpecInfo,
    get_backend,
    select_rows,
)
from attn_backends.registry import AUTO, get_backend_class, refusal, select
from attn_backends.step import Step, eager_steps_of

from .draft import DraftExtendRunner, DraftInput, MultiStepDraftRunner
from .full_graph import UniformGraphRunner
from .piecewise import PiecewiseRunner
from .runner_base import RunnerOutput, run_eager, slice_hidden

H = CaptureHiddenMode
MODE_KEYS = {ForwardMode.EXTEND: "extend", ForwardMode.DECODE: "decode", ForwardMode.TARGET_VERIFY: "verify",
             ForwardMode.DRAFT_EXTEND: "draft_extend"}


class ModelExecutor:
    def __init__(self, name: str, model, eager_backends, runners: dict,
                 multi_step: Optional[MultiStepDraftRunner] = None, layer_names: Optional[list] = None) -> None:
        self.name, self.model, self.eager_backends = name, model, eager_backends
        self.layer_names = layer_names        # {pool layer id: backend} of the model's layers
        self.runners = {k: r for k, r in runners.items() if r is not None}
        self.multi_step = multi_step
        self.counts: dict = defaultdict(lambda: {"graph": 0, "eager": 0})
        self._eager_step: Optional[Step] = None     # kept across batches, with its library state

    def capture(self) -> None:
        for r in self.runners.values():
            r.capture()

    def _count(self, key: str, graph: bool) -> None:
        self.counts[key]["graph" if graph else "eager"] += 1

    def forward(self, batch: ForwardBatch) -> RunnerOutput:
        """Logits (and hidden states per the batch's mode) of the raw rows; DRAFT_EXTEND keeps
        one row per request (``accept_len - 1``) on either path."""
        key = MODE_KEYS[batch.forward_mode]
        runner = self.runners.get(key)
        out = None if runner is None else runner.try_run(batch)
        self._count(key, out is not None)
        if out is not None:
            return out
        width = 0 if batch.forward_mode == ForwardMode.EXTEND else batch.width
        step = self._eager_step_of()
        if batch.forward_mode != ForwardMode.DRAFT_EXTEND:
            return run_eager(self.model, self.eager_backends, batch, width, step)
        out = run_eager(self.model, self.eager_backends, dataclasses.replace(batch, capture_hidden_mode=H.FULL), width,
                        step)
        acc = batch.spec_info.accept_lens[:batch.raw_bs]
        rows = select_rows(batch.raw_bs, width, acc)
        hidden = slice_hidden(out.hidden, batch.capture_hidden_mode, batch.raw_bs * width, width, acc)
        return RunnerOutput(out.logits[rows], hidden, rows=rows)

    def _eager_step_of(self) -> Step:
        if self._eager_step is None:
            self._eager_step = eager_steps_of(self.model.backends_per_layer(self.eager_backends))
        return self._eager_step

    def draft(self, inp: DraftInput) -> RunnerOutput:
        """Multi-step draft decode: ``rows`` [bs, steps, topk] tokens, ``scores`` their log-probs."""
        r = self.multi_step
        out = r.try_run(inp)                   # None until captured (graphs off: never)
        self._count("draft_decode", out is not None)
        return out if out is not None else r.run_eager(inp)


def graphs_for(backend, mode: ForwardMode) -> bool:
    """Whether a graph may hold ``backend``'s attention in ``mode`` (a name, or the names of a
    model's layers: every one): the capabilities they declare decide, never a name (SGLang #30944
    built the draft-extend graph for a list of names)."""
    names = [backend] if isinstance(backend, str) else backend
    return all(get_backend_class(n).capabilities.graph_for(mode) >= GraphSupport.UNIFORM_BATCH for n in names)


def layer_backend_names(backend: str, cfg, layers, device: str, modes: dict) -> list:
    """The backend of each layer of ``layers``: ``backend`` where it serves the layer in every mode
    of ``modes`` (``{mode: topk}``), else the first that ``select`` ranks for that layer and that
    serves them all: a layer whose window, sinks or cap ``backend`` does not declare gets one that
    does (SGLang picks triton for models with sinks), the others keep the one asked for. A backend
    refused the model for another reason (MLA, a mode, a dtype) is kept everywhere: building it
    raises that reason, as it did before the features existed."""
    plain = dataclasses.replace(cfg, sliding_window=None, layer_types=None, logit_softcap=None, sinks=False)
    if any(refusal(backend, plain, m, device, k) for m, k in modes.items()):
        return [backend] * len(layers)
    out = []
    for i in layers:
        name, tried = backend, []
        while any(refusal(name, cfg, m, device, k, layer=i) for m, k in modes.items()):
            tried.append(name)
            name = select(cfg, next(iter(modes)), device, modes[next(iter(modes))], exclude=tried,
                          backend=AUTO, layer=i).name
        out.append(name)
    return out


def layer_backends(names: list, cfg, memory: KVMemory, layers):
    """One instance per distinct name, each checked for its layers (``get_backend(layers=)``); the
    instance itself where every layer has the same backend, else the list per layer."""
    made = {n: get_backend(n, cfg, memory, layers=[i for i, m in zip(layers, names) if m == n]) for n in set(names)}
    return made[names[0]] if len(made) == 1 else [made[n] for n in names]


def target_executor(model, memory: KVMemory, backend: str, cfg, *, buckets, token_buckets, graphs: bool,
                    spec: Optional[SpecInfo] = None) -> ModelExecutor:
    """EXTEND on the piecewise runner; DECODE (no spec) or TARGET_VERIFY (spec, chain or tree) on
    full graphs. With spec the target returns every row's hidden states (the draft's features).
    Each layer on ``backend``, or where it lacks the layer's features, on one that has them."""
    modes = {ForwardMode.EXTEND: 1, ForwardMode.DECODE: 1} if spec is None else \
        {ForwardMode.EXTEND: 1, ForwardMode.TARGET_VERIFY: spec.topk}
    layers = range(model.config.num_layers)
    backend = layer_backend_names(backend, cfg, layers, memory.device.type, modes)
    mk = lambda: layer_backends(backend, cfg, memory, layers)  # noqa: E731
    hidden = H.FULL if spec is not None else H.NULL
    runners = {}
    if graphs:
        runners["extend"] = PiecewiseRunner(model, mk(), memory, token_buckets, hidden)
        if spec is None and graphs_for(backend, ForwardMode.DECODE):
            runners["decode"] = UniformGraphRunner(model, mk(), memory, ForwardMode.DECODE, buckets)
        elif spec is not None and graphs_for(backend, ForwardMode.TARGET_VERIFY):
            runners["verify"] = UniformGraphRunner(model, mk(), memory, ForwardMode.TARGET_VERIFY, buckets,
                                                   spec=spec, capture_hidden_mode=H.FULL)
    return ModelExecutor("target", model, mk(), runners, layer_names=dict(zip(layers, backend)))


def draft_executor(model, memory: KVMemory, backend: str, cfg, *, buckets, token_buckets, graphs: bool,
                   topk: int, num_steps: int, num_draft_tokens: int) -> ModelExecutor:
    """EXTEND (the prompt, embeddings fused with the target's features) on the piecewise runner,
    DRAFT_EXTEND at width N, and ``num_steps - 1`` draft-decode forwards in one graph. The draft's
    layers (pool layers after the target's) chosen per layer as the target's are."""
    modes = {ForwardMode.EXTEND: 1, ForwardMode.DRAFT_EXTEND: 1, ForwardMode.DECODE: topk}
    layers = range(cfg.num_layers - len(model.layers), cfg.num_layers)
    backend = layer_backend_names(backend, cfg, layers, memory.device.type, modes)
    mk = lambda: layer_backends(backend, cfg, memory, layers)  # noqa: E731
    n = num_draft_tokens
    runners, multi = {}, None
    if graphs:
        runners["extend"] = PiecewiseRunner(model, mk(), memory, token_buckets)
        if graphs_for(backend, ForwardMode.DRAFT_EXTEND):
            runners["draft_extend"] = DraftExtendRunner(model, mk(), memory, ForwardMode.DRAFT_EXTEND, buckets,
                                                        spec=SpecInfo(n, 1, n - 1))
    if num_steps > 1:   # built without graphs too: its run_eager is the eager path of draft decode
        multi = MultiStepDraftRunner(model, [mk() for _ in range(num_steps - 1)], memory, topk, num_steps - 1,
                                     buckets)
        if graphs and graphs_for(backend, ForwardMode.DECODE):
            runners["draft_decode"] = multi
    return ModelExecutor("draft", model, mk(), runners, multi, layer_names=dict(zip(layers, backend)))
