"""What the FlashInfer backends (``flashinfer``, ``flashinfer_mla``) share.

* The lazy import: the package imports without flashinfer; constructing a backend raises an
  ImportError naming the extra (``pip install 'attn-backends[flashinfer]'``).
* One zeroed float workspace per KV memory, shared by every wrapper over it (their runs never
  overlap).
* :class:`HostPlan`: the host copies a FlashInfer ``plan()`` reads (``qo_indptr``,
  ``kv_indptr``, ``kv_last_page_len``, KV lengths), derived from the step's ``seq_lens_cpu``
  and the GraphKey (graph mode) or the batch's host copies (eager): never read back from the
  device. The device ``kv_indices`` is the step's layout buffer itself (a sliding variant's: the
  step's window layout's, with the host lengths of ``windowed_host_plan``).
* :class:`FlashInferBase`: one FlashInfer plan per step and plan variant (a layer's window, cap,
  sinks: ``_variants``), one run per layer. The wrapper of a (backend class, model config, GraphKey,
  variant) lives in the step's cache (``StepView.cache``) so every
  layer's instance runs the same wrapper; the first instance updated in a step (a new
  ``StepView.step_id``) plans it, the others only run. Graph mode uses the wrappers'
  ``use_cuda_graph=True`` form reading the step layout's own device tensors (``kv_indptr``,
  ``kv_indices``, ...), which the step's prep rewrites before every replay.
* The light replay plan (SGLang's ``fast_decode_plan`` idea): capture runs FlashInfer's full
  ``plan()`` once per key; every replay after it only reruns the host scheduler
  (``_cached_module.plan``) on this step's host lengths. What it skips is work whose result
  cannot change within a key: host-to-device copies into buffers the prep already wrote, the
  device copy of ``kv_indices`` onto itself, module look-ups, and argument checks of values
  fixed per key (batch size, dtypes, heads, page size).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import numpy as np
import torch

from ..base import ForwardMetadata, LayoutBackend
from ..batch import GraphKey
from ..layout import Layout, host_seq_lens, pad_seq_len
from ..step import LibraryKey, StepView
from ..window_layout import step_window_layout, window_skip_host

EXTRA = "pip install 'attn-backends[flashinfer]'"
WORKSPACE_BYTES = 256 << 20          # float workspace (split-KV partials), one per KV memory
I32 = torch.int32
WINDOW_FIELDS = ("seq_lens_k", "prefix_lens", "page_table", "kv_indptr", "kv_indices", "draft_prefix_lens")
EAGER_CALLS_KEPT = 16                # eager wrappers a step keeps (one per kind and, uniform, per (bs, W))


def import_flashinfer():
    """``flashinfer``, or an ImportError that names the extra to install."""
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError(f"the FlashInfer backends need the flashinfer package ({EXTRA}): {e}") from e
    return flashinfer


def float_workspace(memory, tag: str = "fa") -> torch.Tensor:
    """A zeroed ``WORKSPACE_BYTES`` uint8 buffer per (KV memory, tag), allocated on first use
    (FlashInfer: "must be initialized to 0 for its first use"); kept with the memory."""
    held = memory.library_buffers
    ws = held.get(tag)
    if ws is None:
        ws = held[tag] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=memory.device)
    return ws


@dataclass(frozen=True)
class HostPlan:
    """Host copies (CPU int32 tensors) of one step's plan inputs, for ``bs`` requests."""

    qo_indptr: torch.Tensor          # [bs+1] query rows
    kv_indptr: torch.Tensor          # [bs+1] pages: cumsum(ceil(kv_len / page_size))
    kv_last_page_len: torch.Tensor   # [bs] tokens in each row's last page (1..page_size)
    kv_lens: torch.Tensor            # [bs] KV tokens (this forward's included)
    num_pages: int                   # kv_indptr[-1]
    max_kv: int                      # host bound on kv_lens (graph mode: the static bound)
    longest: int = 0                 # max(kv_lens) itself

    @property
    def bs(self) -> int:
        return int(self.kv_lens.shape[0])


def indptr(lens: np.ndarray) -> torch.Tensor:
    """``[0, cumsum(lens)]`` as an int32 tensor (FlashInfer's indptr form)."""
    out = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(lens, out=out[1:])
    return torch.from_numpy(out)


def host_plan(seq: np.ndarray, qo_indptr: torch.Tensor, page_size: int, max_kv: Optional[int] = None) -> HostPlan:
    """The plan inputs of rows with KV lengths ``seq`` (int32 or int64 numpy, owned by the plan)
    and query rows ``qo_indptr``, computed as the layout builder computes them on the device
    (``layout._write_kv``)."""
    npages = (seq + (page_size - 1)) // page_size
    kv_indptr = np.zeros(len(seq) + 1, dtype=np.int32)
    np.cumsum(npages, out=kv_indptr[1:])
    last = (seq - (npages - 1) * page_size).astype(np.int32, copy=False)
    longest = int(seq.max())
    return HostPlan(qo_indptr, torch.from_numpy(kv_indptr), torch.from_numpy(last),
                    torch.from_numpy(seq.astype(np.int32, copy=False)), int(kv_indptr[-1]),
                    longest if max_kv is None else max_kv, longest)


def windowed_host_plan(host: HostPlan, window: int, page_size: int) -> HostPlan:
    """``host`` of the step's window layout for ``window`` (:mod:`attn_backends.window_layout`):
    each row's KV from its first visible page; ``max_kv`` stays the step's bound."""
    seq = host.kv_lens.numpy().astype(np.int64)
    seq = seq - window_skip_host(seq, np.diff(host.qo_indptr.numpy()), window, page_size)
    return host_plan(seq, host.qo_indptr, page_size, max_kv=host.max_kv)


def eager_host_plan(view: StepView) -> HostPlan:
    """Eager: from the step's host copies, with the canonical pad rows (``layout.canonical_rows``:
    ``seq_len = pad_seq_len(fill, W)``, EXTEND pad rows one query token)."""
    layout = view.layout
    w = layout.width or 1
    seq = host_seq_lens(view.seq_lens_cpu, view.raw_bs, pad_seq_len(view.fill, w))
    if layout.width:
        q_lens = np.full(len(seq), layout.width, dtype=np.int64)
    else:
        q_lens = view.extend_seq_lens_cpu.numpy().astype(np.int64)
        q_lens[view.raw_bs:] = 1
    return host_plan(seq, indptr(q_lens), layout.page_size)


def graph_host_plan(view: StepView, key: GraphKey, page_size: int, max_context_len: int,
                    qo_indptr: Optional[torch.Tensor] = None) -> HostPlan:
    """Graph mode: from the step's host ``seq_lens_cpu`` (canonical after ``update()`` and
    ``capture()``: pad rows hold the pad seq_len) and the key; the KV bound is the static
    ``max_context_len``. ``qo_indptr``: the key's ``arange(0, bs*W + 1, W)`` if already made.
    Every replay computes this, so it is ``host_plan`` in int32 (lengths and page counts are
    bounded by the static ``max_context_len`` and the pool) with the query part per key."""
    bs = key.bs
    if qo_indptr is None:
        qo_indptr = torch.arange(0, bs * key.width + 1, key.width, dtype=I32)
    seq = view.seq_lens_cpu[:bs].numpy().astype(np.int32)          # a copy: the step's buffer changes
    return host_plan(seq, qo_indptr, page_size, max_kv=max_context_len)


@dataclass(eq=False)
class Planned:
    """A FlashInfer call object kept in a step's cache, and the step id it was last planned in."""

    call: Any
    step_id: int = -1
    light: bool = False       # planned in full once and bound to the step's layout: replays replan light


@dataclass(eq=False)
class FlashInferMetadata(ForwardMetadata):
    planned: Optional[dict] = None      # variant (``FlashInferBase._variants``) -> Planned
    windows: Optional[dict] = None      # graph keys: window -> the step's window layout its sliding calls read


class FlashInferBase(LayoutBackend):
    """Plans once per step and variant, runs once per layer. Subclasses define :meth:`_new_call` (a
    wrapper and its fixed buffers, for a GraphKey or eager), :meth:`_kind` (which wrapper a layout
    needs) and, with plan-time layer options, :meth:`_variants` / :meth:`_variant`; the call object
    has ``plan(layout, host)``, ``run(q, pages, layer)`` and ``buffers``.
    FlashInfer's ``plan()`` reads the step's device layout (the packed mask, the indices it
    copies), so planning is replay work: the step's prep runs before it (``replay_work``)."""

    def __init__(self, config, memory) -> None:
        super().__init__(config, memory)     # checks the device and dtype against the capabilities
        self.fi = import_flashinfer()
        self._qo: dict = {}            # (bs, W) -> qo_indptr host copy (a function of the key alone)
        self._pages: dict = {}         # layer_id -> (the pool's tensors, their page views): see _kv_pages
        self._sm_scale = config.sm_scale     # the plan's; read per layer call (the property computes it)

    # -- hooks
    eager_as_graph: ClassVar[bool] = True   # uniform eager batches plan like graphs (FlashInfer plans differ)

    def _kind(self, layout: Layout) -> str:
        raise NotImplementedError

    def _variants(self, layout: Layout) -> tuple:
        """The plan variants ``layout``'s step needs, one wrapper each (FlashInfer fixes a
        layer's window, cap and sink variant at ``plan()``); :meth:`_variant` names a layer's."""
        return (None,)

    def _variant(self, layer, layout: Layout):
        return None

    def _window(self, variant, layout: Layout) -> Optional[int]:
        """The sliding window of ``variant``'s layers (None: full attention): their calls read the
        step's window layout (:func:`step_window_layout`), which lists no page before the window."""
        return None

    # The variant of a layer without window, cap or sinks (``AttentionLayer.features`` empty): what
    # :meth:`_variant` gives it, read without the call on every forward of a plain model.
    PLAIN_VARIANT = None

    def _new_call(self, layout: Layout, key: Optional[GraphKey], indices: Optional[torch.Tensor],
                  bound: bool = False, variant=None):
        """The wrapper for ``layout`` and ``variant``: graph form for ``key`` reading the fixed
        ``indices`` buffer, or (``key`` None) the eager form. ``bound``: a graph wrapper of the
        step's own layout, reading its device tensors (``indices`` is ``layout.kv_indices``); a
        call has ``replan(layout, host)``, the light plan of its replays."""
        raise NotImplementedError

    def _kv_pages(self, layer_id: int):
        """The pool of ``layer_id`` as FlashInfer pages (views, no copy), made again only when the
        pool's tensors of the layer are other objects (forward runs per layer: views cost host time)."""
        raise NotImplementedError

    def _metadata(self, view: StepView, key: Optional[GraphKey]) -> FlashInferMetadata:
        lay = view.layout
        if key is None:
            return FlashInferMetadata(view, None, planned={v: self._eager_call(view, v) for v in self._variants(lay)})
        planned, windows = {}, {}
        for v in self._variants(lay):
            w = self._window(v, lay)
            if w is not None and w not in windows:
                windows[w] = step_window_layout(view, w)
            owner = LibraryKey(type(self), self.config, key, repr(v))
            if owner not in view.cache:
                read = lay if w is None else windows[w]
                view.cache[owner] = Planned(self._new_call(read, key, read.kv_indices, bound=True, variant=v))
            planned[v] = view.cache[owner]
        return FlashInferMetadata(view, key, planned=planned, windows=windows)

    def _update(self, meta: FlashInferMetadata, view: StepView) -> None:
        host, windowed = None, {}
        for v, planned in meta.planned.items():
            if planned.step_id != view.step_id:  # one plan per step, whichever layer comes first
                host = host or (eager_host_plan(view) if meta.key is None else self.graph_host_plan(view, meta.key))
                w = self._window(v, view.layout)
                if w is None:
                    self._plan(planned, view, view.layout, host)
                    continue
                if w not in windowed:            # one window layout per step and window, every variant's
                    windowed[w] = (step_window_layout(view, w), windowed_host_plan(host, w, view.layout.page_size))
                self._plan(planned, view, *windowed[w])

    def _plan(self, planned: Planned, view: StepView, layout: Layout, host: HostPlan) -> None:
        call = planned.call
        if planned.light:                        # a replay of a key planned in full at capture
            call.replan(layout, host)
        else:
            call.plan(layout, host)
            planned.light = call.bound and call.light_ok(host)
        planned.step_id = view.step_id           # planned: a plan() that raised is tried again

    def _eager_call(self, view: StepView, variant=None) -> Planned:
        """The call of an eager layout. FlashInfer plans a graph-form wrapper unlike an eager one
        (split-KV always on, other query tiles), so a uniform batch runs the graph form at its
        (bs, W), on a kv_indices buffer of its own: eager and replay then launch the same kernels
        on the same padded batch, bitwise equal. Ragged EXTEND, never captured, runs the eager
        form. Kept in the step's cache (a step kept across batches keeps them), the last
        ``EAGER_CALLS_KEPT``."""
        lay = view.layout
        key = GraphKey(lay.mode, lay.bs, lay.width) if lay.width and self.eager_as_graph else None
        owner = LibraryKey(type(self), (self.config, id(self.memory)), None, "eager calls")
        kept = view.cache.get(owner)
        if kept is None:
            kept = view.cache[owner] = OrderedDict()
        kind = (self._kind(lay), key, variant)
        planned = kept.pop(kind, None)
        if planned is None:
            pages = lay.bs * (self.memory.max_context_len // self.memory.page_size)
            indices = None if key is None else torch.zeros(pages, dtype=I32, device=self.memory.device)
            planned = Planned(self._new_call(lay, key, indices, variant=variant))
        kept[kind] = planned
        while len(kept) > EAGER_CALLS_KEPT:
            kept.popitem(last=False)
        return planned

    def graph_host_plan(self, view: StepView, key: GraphKey) -> HostPlan:
        h = graph_host_plan(view, key, self.memory.page_size, self.memory.max_context_len,
                            self._qo.get((key.bs, key.width)))
        self._qo.setdefault((key.bs, key.width), h.qo_indptr)
        return h

    def _extra_graph_buffers(self) -> dict:
        out = {}
        for (key, _), meta in self._graph_meta.items():
            for planned in meta.planned.values():
                call = planned.call
                tag = f"fi.{key.forward_mode.name}_{key.bs}x{key.width}#{id(call) % 10007}"
                out.update({f"{tag}.{k}": v for k, v in call.buffers.items()})
            for w, lay in (meta.windows or {}).items():     # fixed per key, rewritten every step (I2, poisoning)
                tag = f"fi.{key.forward_mode.name}_{key.bs}x{key.width}.window{w}#{id(lay) % 10007}"
                out.update({f"{tag}.{k}": v for k, v in lay.as_dict().items() if k in WINDOW_FIELDS})
        return out

    def _run(self, q: torch.Tensor, layer, meta: FlashInferMetadata) -> torch.Tensor:
        if layer.scaling != self._sm_scale:
            raise ValueError(f"layer {layer.layer_id} scaling {layer.scaling} != the planned sm_scale "
                             f"{self._sm_scale} (one FlashInfer plan serves every layer of a step)")
        variant = self._variant(layer, meta.layout) if layer.features else self.PLAIN_VARIANT
        planned = meta.planned.get(variant)
        if planned is None:         # a layer record whose window or cap the model's config does not give
            raise ValueError(f"layer {layer.layer_id} needs plan variant {variant}, the step planned "
                             f"{list(meta.planned)} from the model config")
        return planned.call.run(q, self._kv_pages(layer.layer_id), layer)
