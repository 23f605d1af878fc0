"""The backend contract (DESIGN.md) and the layout-driven base most backends share."""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from .batch import ForwardBatch, ForwardMode, GraphInputs, GraphKey, query_width
from .config import AttentionLayer, ModelConfig
from .kv_cache import KVMemory
from .layout import (
    Layout,
    LayoutError,
    build_layout,
    inputs_from_batch,
    inputs_from_graph,
    mask_kind,
    stream_capturing,
    validate,
)
from .layout_buffers import LayoutBuffers


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

    def refusal(self, cfg: ModelConfig, mode: Optional[ForwardMode] = None, device: str = "cpu",
                sm: int = 0) -> Optional[str]:
        """Why this backend cannot serve ``cfg``/``mode`` on ``device``; None if it can."""
        if cfg.is_mla and not self.mla:
            return "MHA/GQA only, model is MLA"
        if not cfg.is_mla and not self.mha:
            return "MLA only, model is MHA/GQA"
        if cfg.page_size not in self.page_sizes:
            return f"page_size={cfg.page_size} not in {self.page_sizes}"
        if mode is not None and mode not in self.modes:
            return f"mode {mode.name} not supported"
        if device not in self.devices:
            return f"device {device} not supported (needs {', '.join(self.devices)})"
        if device == "cuda" and sm < self.min_sm:
            return f"needs sm_{self.min_sm}+, device is sm_{sm}"
        if self.head_dims is not None and cfg.qk_dim not in self.head_dims:
            return f"head_dim={cfg.qk_dim} not in {self.head_dims}"
        return None


class ForwardMetadata:
    """What a forward reads: the canonical layout plus backend-private extras. In graph mode
    on CUDA, ``prep_graph`` is the layout builder itself captured on staged inputs."""

    def __init__(self, layout: Layout, **extra) -> None:
        self.layout = layout
        self.extra = extra
        self.prep_graph = None      # the builder on staged copies of the inputs
        self.prep_direct = None     # (graph, input signature): the builder on the capture inputs

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
    """Metadata through the layout builders; subclasses write ``_run`` (and ``_extras``).

    Capture and replay both go through :meth:`_prepare_graph`: capture binds views of the
    static buffers for the key, then does exactly what replay does.
    """

    def __init__(self, config: ModelConfig, memory: KVMemory) -> None:
        super().__init__(config, memory)
        if config.page_size != memory.page_size:
            raise ValueError(f"config page_size={config.page_size} != memory page_size={memory.page_size}")
        self._bufs: Optional[LayoutBuffers] = None
        self._graph_meta: dict[GraphKey, ForwardMetadata] = {}

    # -- eager
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._check_mode(batch.forward_mode, batch.spec_info)
        inp = inputs_from_batch(batch, self.memory.req_to_token, self.memory.page_size,
                                self.memory.num_slots, self.get_cuda_graph_seq_len_fill_value())
        layout = build_layout(inp)
        self.forward_metadata = ForwardMetadata(layout, **self._extras(layout, None))

    # -- graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if max_bs < 1 or max_num_tokens < max_bs:
            raise ValueError(f"max_bs={max_bs}, max_num_tokens={max_num_tokens}: need 1 <= max_bs <= max_num_tokens")
        self._bufs = LayoutBuffers(max_bs, max(1, max_num_tokens // max_bs), self.memory.max_context_len,
                                   self.memory.page_size, self.memory.device)
        self._graph_meta.clear()
        self._init_extra_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, inputs: GraphInputs) -> None:
        key = inputs.key
        if self._bufs is None:
            raise LayoutError("init_cuda_graph_state() must run before capture")
        self._check_mode(key.forward_mode, inputs.spec_info)
        want = query_width(key.forward_mode, inputs.spec_info)
        if key.width != want:
            raise LayoutError(f"GraphKey width W={key.width} but the spec gives W={want}")
        views = self._bufs.views(key.forward_mode, key.bs, key.width,
                                 mask_kind(key.forward_mode, inputs.spec_info), self.memory.max_context_len)
        old = self._graph_meta.get(key)
        meta = self._graph_meta[key] = ForwardMetadata(views, **self._extras(views, key))
        if old is not None:                                 # same views: its prep graphs still hold
            meta.prep_graph, meta.prep_direct = old.prep_graph, old.prep_direct
        self._prepare_graph(inputs, capture=True)

    def init_forward_metadata_replay_cuda_graph(self, inputs: GraphInputs) -> None:
        self._prepare_graph(inputs, capture=False)

    def _prepare_graph(self, inputs: GraphInputs, capture: bool) -> None:
        """Capture and replay alike: the layout builder writes into the bound views. Replay
        on CUDA replays the builder captured at capture time (a few launches of host time)."""
        meta = self._graph_meta.get(inputs.key)
        if meta is None:
            captured = ", ".join(sorted(map(str, self._graph_meta)))
            raise LayoutError(f"no graph captured for {inputs.key}; captured: {captured}")
        inp = inputs_from_graph(inputs, self.memory.req_to_token, self.memory.page_size,
                                self.memory.num_slots, self.get_cuda_graph_seq_len_fill_value(), capture)
        if capture or meta.prep_graph is None:
            build_layout(inp, out=meta.layout)               # capture: validates device values too (I13)
            if capture and self.capture_prep_graph and inp.req_to_token.is_cuda and not stream_capturing():
                self._bufs.stage(inp)
                meta.prep_graph = _capture_builder(self._bufs.staged(inp), meta.layout)
                meta.prep_direct = (_capture_builder(self._bufs.direct(inp), meta.layout), _signature(inp))
        else:
            validate(inp)                                    # host checks, every replay
            if meta.prep_direct is not None and meta.prep_direct[1] == _signature(inp):
                self._bufs.stage_scalars(inp)                # a runner's static inputs: 1-2 launches
                meta.prep_direct[0].replay()
            else:
                self._bufs.stage(inp)
                meta.prep_graph.replay()
        self._refresh_extras(meta, inputs)
        self.forward_metadata = meta

    capture_prep_graph = True

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def graph_buffers(self) -> dict[str, torch.Tensor]:
        if self._bufs is None:
            return {}
        out = self._bufs.tensors()
        out.update(self._extra_graph_buffers())
        return out

    # -- hooks for subclasses
    def _extras(self, layout: Layout, key: Optional[GraphKey]) -> dict:
        """Backend-private metadata derived from host values (key alone in graph mode)."""
        return {}

    def _init_extra_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        pass

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


def _signature(inp) -> tuple:
    """Where and how the device inputs live: a prep graph captured on them reads exactly this."""
    tensors = [inp.req_pool_indices, inp.seq_lens]
    if inp.spec_info is not None and inp.spec_info.tree_mask is not None:
        tensors.append(inp.spec_info.tree_mask)
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors)


def _capture_builder(inp, layout: Layout):
    """The layout builder captured as a CUDA graph on ``inp`` (device inputs at fixed addresses)."""
    build_layout(inp, out=layout)                            # warm-up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        build_layout(inp, out=layout)
    g.replay()                                               # capture records, it does not run
    return g
