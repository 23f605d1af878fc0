"""The backend contract (DESIGN.md) and the layout-driven base most backends share."""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from .batch import ForwardBatch, ForwardMode, GraphInputs, GraphKey
from .config import AttentionLayer, ModelConfig
from .kv_cache import KVMemory
from .layout import Layout, LayoutError, build_layout, inputs_from_batch
from .plan import LayoutPlan


class GraphSupport(enum.IntEnum):
    """How much of a forward a backend lets a CUDA graph hold (ordered)."""

    NEVER = 0
    UNIFORM_BATCH = 1   # DECODE / TARGET_VERIFY / DRAFT_EXTEND at a fixed (bs, W)
    ALWAYS = 2


@dataclass(frozen=True)
class Capabilities:
    modes: frozenset                  # ForwardModes the backend runs
    mha: bool = True                  # runs MHA/GQA models
    mla: bool = False                 # runs (absorbed) MLA models
    page_sizes: tuple = (1, 16, 64)
    topk_gt1: bool = False            # tree verify and multi-branch draft decode
    draft_decode: bool = True
    graph: GraphSupport = GraphSupport.UNIFORM_BATCH
    devices: tuple = ("cpu", "cuda")
    min_sm: int = 0                   # e.g. 90 for Hopper-only kernels
    head_dims: Optional[tuple] = None # None: any
    requires: tuple = ()              # importable modules it needs
    preference: int = 0               # select(): higher ranks first among backends that serve
    dtypes: tuple = (torch.float32, torch.float16, torch.bfloat16)   # model (q, KV) dtypes
    mode_graph: tuple = ()            # ((ForwardMode, GraphSupport), ...): per-mode exceptions to graph
    cannot: str = ""                  # why topk > 1 is refused (shown by select() and `list`)

    def graph_for(self, mode: ForwardMode) -> GraphSupport:
        """The graph support of ``mode`` (``graph`` unless ``mode_graph`` says otherwise)."""
        return dict(self.mode_graph).get(mode, self.graph)

    def refusal(self, cfg: ModelConfig, mode: Optional[ForwardMode] = None, device: str = "cpu",
                sm: int = 0, topk: int = 1) -> Optional[str]:
        """Why this backend cannot serve ``cfg``/``mode`` (with ``topk`` branches) on ``device``;
        None if it can."""
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
        if device not in self.devices:
            return f"device {device} not supported (needs {', '.join(self.devices)})"
        if device == "cuda" and sm < self.min_sm:
            return f"needs sm_{self.min_sm}+, device is sm_{sm}"
        if self.head_dims is not None and cfg.qk_dim not in self.head_dims:
            return f"head_dim={cfg.qk_dim} not in {self.head_dims}"
        if cfg.dtype not in self.dtypes:
            return f"dtype {str(cfg.dtype)[6:]} not in ({', '.join(str(d)[6:] for d in self.dtypes)})"
        return None


class ForwardMetadata:
    """What a forward reads: the canonical layout (the step plan's) plus backend-private extras."""

    def __init__(self, layout: Layout, plan: Optional[LayoutPlan] = None, **extra) -> None:
        self.layout = layout
        self.plan = plan              # graph mode: the plan whose static views ``layout`` is
        self.extra = extra

    def as_layout(self) -> dict:
        return self.layout.as_dict()


class AttentionBackend(ABC):
    capabilities: ClassVar[Capabilities]
    name: ClassVar[str] = "?"

    def __init__(self, config: ModelConfig, memory: KVMemory) -> None:
        self.config = config
        self.memory = memory
        self.forward_metadata: Optional[ForwardMetadata] = None

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None: ...

    @abstractmethod
    def init_forward_metadata_capture_cuda_graph(self, inputs: GraphInputs) -> None: ...

    @abstractmethod
    def init_forward_metadata_replay_cuda_graph(self, inputs: GraphInputs) -> None: ...

    @abstractmethod
    def get_cuda_graph_seq_len_fill_value(self) -> int: ...

    @abstractmethod
    def graph_buffers(self) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def forward(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True): ...


class LayoutBackend(AttentionBackend):
    """Metadata from the step plan (:mod:`attn_backends.plan`); subclasses write ``_run`` and may
    derive private extras (``_extras`` / ``_refresh_extras``).

    With a runner, the plan comes with the batch (``ForwardBatch.plan``, ``GraphInputs.plan``):
    the layout is built once per step for every layer, and this backend only derives its extras.
    Without one (a test, the suite, a third-party caller), the backend keeps a private plan and
    prepares the layout itself, through the same builder. Capture and replay take the same
    ``GraphInputs``; capture binds the plan's static views for the key, replay refreshes them.
    """

    def __init__(self, config: ModelConfig, memory: KVMemory) -> None:
        super().__init__(config, memory)
        if config.page_size != memory.page_size:
            raise ValueError(f"config page_size={config.page_size} != memory page_size={memory.page_size}")
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
        if self.forward_metadata is None:
            raise LayoutError("forward() before init_forward_metadata()")
        lay = self.forward_metadata.layout
        n = int(q.shape[0])
        if q.dim() != 3 or q.shape[1] != layer.num_q_heads or q.shape[2] != layer.qk_dim:
            raise ValueError(f"q has shape {tuple(q.shape)}, expected [T, {layer.num_q_heads}, {layer.qk_dim}]")
        if lay.width and n != lay.bs * lay.width:
            raise ValueError(f"q has {n} rows, the layout expects bs*W = {lay.bs}*{lay.width} = {lay.bs * lay.width}")
        if not lay.width and n != batch.num_tokens:
            raise ValueError(f"q has {n} rows, the EXTEND batch has {batch.num_tokens} new tokens")
        if save_kv_cache:
            if k is None or int(k.shape[0]) != n or int(batch.out_cache_loc.shape[0]) != n:
                raise ValueError(f"save_kv_cache needs k and out_cache_loc with {n} rows, got "
                                 f"{None if k is None else tuple(k.shape)} and {tuple(batch.out_cache_loc.shape)}")
            self._store_kv(layer, batch.out_cache_loc, k, v)
        return self._run(q, layer, self.forward_metadata)

    def _store_kv(self, layer: AttentionLayer, loc: torch.Tensor, k, v) -> None:
        self.memory.pool.store(layer.layer_id, loc, k, v)

    @abstractmethod
    def _run(self, q: torch.Tensor, layer: AttentionLayer, meta: ForwardMetadata) -> torch.Tensor:
        """``q [T, H, Dqk]`` -> ``[T, H, Dv]`` over the cache, with ``meta.layout``."""
