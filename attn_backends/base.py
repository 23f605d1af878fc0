"""The backend contract and the layout-driven base most backends share.

A backend is a class with a ``name``, declared ``capabilities`` and the seven methods of
:class:`AttentionBackend`. ``docs/plugin-guide.md`` walks through writing one;
``examples/sdpa_backend`` is a complete, installable one. The invariants ``attn-backends check``
holds every backend to (I1-I16, the legend of its reports) are in ``docs/check.md``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from .batch import ForwardBatch, ForwardMode, GraphInputs, GraphKey
from .capabilities import Capabilities, GraphSupport  # noqa: F401  (re-exported: the contract's names)
from .config import FP8_KV, AttentionLayer, ModelConfig
from .kv_cache import KVMemory
from .layout import Layout, LayoutError
from .step import StandaloneStep, StepView


@dataclass(eq=False)
class ForwardMetadata:
    """What a forward reads: the step's view (its ``layout`` the canonical one) and, in a backend's
    subclass of this record, the backend's own fields. Graph metadata is one record per
    (backend, GraphKey, step), whose ``view`` each replay replaces; eager metadata is made per step.

    Attributes
    ----------
    view : StepView
        The step as the backend was handed it (``view.layout``, ``view.raw_bs``, host lengths).
    key : GraphKey or None
        The graph key (None: eager).
    batch : ForwardBatch or None
        Eager: the batch it was prepared for (``forward`` refuses another).
    """

    view: StepView
    key: Optional[GraphKey] = None
    batch: Optional[ForwardBatch] = None

    @property
    def layout(self) -> Layout:
        return self.view.layout

    def as_layout(self) -> dict:
        return self.view.layout.as_dict()


class AttentionBackend(ABC):
    """The contract every backend implements (subclass :class:`LayoutBackend` to get all but
    ``_run`` from the canonical layout).

    A backend instance serves one model configuration over one KV memory; the runtime may make
    one instance per layer, and several runners may share one. ``name`` is the registry name;
    ``capabilities`` what it declares. ``forward_metadata`` is what the next ``forward`` reads:
    its ``as_layout()`` returns the canonical layout fields (``attn_backends.layout``) that the
    layout-equivalence suite compares, whatever the backend keeps privately.

    Parameters
    ----------
    config : ModelConfig
        The attention shape (heads, head dims, MLA ranks, page size, dtype).
    memory : KVMemory
        The request-to-token table (``memory.req_to_token``, row 0 reserved) and the KV pool
        (``memory.pool``: ``k[layer]``/``v[layer]`` ``[num_slots, Hkv, D]`` for MHA,
        ``kv[layer]`` ``[num_slots, 1, latent + rope]`` for MLA; slot 0 and page 0 reserved).
    """

    capabilities: ClassVar[Capabilities]
    name: ClassVar[str] = "?"

    def __init__(self, config: ModelConfig, memory: KVMemory) -> None:
        self.config = config
        self.memory = memory
        self.forward_metadata: Optional[ForwardMetadata] = None

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Eager path: prepare the metadata of ``batch`` for the ``forward`` calls of this step
        (every layer). May allocate and read host values (``seq_lens_cpu``); with
        ``batch.step`` set (a runner's), the step's layout is already built there."""

    @abstractmethod
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Before any capture: the largest bucket and token count a captured graph will have.
        Allocate what must outlive the captures (static buffers, workspaces) here."""

    @abstractmethod
    def init_forward_metadata_capture_cuda_graph(self, inputs: GraphInputs) -> None:
        """Before capturing the graph of ``inputs.key``: bind the static buffers the graph will
        read and prepare them for the capture batch (which must pass the same validation as
        any replay batch, I13). May sync and allocate; ``inputs.step`` is the view of the
        runner's step (already captured for the key) or None."""

    @abstractmethod
    def init_forward_metadata_replay_cuda_graph(self, inputs: GraphInputs) -> None:
        """Before each replay of ``inputs.key``: rewrite, in place, everything the captured graph
        reads for this batch (rows ``raw_bs..bs-1`` are padding). No host sync, no allocation
        of graph-read tensors (I2, I15): host values come from ``inputs.seq_lens_cpu`` and the key."""

    @abstractmethod
    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """The seq_len the runner gives padding rows before raising it to the query width W."""

    @abstractmethod
    def graph_buffers(self) -> dict[str, torch.Tensor]:
        """Every tensor a captured graph of this backend reads, by name: the suite poisons them
        before replays and checks that their address, shape and dtype never change (I2, I3).
        Kernel state that holds no batch's data and that every launch leaves as it found it (the
        Triton kernels' fused-merge tile counters, zeros between launches) is not listed."""

    @abstractmethod
    def forward(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True):
        """One layer's attention of the prepared batch.

        Parameters
        ----------
        q : Tensor ``[T, H, qk_dim]``; T = bs * W in the uniform modes, the batch's tokens in EXTEND.
        k, v : Tensor ``[T, Hkv, D]`` / ``[T, Hkv, Dv]`` (MLA: ``k [T, 1, latent + rope]``, ``v`` None),
            stored at ``batch.out_cache_loc`` first when ``save_kv_cache``.
        layer : AttentionLayer (layer id, heads, dims, softmax scale).
        Returns ``[T, H, v_dim]`` (MLA: the latent output ``[T, H, kv_lora_rank]``) in q's dtype.
        """


class LayoutBackend(AttentionBackend):
    """Metadata from the step's view (:mod:`attn_backends.step`); subclasses write ``_run`` and may
    keep their own metadata (``_metadata``) and replay work (``_update``).

    Every method has one path: it takes the view of the step (``ForwardBatch.step`` /
    ``GraphInputs.step``, or for a caller without a runner one made by :class:`StandaloneStep`
    from the caller's tensors with the runner's own calls), then builds or refreshes this
    backend's record from it. The layout is built once per step for every layer; capture binds
    the record of the key, replay refreshes it from the new view.
    """

    def __init__(self, config: ModelConfig, memory: KVMemory) -> None:
        super().__init__(config, memory)
        if config.page_size != memory.page_size:
            raise ValueError(f"config page_size={config.page_size} != memory page_size={memory.page_size}")
        caps = self.capabilities
        if memory.device.type not in caps.devices:
            raise ValueError(f"backend {self.name} runs on {', '.join(caps.devices)}; "
                             f"the KV memory is on {memory.device}")
        if config.dtype not in caps.dtypes:
            raise ValueError(f"backend {self.name} runs dtypes {caps.dtypes}, model is {config.dtype}")
        if config.cache_dtype not in (config.dtype, *caps.kv_dtypes):
            raise ValueError(f"backend {self.name} reads KV in {caps.kv_reads()}, not {config.cache_dtype}")
        if config.cache_dtype in FP8_KV:        # select's FP8 rules, for a caller that constructs it directly
            cap = torch.cuda.get_device_capability(memory.device) if memory.device.type == "cuda" else None
            why = caps.fp8_model_refusal(config) or (caps.fp8_gpu_refusal(10 * cap[0] + cap[1]) if cap else None)
            if why:
                raise ValueError(f"backend {self.name}: {why}")
        memory.check_fits(config)
        self._steps = StandaloneStep(memory, self.get_cuda_graph_seq_len_fill_value)
        self._graph_meta: dict[tuple, ForwardMetadata] = {}   # (key, view.origin) -> the key's record
        self._replays = True                              # replay_work, read at init_cuda_graph_state

    @property
    def replay_work(self) -> bool:
        """Whether a replay does work of its own (``_update`` or the replay method overridden):
        then the runner runs the step's layout prep before it (``Prep.BEFORE_UPDATE``), so what it
        derives from the view is the current step's."""
        cls = type(self)
        return cls._update is not LayoutBackend._update or \
            cls.init_forward_metadata_replay_cuda_graph is not LayoutBackend.init_forward_metadata_replay_cuda_graph

    # -- eager
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._check_mode(batch.forward_mode, batch.spec_info)
        view = self._checked_view(self._steps.eager(batch))
        meta = self._metadata(view, None)
        meta.batch = batch
        self._update(meta, view)
        self.forward_metadata = meta

    # -- graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if max_bs < 1 or max_num_tokens < max_bs:
            raise ValueError(f"max_bs={max_bs}, max_num_tokens={max_num_tokens}: need 1 <= max_bs <= max_num_tokens")
        self._steps.reset(max_bs, max(1, max_num_tokens // max_bs))
        self._graph_meta.clear()
        self.forward_metadata = None
        self._replays = self.replay_work

    def init_forward_metadata_capture_cuda_graph(self, inputs: GraphInputs) -> None:
        self._check_mode(inputs.key.forward_mode, inputs.spec_info)
        view = self._checked_view(self._steps.capture(inputs))
        meta = self._metadata(view, view.key)
        self._update(meta, view)                          # capture prepares as a replay does
        self._graph_meta[(view.key, view.origin)] = meta
        self.forward_metadata = meta

    def init_forward_metadata_replay_cuda_graph(self, inputs: GraphInputs) -> None:
        view = self._steps.replay(inputs)
        meta = self.forward_metadata                      # a runner replays one key many times running
        if meta is None or meta.key is not view.key or meta.view.origin != view.origin:
            meta = self._graph_meta.get((view.key, view.origin))
        if meta is None:
            captured = ", ".join(sorted(str(k) for k, _ in self._graph_meta))
            raise LayoutError(f"no graph captured for {view.key} with this step; captured: {captured or 'none'}")
        meta.view = view
        if self._replays:
            self._update(meta, view)
        self.forward_metadata = meta

    def _checked_view(self, view: StepView) -> StepView:
        if view.memory is not self.memory:
            raise LayoutError(f"backend {self.name} reads another KV memory than the step it was given")
        return view

    @property
    def graph_records(self) -> list:
        """This backend's graph metadata records (one per captured key and step)."""
        return list(self._graph_meta.values())

    @property
    def graph_steps(self) -> list:
        """The views (one per step) whose static buffers this backend's captured graphs read."""
        return list({m.view.origin: m.view for m in self._graph_meta.values()}.values())

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def graph_buffers(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, view in enumerate(self.graph_steps):
            out.update({(k if i == 0 else f"{k}#{i}"): v for k, v in view.tensors.items()})
        out.update(self._extra_graph_buffers())
        return out

    # -- hooks for subclasses
    def _metadata(self, view: StepView, key: Optional[GraphKey]) -> ForwardMetadata:
        """This backend's record for ``view`` (graph: of ``key``, kept for every replay; eager:
        ``key`` None), from host values (the key alone in graph mode)."""
        return ForwardMetadata(view, key)

    def _update(self, meta: ForwardMetadata, view: StepView) -> None:
        """Work of each step on the record (eager, capture and every replay), after ``meta.view``
        is ``view``. Overriding it makes the runner build the layout before it (``replay_work``, which a
        subclass may narrow to the instances whose update does work)."""

    def _extra_graph_buffers(self) -> dict[str, torch.Tensor]:
        return {}

    def _check_mode(self, mode: ForwardMode, spec) -> None:
        if mode == ForwardMode.IDLE:
            raise LayoutError("IDLE batches carry no tokens and get no attention metadata")
        caps = self.capabilities
        if mode not in caps.modes:
            raise LayoutError(f"backend {self.name} does not run mode {mode.name}; it runs "
                              f"{sorted(m.name for m in caps.modes)}")
        if spec is not None and spec.topk > 1 and not caps.topk_gt1:
            raise LayoutError(f"backend {self.name} does not support topk={spec.topk} > 1")
        if spec is not None and spec.is_draft_decode and not caps.draft_decode:
            raise LayoutError(f"backend {self.name} does not support draft decode")

    # -- forward
    def forward(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True):
        meta = self.forward_metadata
        if meta is None:
            raise LayoutError("forward() before init_forward_metadata()")
        lay = meta.layout
        if meta.batch is not None and meta.batch is not batch:
            raise LayoutError("forward() got another batch than the one init_forward_metadata() prepared: "
                              "prepare each new batch first (its metadata would be the previous step's)")
        if meta.key is not None and (batch.forward_mode != lay.mode or batch.batch_size != lay.bs):
            raise LayoutError(f"forward() got a {batch.forward_mode.name} batch of bs={batch.batch_size}, the "
                              f"graph metadata was prepared for {lay.mode.name} bs={lay.bs}")
        shape, width = q.shape, lay.width       # q.shape read once: each read costs an eager call time
        if len(shape) != 3 or shape[1] != layer.num_q_heads or shape[2] != layer.qk_dim:
            raise ValueError(f"q has shape {tuple(shape)}, expected [T, {layer.num_q_heads}, {layer.qk_dim}]")
        n = shape[0]
        if width and n != lay.bs * width:
            raise ValueError(f"q has {n} rows, the layout expects bs*W = {lay.bs}*{width} = {lay.bs * width}")
        if not width and n != batch.num_tokens:
            raise ValueError(f"q has {n} rows, the EXTEND batch has {batch.num_tokens} new tokens")
        self._check_layer_and_dtypes(layer, q, k, v, save_kv_cache)
        if save_kv_cache:
            if k is None or int(k.shape[0]) != n or int(batch.out_cache_loc.shape[0]) != n:
                raise ValueError(f"save_kv_cache needs k and out_cache_loc with {n} rows, got "
                                 f"{None if k is None else tuple(k.shape)} and {tuple(batch.out_cache_loc.shape)}")
            if meta.key is None:            # eager (graph batches are the runner's, padded by its step)
                real = batch.raw_bs * lay.width if lay.width else int(batch.extend_seq_lens_cpu[:batch.raw_bs].sum())
                self.memory.check_slots(batch.out_cache_loc, real)
            self._store_kv(layer, batch.out_cache_loc, k, v)
        return self._run(q, layer, meta)

    def _check_layer_and_dtypes(self, layer: AttentionLayer, q, k, v, save_kv_cache: bool) -> None:
        """The layer is one of the model's (a list index would wrap -1 to the last layer, or raise
        a bare IndexError), it uses only the window, sinks and cap this backend declares, and q
        (k, v when stored) are in the model's dtype (the KV memory's: a store would cast them
        silently, a kernel would mix precisions)."""
        cfg = self.config
        if not (save_kv_cache or layer.features) and 0 <= layer.layer_id < cfg.num_layers and q.dtype == cfg.dtype:
            return          # a read-only call of a plain layer: every check below holds (the hot eager path)
        if not 0 <= layer.layer_id < cfg.num_layers:
            raise ValueError(f"layer_id={layer.layer_id} outside 0..{cfg.num_layers - 1} "
                             f"(the model's num_layers={cfg.num_layers})")
        if layer.features:      # a kernel that never reads window, sinks or cap would ignore them silently
            missing = [f for f in layer.features if not getattr(self.capabilities, f)]
            if missing:
                raise ValueError(f"backend {self.name} does not declare {', '.join(sorted(missing))}, "
                                 f"used by layer {layer.layer_id}")
        for name, t in (("q", q), ("k", k), ("v", v)) if save_kv_cache else (("q", q),):
            if t is not None and t.dtype != cfg.dtype:
                raise ValueError(f"{name} dtype {t.dtype} differs from the model's dtype {cfg.dtype}")

    def _store_kv(self, layer: AttentionLayer, loc: torch.Tensor, k, v) -> None:
        self.memory.pool.store(layer.layer_id, loc, k, v, layer.k_scale, layer.v_scale)

    @abstractmethod
    def _run(self, q: torch.Tensor, layer: AttentionLayer, meta: ForwardMetadata) -> torch.Tensor:
        """``q [T, H, Dqk]`` -> ``[T, H, Dv]`` over the cache, with ``meta.layout``."""
