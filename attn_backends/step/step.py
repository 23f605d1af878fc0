"""The step: the canonical layout of one forward step, built once and read by every layer and
every backend of the step through a frozen :class:`~attn_backends.step.view.StepView`.

A step runs L layers, each through a backend instance (per-layer instances, or different
backends per layer). They all attend over the same batch, so the canonical layout
(:mod:`attn_backends.layout`) is built once per step, here, and each backend derives only its
private metadata from the view it is handed.

Eager: :meth:`Step.build` builds the layout of a batch (fresh tensors) and returns the batch with
``batch.step`` set to the view; every backend's ``init_forward_metadata`` reads it.

Graphs: the step owns everything of the batch that a captured graph reads:

- the inputs at the largest size: ``req_pool_indices``, ``seq_lens`` (and the host copy
  ``seq_lens_cpu``), ``tree_mask``, ``accept_lens`` and, for runners, ``tokens`` (input ids,
  positions, out_cache_loc);
- ``raw_bs`` and ``draft_step`` as device scalars;
- the static buffers of the canonical layout (:class:`LayoutBuffers`), each GraphKey's views;
- one *prep* per GraphKey: the pad rule written into the input rows ``raw_bs..bs-1`` in place
  (:func:`layout.write_canonical_pad`), then the layout built into the key's views
  (:func:`layout.prep_layout`: one kernel on CUDA for the uniform modes without a tree mask).
  Where it runs is the step's :class:`Prep`, set once by its runner: in the step's own graph, or
  as a graph of its own replayed by :meth:`Step.update`.

A runner writes only the real rows of the inputs (:meth:`Step.load_rows`; a multi-step draft:
:class:`~attn_backends.step.group.StepGroup`) and calls :meth:`Step.update` once per replay: a host
check of ``seq_lens_cpu``, the prep where it runs there, and a new view; no allocation, no host
sync. A caller without a runner goes through :class:`~attn_backends.step.standalone.StandaloneStep`,
which does the runner's part with the same calls. Without CUDA the prep "graph" is the same
function run eagerly.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from .. import layout as _layout
from ..batch import ForwardBatch, ForwardMode, GraphInputs, GraphKey, SpecInfo, query_width
from ..graph_gc import collector_off
from ..layout import (
    I32,
    Layout,
    LayoutInputs,
    MaskKind,
    build_layout,
    inputs_from_batch,
    mask_kind,
    pad_seq_len,
    prep_layout,
)
from ..validation import LayoutError, check_lengths, validate
from .buffers import LayoutBuffers, RowCopies
from .view import Prep, StepView, built_from

I64 = torch.int64
_STEP_ID = StepView._fields.index("step_id")
_IDS = itertools.count(1)          # step ids and step origins, never reused in the process
_new_view = tuple.__new__          # a StepView from its fields at the cost of a tuple (the replay's hot path)



@dataclass
class _Captured:
    key: GraphKey
    spec: Optional[SpecInfo]      # the template: N, topk, steps, draft step (tensors are the step's)
    layout: Layout                # views of the static buffers
    graph: object = None          # the prep graph on CUDA; None: run the prep function itself
    need: int = 1                 # the least seq_len of a real row (W, or W * draft_step)
    pad: int = 1                  # the seq_len of a pad row
    views: dict = field(default_factory=dict)   # raw_bs -> the template view's fields before and after the step id


class Step:
    """The canonical layout of each step, built once for every layer and backend.

    Parameters
    ----------
    memory : KVMemory
        The KV memory the step reads (``req_to_token``, page size, pool size).
    fill : int
        The pad rows' seq_len before raising it to W (the largest fill value of the step's
        backends); see :func:`layout.pad_seq_len`.
    max_bs, max_width : int
        Graph mode: the largest bucket and query width W; 0 for an eager-only step.
    tokens : bool
        Graph mode: also own the runner's token inputs ``tokens [3, max_bs*max_width]`` int64
        (input ids, positions, out_cache_loc), padded by the prep like the rest.
    prep : Prep
        Where the prep of a graph step runs (:func:`~attn_backends.step.view.prep_placement` of
        the step's backends); fixed for the step's life.
    """

    def __init__(self, memory, fill: int = 1, *, max_bs: int = 0, max_width: int = 1, tokens: bool = False,
                 prep: Prep = Prep.BEFORE_UPDATE) -> None:
        self.memory, self.fill, self.prep = memory, fill, prep
        self._in_graph = prep is Prep.IN_STEP_GRAPH       # read on every update
        self.max_bs, self.max_width = max_bs, max_width
        self.builds = 0                           # layouts built (eager), captures and updates (graph)
        self.step_id = 0                          # new (process-wide) at every build, capture, update
        self.origin = next(_IDS)                  # StepView.origin: this step, never another's
        self.cache: dict = {}                     # library state, kept as long as the step (StepView.cache)
        self._captured: dict[GraphKey, _Captured] = {}
        self._pool = None
        if max_bs:
            self._allocate(tokens)

    # ------------------------------------------------------------------ eager
    def build(self, batch: ForwardBatch) -> ForwardBatch:
        """Build ``batch``'s layout once for the step; returns the batch with ``step`` set to the
        view, which the step's backends and layers then receive."""
        layout = build_layout(inputs_from_batch(batch, self.memory, self.fill))
        self.builds += 1
        self.step_id = next(_IDS)
        view = StepView(None, batch.raw_bs, layout, batch.seq_lens_cpu, batch.extend_seq_lens_cpu, batch.spec_info,
                        self.step_id, self.fill, self.memory, self.cache, self.origin, self.prep, {},
                        built_from(batch))
        return dataclasses.replace(batch, step=view)

    # ------------------------------------------------------------------ graphs
    def _allocate(self, tokens: bool) -> None:
        m, bs, w = self.memory, self.max_bs, self.max_width
        dev = m.device
        self.buffers = LayoutBuffers(bs, w, m.max_context_len, m.page_size, dev)
        pad = pad_seq_len(self.fill, w)
        self.requests = torch.zeros(2, bs, dtype=I32, device=dev)     # request rows, seq_lens
        self.req_pool_indices, self.seq_lens = self.requests.unbind(0)
        self.seq_lens.fill_(pad)
        self.seq_lens_cpu = torch.full((bs,), pad, dtype=I32)
        self.accept_lens = torch.ones(bs, dtype=I32, device=dev)
        self.tree_flat = torch.tril(torch.ones(w, w, dtype=torch.bool, device=dev)).repeat(bs, 1, 1).reshape(-1)
        self.raw_bs_dev = torch.zeros(1, dtype=I32, device=dev)
        self.draft_step_dev = torch.zeros(1, dtype=I32, device=dev)
        self.tokens = torch.zeros(3, bs * w, dtype=I64, device=dev) if tokens else None
        self.input_ids, self.positions, self.out_cache_loc = self.tokens.unbind(0) if tokens else (None,) * 3
        self._seq_np = self.seq_lens_cpu.numpy()                 # the host copy, written without dispatch
        self._copies = RowCopies(self.req_pool_indices, self.seq_lens, self.raw_bs_dev, self.draft_step_dev,
                                 self.tokens, w)
        self._loaded = None                       # (key, raw_bs, draft_step) the last load_rows wrote
        self._tensors = self.tensors()
        if dev.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()

    def tree_mask(self, bs: int, width: int) -> torch.Tensor:
        """``[bs, W, W]`` bool view of the tree-mask input (contiguous per key)."""
        return self.tree_flat[:bs * width * width].view(bs, width, width)

    def spec_view(self, key: GraphKey, spec: Optional[SpecInfo]) -> Optional[SpecInfo]:
        """``spec`` with its tensors replaced by the step's own (what a graph of ``key`` reads)."""
        if spec is None:
            return None
        tree = mask_kind(key.forward_mode, spec) == MaskKind.TREE
        return SpecInfo(spec.num_draft_tokens, spec.topk, spec.num_steps,
                        accept_lens=self.accept_lens[:key.bs] if key.forward_mode == ForwardMode.DRAFT_EXTEND else None,
                        tree_mask=self.tree_mask(key.bs, key.width) if tree else None, draft_step=spec.draft_step)

    def graph_inputs(self, key: GraphKey, view: StepView) -> GraphInputs:
        """The step's own inputs for ``key``, as the step's backends receive them with ``view``
        (what :meth:`capture` or :meth:`update` returned)."""
        bs = key.bs
        return GraphInputs(key, self.req_pool_indices[:bs], self.seq_lens[:bs], self.seq_lens_cpu[:bs], view.spec,
                           view.raw_bs, view)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a captured graph reads through the step (for I2 and poisoning)."""
        if not self.max_bs:
            return {}
        out = {f"step.{k}": v for k, v in self.buffers.tensors().items()}
        out.update({"step.requests": self.requests, "step.accept_lens": self.accept_lens,
                    "step.tree_mask": self.tree_flat, "step.raw_bs": self.raw_bs_dev,
                    "step.draft_step": self.draft_step_dev})
        if self.tokens is not None:
            out["step.tokens"] = self.tokens
        return out

    def load(self, inputs: GraphInputs, capture: bool = False) -> None:
        """Copy a caller's real rows into the step's inputs (what a runner does itself), after
        validating them (device values too at capture, outside a stream capture: they sync);
        nothing is written if they are refused."""
        key, spec = inputs.key, inputs.spec_info
        self._check_capacity(key)
        self._check_key(key, spec, capture)
        validate(self._inputs_of(inputs, check_device=capture and not _layout.stream_capturing()))
        accept = spec.accept_lens if spec is not None and key.forward_mode == ForwardMode.DRAFT_EXTEND else None
        tree = spec.tree_mask if spec is not None and mask_kind(key.forward_mode, spec) == MaskKind.TREE else None
        self._write_rows(key, inputs.raw_bs, inputs.req_pool_indices, inputs.seq_lens, inputs.seq_lens_cpu.numpy()
                         [:inputs.raw_bs], None, accept, tree, spec.draft_step if spec is not None else 0)

    def capture_inputs(self, inputs: GraphInputs) -> StepView:
        """:meth:`load` a caller's capture batch, then :meth:`capture` its key."""
        self.load(inputs, capture=True)
        return self.capture(inputs.key, inputs.spec_info, inputs.raw_bs)

    def update_inputs(self, inputs: GraphInputs) -> StepView:
        """:meth:`load` a caller's replay batch, then :meth:`update` its key."""
        spec = inputs.spec_info
        self.load(inputs)
        return self.update(inputs.key, inputs.raw_bs, spec.draft_step if spec is not None else None)

    def load_rows(self, key: GraphKey, raw_bs: int, req_pool_indices, seq_lens, seq_lens_cpu, tokens=None,
                  accept_lens=None, tree_mask=None, draft_step: Optional[int] = None) -> None:
        """Copy the real rows of a batch into the step's inputs: request rows, seq_lens, ``raw_bs``,
        the draft step (default: the captured one) and the ``tokens`` (``[input_ids, positions,
        out_cache_loc]``, ``raw_bs * W`` rows each; None entries are left alone) in one launch
        (:class:`RowCopies`; token sources that are not contiguous int64 take a second, the accept
        lengths and the tree mask one each), then the host ``seq_lens_cpu``. Sources longer than
        the real rows are cut. The host lengths are checked first: a refused batch writes nothing."""
        seq_np, draft_step = self.checked_rows(key, raw_bs, seq_lens_cpu.numpy()[:raw_bs], draft_step)
        self._write_rows(key, raw_bs, req_pool_indices, seq_lens, seq_np, tokens, accept_lens, tree_mask, draft_step)

    def checked_rows(self, key: GraphKey, raw_bs: int, seq_np, draft_step: Optional[int] = None) -> tuple:
        """The host checks of :meth:`load_rows`; returns ``(seq_np, draft_step)``."""
        entry = self._captured.get(key) or self.captured(key)
        if not 1 <= raw_bs <= key.bs:
            raise LayoutError(f"raw_bs={raw_bs} outside 1..bs={key.bs}")
        spec = entry.spec
        if draft_step is None:
            draft_step = spec.draft_step if spec is not None else 0
        elif spec is not None and spec.is_draft_decode and draft_step != spec.draft_step:
            spec = dataclasses.replace(spec, draft_step=draft_step)
        check_lengths(key.forward_mode, spec, seq_np.tolist(), self.memory.max_context_len,
                      entry.need if spec is entry.spec else None)
        return seq_np, draft_step

    def row_copies(self, key: GraphKey, raw_bs: int, req_pool_indices, seq_lens, draft_step: int, tokens) -> tuple:
        """The copies of :meth:`load_rows` without launching them (``RowCopies.pairs``), for a
        :class:`~attn_backends.step.group.StepGroup` to join its steps' into one launch."""
        return self._copies.pairs(raw_bs, raw_bs * key.width, req_pool_indices, seq_lens, draft_step, tokens)

    def rows_written(self, key: GraphKey, raw_bs: int, seq_np, draft_step: int) -> None:
        """Record rows that :meth:`row_copies` copied (launched by the caller): the host lengths."""
        self._seq_np[:raw_bs] = seq_np
        self._loaded = (key, raw_bs, draft_step)

    def _write_rows(self, key, raw_bs, req_pool_indices, seq_lens, seq_np, tokens, accept_lens, tree_mask,
                    draft_step: int) -> None:
        self._copies.write(raw_bs, raw_bs * key.width, req_pool_indices, seq_lens, draft_step, tokens)
        if accept_lens is not None:
            self.accept_lens[:raw_bs].copy_(accept_lens[:raw_bs])
        if tree_mask is not None:
            self.tree_mask(key.bs, key.width)[:raw_bs].copy_(tree_mask[:raw_bs])
        self._seq_np[:raw_bs] = seq_np                    # rows_written, inline: the replay's hot path
        self._loaded = (key, raw_bs, draft_step)

    def capture(self, key: GraphKey, spec: Optional[SpecInfo], raw_bs: int) -> StepView:
        """Bind the static views of ``key``, build the layout of the inputs the step holds (the
        capture batch, validated like any replay batch: I13) and, on CUDA, capture the prep graph
        (unless the prep runs in the step's graph). A refused batch changes nothing."""
        self._check_capacity(key)
        self._check_key(key, spec, capture=True)
        step = spec.draft_step if spec is not None and spec.is_draft_decode else 1
        entry = _Captured(key, spec, None, need=key.width * step, pad=pad_seq_len(self.fill, key.width))
        validate(self._inputs(entry, raw_bs, check_device=not _layout.stream_capturing()))
        old = self._captured.get(key)
        entry.layout = old.layout if old is not None else self.buffers.views(
            key.forward_mode, key.bs, key.width, mask_kind(key.forward_mode, spec), self.memory.max_context_len)
        self.raw_bs_dev.fill_(raw_bs)
        self.draft_step_dev.fill_(spec.draft_step if spec is not None else 0)
        self._seq_np[raw_bs:key.bs] = entry.pad           # host copy canonical too, as update() leaves it
        self._prep(entry)
        self.builds += 1
        if self.prep is Prep.BEFORE_UPDATE and self._pool is not None and not _layout.stream_capturing():
            entry.graph = _capture(lambda: self._prep(entry), self._pool)
        elif old is not None:
            entry.graph = old.graph          # same views, same inputs: its prep graph still holds
        self._captured[key] = entry
        return self._view(entry, raw_bs)

    def update(self, key: GraphKey, raw_bs: int, draft_step: Optional[int] = None) -> StepView:
        """Replay preparation of one step: pad rows ``raw_bs..bs-1`` of the inputs and build the
        layout of ``key`` into its views (where :attr:`prep` says: here, or when the step's graph
        replays). Host checks on ``seq_lens_cpu`` only; no host sync. After :meth:`load_rows` of
        the same ``raw_bs`` this is one graph replay at most (the hot path of every runner: kept to
        a few attribute reads besides the replay). Returns the step's new view."""
        entry = self._captured.get(key) or self.captured(key)
        spec = entry.spec
        if not 1 <= raw_bs <= key.bs:
            raise LayoutError(f"raw_bs={raw_bs} outside 1..bs={key.bs}")
        if draft_step is not None and spec is not None and spec.is_draft_decode and draft_step != spec.draft_step:
            spec = dataclasses.replace(spec, draft_step=draft_step)
        step = spec.draft_step if spec is not None else 0
        loaded = self._loaded                             # load_rows of the same rows checked and wrote them
        if loaded is None or loaded[0] is not key or loaded[1:] != (raw_bs, step):
            check_lengths(key.forward_mode, spec, self._seq_np[:raw_bs].tolist(), self.memory.max_context_len,
                          entry.need if spec is entry.spec else None)
            self.raw_bs_dev.fill_(raw_bs)
            self.draft_step_dev.fill_(step)
        self._loaded = None
        self._seq_np[raw_bs:key.bs] = entry.pad
        self.builds += 1
        if self._in_graph:                                # the step's own graph builds the layout
            pass
        elif entry.graph is not None:
            entry.graph.replay()
        else:
            self._prep(entry)
        if spec is entry.spec:
            held = entry.views.get(raw_bs)
            if held is not None:                          # the template's fields around a new step id: one tuple
                self.step_id = sid = next(_IDS)
                return _new_view(StepView, held[0] + (sid,) + held[1])
            return self._view(entry, raw_bs)
        return self._view(entry, raw_bs, self.spec_view(key, spec))

    def run_prep(self, key: GraphKey) -> None:
        """The prep of ``key`` (pad rows, then the layout), for a runner whose step's graph holds
        it (:attr:`prep` ``IN_STEP_GRAPH``) to record at the start of that graph."""
        self._prep(self.captured(key))

    def captured_keys(self) -> list:
        return list(self._captured)

    def captured(self, key: GraphKey) -> _Captured:
        entry = self._captured.get(key)
        if entry is None:
            have = ", ".join(sorted(map(str, self._captured))) or "none"
            raise LayoutError(f"the step has no capture for {key}; captured: {have}")
        return entry

    # ------------------------------------------------------------------ internals
    def _view(self, entry: _Captured, raw_bs: int, spec: Optional[SpecInfo] = None) -> StepView:
        """A new view of ``entry`` (``spec``: a draft step other than the template's)."""
        self.step_id = next(_IDS)
        key = entry.key
        view = StepView(key, raw_bs, entry.layout, self.seq_lens_cpu[:key.bs], None,
                        self.spec_view(key, entry.spec) if spec is None else spec, self.step_id, self.fill,
                        self.memory, self.cache, self.origin, self.prep, self._tensors)
        if spec is None:
            entry.views[raw_bs] = (view[:_STEP_ID], view[_STEP_ID + 1:])
        return view

    def _check_capacity(self, key: GraphKey) -> None:
        if not self.max_bs:
            raise LayoutError("this step is eager-only (max_bs=0): no graph buffers")
        self.buffers.check_capacity(key.bs, key.width)

    def _check_key(self, key: GraphKey, spec: Optional[SpecInfo], capture: bool) -> None:
        """Host checks of a key against its spec (and, for a capture, against the key's earlier
        capture, whose static views it reuses), before anything is written."""
        w = query_width(key.forward_mode, spec)
        if w != key.width:
            raise LayoutError(f"GraphKey width W={key.width} but the spec gives W={w}")
        old = self._captured.get(key)
        if capture and old is not None and old.layout.mask != mask_kind(key.forward_mode, spec):
            raise LayoutError(f"{key} was captured with a {old.layout.mask.value} mask; a "
                              f"{mask_kind(key.forward_mode, spec).value} capture needs a key of its own")

    def _inputs_of(self, inputs: GraphInputs, check_device: bool) -> LayoutInputs:
        """Builder inputs over a caller's tensors (validation before :meth:`load`)."""
        m = self.memory
        return LayoutInputs(inputs.key.forward_mode, inputs.req_pool_indices, inputs.seq_lens, inputs.seq_lens_cpu,
                            inputs.raw_bs, inputs.spec_info, m.req_to_token, m.page_size, m.num_slots,
                            pad_seq_len(self.fill, inputs.key.width), static=True, check_device_values=check_device)

    def _inputs(self, entry: _Captured, raw_bs: int = 0, check_device: bool = False) -> LayoutInputs:
        """Builder inputs over the step's own tensors; ``raw_bs`` 0: read it from the device."""
        key, m = entry.key, self.memory
        bs = key.bs
        spec = self.spec_view(key, entry.spec)
        draft = spec is not None and spec.is_draft_decode
        return LayoutInputs(key.forward_mode, self.req_pool_indices[:bs], self.seq_lens[:bs], self.seq_lens_cpu[:bs],
                            raw_bs or bs, spec, m.req_to_token, m.page_size, m.num_slots,
                            pad_seq_len(self.fill, key.width), static=True, check_device_values=check_device,
                            validated=not raw_bs, raw_bs_dev=None if raw_bs else self.raw_bs_dev,
                            draft_step_dev=self.draft_step_dev if draft and not raw_bs else None)

    def _prep(self, entry: _Captured) -> None:
        """What the prep graph holds: canonical pad rows in the inputs, then the layout."""
        inp = self._inputs(entry)
        tok = None if self.tokens is None else self.tokens[:, :entry.key.bs * entry.key.width]
        prep_layout(inp, entry.key.width, tok, entry.layout, max_bs=self.max_bs, max_width=self.max_width)


def _capture(fn, pool) -> torch.cuda.CUDAGraph:
    """``fn`` captured as a CUDA graph (after one warm-up run: Triton compiles outside capture)."""
    fn()
    g = torch.cuda.CUDAGraph()
    with collector_off(), torch.cuda.graph(g, pool=pool):
        fn()
    g.replay()                       # capture records, it does not run
    return g
