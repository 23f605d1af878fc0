"""The backend contract and the layout-driven base most backends share.

A backend is a class with a ``name``, declared ``capabilities`` and the seven methods of
:class:`AttentionBackend`. ``docs/plugin-guide.md`` walks through writing one;
``examples/sdpa_backend`` is a complete, installable one.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from . import layout as _layout
from .batch import ForwardBatch, ForwardMode, GraphInputs, GraphKey
from .config import AttentionLayer, ModelConfig
from .kv_cache import KVMemory
from .layout import Layout, LayoutError, build_layout, inputs_from_batch
from .step import LayoutPlan
from .validation import check_request_rows


class GraphSupport(enum.IntEnum):
    """How much of a forward a backend lets a CUDA graph hold (ordered)."""

    NEVER = 0
    UNIFORM_BATCH = 1   # DECODE / TARGET_VERIFY / DRAFT_EXTEND at a fixed (bs, W)
    ALWAYS = 2


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares it can do; ``select``, ``list`` and the suite decide from it alone.

    Attributes
    ----------
    modes : frozenset of ForwardMode
        The forward modes it runs (EXTEND, DECODE, TARGET_VERIFY, DRAFT_EXTEND).
    mha, mla : bool
        Whether it runs MHA/GQA models, and (absorbed) MLA models.
    page_sizes : tuple of int
        KV page sizes it supports (the memory's ``page_size``).
    topk_gt1 : bool
        Tree verify (TARGET_VERIFY with ``topk > 1``, a ``custom_mask``) and draft decode with
        several branches per request (the draft-branch mask).
    draft_decode : bool
        Multi-step draft decode (DECODE with ``spec_info.draft_step > 0``).
    graph : GraphSupport
        How much of a forward a CUDA graph may hold with it (UNIFORM_BATCH: captured per
        GraphKey; NEVER: eager only).
    devices : tuple of str
        "cpu" and/or "cuda".
    min_sm : int
        Least CUDA compute capability (90 for Hopper-only kernels; 0: any).
    head_dims : tuple of int or None
        Supported ``qk_dim`` (head dim, or latent + rope for MLA); None: any.
    requires : tuple of str
        Importable modules it needs; a missing one makes it unavailable with an install hint.
    preference : int
        ``select()`` ranks backends that serve a request by this first (higher first; the
        built-ins declare 0), then registry order; the reference ``torch_native`` comes last.
    """

    modes: frozenset
    mha: bool = True
    mla: bool = False
    page_sizes: tuple = (1, 16, 64)
    topk_gt1: bool = False
    draft_decode: bool = True
    graph: GraphSupport = GraphSupport.UNIFORM_BATCH
    devices: tuple = ("cpu", "cuda")
    min_sm: int = 0
    head_dims: Optional[tuple] = None
    requires: tuple = ()
    preference: int = 0
    dtypes: tuple = (torch.float32, torch.float16, torch.bfloat16)
    mode_graph: tuple = ()
    cannot: str = ""

    def graph_for(self, mode: ForwardMode) -> GraphSupport:
        """The graph support of ``mode`` (``graph`` unless ``mode_graph`` says otherwise)."""
        return dict(self.mode_graph).get(mode, self.graph)

    def refusal(self, cfg: ModelConfig, mode: Optional[ForwardMode] = None, device: str = "cpu",
                sm: Optional[int] = 0, topk: int = 1) -> Optional[str]:
        """Why this backend cannot serve ``cfg``/``mode`` (with ``topk`` branches) on ``device`` of
        compute capability ``sm`` (None: not checked); None if it can. The model's and the request's
        reasons come first (they hold on any device), then the device's."""
        if cfg.is_mla and not self.mla:
            return "MHA/GQA only, model is MLA"
        if not cfg.is_mla and not self.mha:
            return "MLA only, model is MHA/GQA"
        if cfg.page_size not in self.page_sizes:
            return f"page_size={cfg.page_size} not in {self.page_sizes}"
        if mode is not None and mode not in self.modes:
            return f"mode {mode.name} not supported"
        if topk > 1 and not self.topk_gt1:
            return f"topk={topk} > 1 not supported" + (f": {self.cannot}" if self.cannot else "")
        if self.head_dims is not None and cfg.qk_dim not in self.head_dims:
            return f"head_dim={cfg.qk_dim} not in {self.head_dims}"
        if cfg.dtype not in self.dtypes:
            return f"dtype {str(cfg.dtype)[6:]} not in ({', '.join(str(d)[6:] for d in self.dtypes)})"
        if device not in self.devices:
            return f"device {device} not supported (needs {', '.join(self.devices)})"
        if device == "cuda" and sm is not None and sm < self.min_sm:
            return f"needs sm_{self.min_sm}+, device is sm_{sm}"
        return None


class ForwardMetadata:
    """What a forward reads: the canonical layout (the step plan's) plus backend-private extras."""

    def __init__(self, layout: Layout, plan: Optional[LayoutPlan] = None, **extra) -> None:
        self.layout = layout
        self.plan = plan              # graph mode: the plan whose static views ``layout`` is
        self.extra = extra
        self.batch = None             # eager: the batch it was prepared for

    def as_layout(self) -> dict:
        return self.layout.as_dict()


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
        ``batch.plan`` set, the step's layout is already built there."""

    @abstractmethod
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Before any capture: the largest bucket and token count a captured graph will have.
        Allocate what must outlive the captures (static buffers, workspaces) here."""

    @abstractmethod
    def init_forward_metadata_capture_cuda_graph(self, inputs: GraphInputs) -> None:
        """Before capturing the graph of ``inputs.key``: bind the static buffers the graph will
        read and prepare them for the capture batch (which must pass the same validation as
        any replay batch, I13). May sync and allocate; ``inputs.plan`` is the runner's step
        plan (already captured for the key) or None."""

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
    """Metadata from the step plan (:mod:`attn_backends.step`); subclasses write ``_run`` and may
    derive private extras (``_extras`` / ``_refresh_extras``).

    With a runner, the plan comes with the batch (``ForwardBatch.plan``, ``GraphInputs.plan``):
    the layout is built once per step for every layer, and this backend only derives its extras.
    Without one (a test, the suite, a third-party caller), the backend keeps a private plan and
    prepares the layout itself, through the same builder. Capture and replay take the same
    ``GraphInputs``; capture binds the plan's static views for the key, replay refreshes them.
    """

    #: With a runner's step plan, replay preparation reads nothing the plan computes on the
    #: device: the runner may record the plan's prep inside its step's graph (one launch).
    reads_step_plan: ClassVar[bool] = True

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
        memory.check_fits(config)
        self._graph_size: Optional[tuple] = None          # (max_bs, max_width) of init_cuda_graph_state
        self._own_plan: Optional[LayoutPlan] = None       # the private plan, allocated on first use
        self._graph_meta: dict[tuple, ForwardMetadata] = {}   # (key, runner plan or None) -> metadata
        self._last_replay: tuple = (None, None, None)           # (key, plan, metadata) of the last replay

    # -- eager
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._check_mode(batch.forward_mode, batch.spec_info)
        if batch.plan is not None:
            self._check_plan(batch.plan)
            layout = batch.plan.layout_for(batch)
        else:
            layout = build_layout(inputs_from_batch(batch, self.memory, self.get_cuda_graph_seq_len_fill_value()))
        self.forward_metadata = ForwardMetadata(layout, None, **self._extras(layout, None))
        self.forward_metadata.batch = batch

    # -- graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if max_bs < 1 or max_num_tokens < max_bs:
            raise ValueError(f"max_bs={max_bs}, max_num_tokens={max_num_tokens}: need 1 <= max_bs <= max_num_tokens")
        self._graph_size = (max_bs, max(1, max_num_tokens // max_bs))
        self._own_plan = None
        self._graph_meta.clear()
        self._last_replay = (None, None, None)

    def init_forward_metadata_capture_cuda_graph(self, inputs: GraphInputs) -> None:
        key = inputs.key
        if self._graph_size is None:
            raise LayoutError("init_cuda_graph_state() must run before capture")
        self._check_mode(key.forward_mode, inputs.spec_info)
        if inputs.plan is not None:                       # a runner captured the key in its plan
            self._check_plan(inputs.plan)
            plan = inputs.plan
            layout = plan.captured(key).layout
        else:
            if not _layout.stream_capturing():            # the caller's rows (a sync): all on row 0 is a
                rows = inputs.req_pool_indices[:inputs.raw_bs]    # stand-in (SGLang captures so), else real
                check_request_rows(rows, self.memory.req_to_token.shape[0], stand_in=bool((rows == 0).all()))
            plan = self._private_plan()
            plan.load(inputs, capture=True)               # validates first: a refusal changes nothing
            layout = plan.capture(key, inputs.spec_info, inputs.raw_bs)
        meta = ForwardMetadata(layout, plan, **self._extras(layout, key))
        self._graph_meta[(key, inputs.plan)] = meta       # a runner's plan, or None: the private one
        self._last_replay = (None, None, None)
        self.forward_metadata = meta

    def init_forward_metadata_replay_cuda_graph(self, inputs: GraphInputs) -> None:
        key, plan = inputs.key, inputs.plan
        last = self._last_replay                          # a runner hands the same key and plan every replay
        meta = last[2] if last[0] is key and last[1] is plan else self._graph_meta.get((key, plan))
        if meta is None:
            captured = ", ".join(sorted(f"{k}{' (step plan)' if p is not None else ''}" for k, p in self._graph_meta))
            where = "with this step plan" if plan is not None else "without a step plan"
            raise LayoutError(f"no graph captured for {key} {where}; captured: {captured or 'none'}")
        if plan is not None:
            if plan.current is not key and plan.current != key:   # the runner updates the plan first
                plan.check_current(key)
        else:
            spec = inputs.spec_info
            meta.plan.load(inputs)
            meta.plan.update(key, inputs.raw_bs, spec.draft_step if spec is not None else None)
        self._refresh_extras(meta, inputs)
        self.forward_metadata = meta
        self._last_replay = (key, plan, meta)

    def _private_plan(self) -> LayoutPlan:
        if self._own_plan is None:
            max_bs, max_width = self._graph_size
            self._own_plan = LayoutPlan(self.memory, self.get_cuda_graph_seq_len_fill_value(),
                                        max_bs=max_bs, max_width=max_width)
        return self._own_plan

    def _check_plan(self, plan: LayoutPlan) -> None:
        if plan.memory is not self.memory:
            raise LayoutError(f"backend {self.name} reads another KV memory than the step plan it was given")

    @property
    def graph_plans(self) -> list:
        """The plans whose static views this backend's captured graphs read."""
        return list({id(m.plan): m.plan for m in self._graph_meta.values() if m.plan is not None}.values())

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def graph_buffers(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, plan in enumerate(self.graph_plans):
            out.update({(k if i == 0 else f"{k}#{i}"): v for k, v in plan.tensors().items()})
        out.update(self._extra_graph_buffers())
        return out

    # -- hooks for subclasses
    def _extras(self, layout: Layout, key: Optional[GraphKey]) -> dict:
        """Backend-private metadata derived from host values (key alone in graph mode)."""
        return {}

    def _refresh_extras(self, meta: ForwardMetadata, inputs: GraphInputs) -> None:
        pass

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
        if meta.plan is not None and (batch.forward_mode != lay.mode or batch.batch_size != lay.bs):
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
            if meta.plan is None:           # eager (graph batches are the runner's, padded by its plan)
                real = batch.raw_bs * lay.width if lay.width else int(batch.extend_seq_lens_cpu[:batch.raw_bs].sum())
                self.memory.check_slots(batch.out_cache_loc, real)
            self._store_kv(layer, batch.out_cache_loc, k, v)
        return self._run(q, layer, meta)

    def _check_layer_and_dtypes(self, layer: AttentionLayer, q, k, v, save_kv_cache: bool) -> None:
        """The layer is one of the model's (a list index would wrap -1 to the last layer, or raise
        a bare IndexError), and q (k, v when stored) are in the model's dtype (the KV memory's:
        a store would cast them silently, a kernel would mix precisions)."""
        cfg = self.config
        if not 0 <= layer.layer_id < cfg.num_layers:
            raise ValueError(f"layer_id={layer.layer_id} outside 0..{cfg.num_layers - 1} "
                             f"(the model's num_layers={cfg.num_layers})")
        for name, t in (("q", q), ("k", k), ("v", v)) if save_kv_cache else (("q", q),):
            if t is not None and t.dtype != cfg.dtype:
                raise ValueError(f"{name} dtype {t.dtype} differs from the model's dtype {cfg.dtype}")

    def _store_kv(self, layer: AttentionLayer, loc: torch.Tensor, k, v) -> None:
        self.memory.pool.store(layer.layer_id, loc, k, v)

    @abstractmethod
    def _run(self, q: torch.Tensor, layer: AttentionLayer, meta: ForwardMetadata) -> torch.Tensor:
        """``q [T, H, Dqk]`` -> ``[T, H, Dv]`` over the cache, with ``meta.layout``."""
