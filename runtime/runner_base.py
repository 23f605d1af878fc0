"""What every graph runner shares: buckets (captured largest first into one memory pool),
``can_run`` guards, replay counting and output slicing (clones: a replay never aliases an
earlier result). The static inputs and their padding belong to the step
(:class:`attn_backends.step.Step`): a runner writes only the real rows of a batch, updates the
step once per replay and hands its backends the view the update returns."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

import torch

from attn_backends import CaptureHiddenMode, ForwardBatch
from attn_backends.step import Prep, Step, eager_steps_of, fill_of, prep_placement

from .graphs import make_graph


class RunnerRefusal(ValueError):
    """The runner cannot run this batch; the message names the value and the limit."""


@dataclass
class RunnerOutput:
    logits: torch.Tensor                        # [raw rows, vocab]
    hidden: Optional[torch.Tensor] = None       # per CaptureHiddenMode, raw rows only
    input_embeds: Optional[torch.Tensor] = None # piecewise: the embeddings it was given
    rows: Optional[torch.Tensor] = None         # rows kept (draft extend: selected by accept length)
    scores: Optional[torch.Tensor] = None       # draft decode: [raw_bs, steps, topk] log-prob of each greedy token


def slice_hidden(hidden: torch.Tensor, mode: CaptureHiddenMode, n_rows: int, width: int,
                 valid: Optional[torch.Tensor] = None):
    """The hidden states a forward returns, by one rule for every runner and the eager path:
    NULL none, LAST the last valid row of each raw request, FULL every valid row of each raw
    request, in order (a clone: never a view of a graph output).

    ``hidden`` holds the rows of the raw requests first (``n_rows`` of them). Uniform modes:
    request ``i`` owns rows ``i*width ..`` and all ``width`` are valid unless ``valid`` ([raw]
    int, device) says how many are (DRAFT_EXTEND: the accept lengths; FULL then syncs once, its
    row count being data-dependent). ``width`` 0: ragged packed rows (EXTEND), ``valid`` ([raw]
    int, host) the length of each request.
    """
    if mode == CaptureHiddenMode.NULL:
        return None
    if width == 0:
        if mode == CaptureHiddenMode.LAST:
            return hidden[(valid.to(torch.int64).cumsum(0) - 1).to(hidden.device)]
        return hidden[:n_rows].clone()
    if valid is None:
        return (hidden[width - 1:n_rows:width] if mode == CaptureHiddenMode.LAST else hidden[:n_rows]).clone()
    raw = n_rows // width
    valid = valid[:raw].to(device=hidden.device, dtype=torch.int64)
    if mode == CaptureHiddenMode.LAST:
        return hidden[torch.arange(raw, device=hidden.device) * width + valid - 1]
    keep = torch.arange(width, device=hidden.device)[None, :] < valid[:, None]          # [raw, W]
    return hidden[:n_rows].reshape(raw, width, -1)[keep]


INT_DTYPES = (torch.int32, torch.int64)


def tensor_refusal(name: str, t, rows: int, device_type: str, dtypes=INT_DTYPES) -> Optional[str]:
    """Why a batch input cannot be copied into a runner's static rows (host checks only: no
    sync); None when it can. ``rows``: the least leading size it must have."""
    if t is not None and t.dtype in dtypes and t.is_cuda == (device_type == "cuda") and t.dim() \
            and t.shape[0] >= rows and (t.is_cuda or t.is_cpu):     # the replay's fast path: ~0.6 us
        return None
    if t is None:
        return f"{name} is None"
    if t.dtype not in dtypes:
        return f"{name} has dtype {t.dtype}, expected {' or '.join(str(d)[6:] for d in dtypes)}"
    if t.device.type != device_type:
        return f"{name} is on {t.device}, expected {device_type}"
    if t.dim() == 0 or t.shape[0] < rows:
        return f"{name} has shape {tuple(t.shape)}, expected at least {rows} rows"
    return None


class GraphRunnerBase:
    """Subclasses define the static batch, the captured function and the output slicing."""

    def __init__(self, model, backends, memory, buckets, capture_hidden_mode=CaptureHiddenMode.NULL) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets={buckets}: need at least one bucket >= 1")
        self.model, self.memory = model, memory
        self.layer_backends = model.backends_per_layer(backends)
        self.backends = list({id(b): b for b in self.layer_backends}.values())  # I12: each refreshed once
        self.buckets = sorted(set(buckets))
        self.capture_hidden_mode = capture_hidden_mode
        self.device = memory.device
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.graphs: dict = {}          # key -> (graph, static outputs, static batch)
        self.replay_count = 0
        self.fill = fill_of(self.backends)
        self.prep = prep_placement(self.backends)       # where the steps' layout prep runs, for good

    @property
    def max_bs(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, n: int) -> int:
        i = bisect.bisect_left(self.buckets, n)
        if i == len(self.buckets):
            raise RunnerRefusal(f"bs={n} exceeds the largest captured bucket {self.max_bs}")
        return self.buckets[i]

    def refusal(self, batch: ForwardBatch) -> Optional[str]:
        """Why this runner cannot replay ``batch`` (None: it can). Subclasses add guards."""
        if not self.graphs:
            return "nothing captured yet: call capture() first"
        if batch.input_embeds is not None and not getattr(self, "accepts_input_embeds", False):
            return "input embeddings override the embedding lookup, which the graph captured"
        if batch.capture_hidden_mode > self.capture_hidden_mode:
            return (f"hidden mode {batch.capture_hidden_mode.name} exceeds the captured "
                    f"{self.capture_hidden_mode.name}")
        return None

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.refusal(batch) is None

    def capture(self) -> None:
        for bucket in reversed(self.buckets):  # largest first: smaller graphs reuse its pool blocks
            key, static_batch = self._static_batch(bucket)
            self._capture_metadata(key, static_batch)
            graph = make_graph(self.device, self.pool, segmented=self.segmented)
            out = graph.capture(lambda sb=static_batch, key=key: self._step(key, sb))
            self.graphs[key] = (graph, out, static_batch)

    segmented = False

    def _step(self, key, static_batch):
        """What a captured graph holds: the steps' layout prep where it runs in the step's graph
        (``Prep.IN_STEP_GRAPH``: one launch per step instead of two), then the forward."""
        for step in self._steps():
            if step.prep is Prep.IN_STEP_GRAPH:
                step.run_prep(key)
        return self._forward(static_batch)

    def _steps(self) -> list:
        """The steps whose inputs the captured graphs read (one per forward of a step)."""
        return []

    def run(self, batch) -> RunnerOutput:
        """Replay ``batch``; raises :class:`RunnerRefusal` for a batch it cannot run."""
        self._refuse(batch)
        return self._run(batch)

    def try_run(self, batch) -> Optional[RunnerOutput]:
        """``run(batch)`` where the runner can run it, else None: one refusal check per step
        where ``can_run`` then ``run`` makes two."""
        return None if self.refusal(batch) else self._run(batch)

    def prepare(self, batch):
        """Replay preparation of one step: the batch's real rows into the step's inputs, one
        step update (padding and the layout of every layer), every backend's update. Returns
        ``(key, static batch)``; raises :class:`RunnerRefusal` for a batch it cannot run."""
        self._refuse(batch)
        return self._prepare(batch)

    def _refuse(self, batch) -> None:
        reason = self.refusal(batch)
        if reason:
            raise RunnerRefusal(f"{type(self).__name__} cannot run this batch: {reason}")

    def _prepare(self, batch):
        key, static_batch, raw = self._load(batch)
        self._prepare_replay(key, raw)
        return key, static_batch

    def _run(self, batch) -> RunnerOutput:
        """The replay of a batch the runner can run (refusal already checked)."""
        key, static_batch = self._prepare(batch)
        graph, out, _ = self.graphs[key]
        graph.replay()
        self.replay_count += 1
        return self._slice(out, batch, static_batch)

    # subclass hooks
    def _static_batch(self, bucket: int):
        """``(key, static batch)`` over the step's inputs, holding a valid capture batch."""
        raise NotImplementedError

    def _capture_metadata(self, key, static_batch) -> None:
        raise NotImplementedError

    def _prepare_replay(self, key, raw_bs: int) -> None:
        """Update the step(s) for ``raw_bs`` real rows and hand every backend the new view."""
        raise NotImplementedError

    def _forward(self, static_batch):
        raise NotImplementedError

    def _load(self, batch):
        """Write the batch's real rows into the step's inputs; returns ``(key, static batch, raw_bs)``."""
        raise NotImplementedError

    def _slice(self, out, batch, static_batch) -> RunnerOutput:
        raise NotImplementedError


def run_eager(model, backends, batch: ForwardBatch, width: int, step: Optional[Step] = None) -> RunnerOutput:
    """The reference path: one eager step (``step``, kept by the caller across batches with its
    library state, or a new one), eager metadata on every backend, one model forward, raw rows."""
    per_layer = model.backends_per_layer(backends)
    batch = (step or eager_steps_of(per_layer)).build(batch)
    for b in {id(b): b for b in per_layer}.values():
        b.init_forward_metadata(batch)
    logits, hidden = model.forward(batch, backends, batch.input_embeds)
    if width:
        n = batch.raw_bs * width
        return RunnerOutput(logits[:n].clone(), slice_hidden(hidden, batch.capture_hidden_mode, n, width))
    lens = batch.extend_seq_lens_cpu[:batch.raw_bs].to(torch.int64)    # EXTEND: ragged rows
    n = int(lens.sum())
    return RunnerOutput(logits[:n].clone(), slice_hidden(hidden, batch.capture_hidden_mode, n, 0, lens))
