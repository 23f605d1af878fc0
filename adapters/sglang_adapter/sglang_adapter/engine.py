"""What an SGLang attention backend needs around it, on a CPU: the stand-in ModelRunner it is
constructed from, SGLang's own batch and layer objects built from ours, and the interpreter's
kernel launches made sync-free.

Stand-ins (each the least SGLang's constructor and methods read; none computes metadata):

- :class:`StandInRunner`: SGLang's ``ModelRunner`` builds the model, the distributed groups and
  the pools on a GPU. The backend reads a dozen attributes from it: the request-to-token table
  (ours, shared), the KV pool, the model's head counts and context length, the server args.
- :class:`StandInKVPool`: SGLang's ``MHATokenToKVPool`` allocates its own CUDA buffers; this one
  serves ``get_key_buffer`` / ``get_value_buffer`` / ``set_kv_buffer`` from our ``KVMemory``
  pool (the same ``[num_slots, Hkv, D]`` layout), so both sides read one cache.
- ``server_args``: SGLang's ``ServerArgs`` validates a model path and a GPU on construction; the
  stand-in carries the fields the backend reads, at SGLang's defaults.
- The attention TP group: ``get_attention_tp_size()`` asserts an initialised process group; a
  one-rank stand-in group (``world_size`` 1) is set in ``parallel_state._ATTN_TP``.

Real SGLang objects: ``TritonAttnBackend`` itself, ``ForwardBatch``, ``ForwardMode``,
``RadixAttention`` (the layer), ``EagleVerifyInput`` / ``EagleDraftInput`` (spec inputs).
"""
from __future__ import annotations

import functools
import importlib
import types
from dataclasses import dataclass
from typing import Optional

import torch

from attn_backends.check.hostsync import unguard_interpreted_launches

from . import standins


@functools.lru_cache(maxsize=None)
def sglang():
    """Import SGLang (stand-ins first); a one-line error where it is not on the path."""
    standins.install()
    try:
        sgl = importlib.import_module("sglang")
        importlib.import_module("sglang.srt.layers.attention.triton_backend")
    except ImportError as e:
        raise ImportError(f"SGLang cannot be imported ({e}); install it with adapters/install_engines.sh and put "
                          "its target folder on PYTHONPATH") from e
    _one_rank_attention_tp()
    unguard_interpreted_launches()      # interpreted launches are no host sync (I15)
    # our kernels package patches the interpreter for numpy >= 2.4 (kernels/_interpret_compat.py): SGLang
    # 0.5.23's index kernel loops to a bound loaded from memory, which the unpatched interpreter refuses
    importlib.import_module("attn_backends_kernels")
    return sgl


def sglang_version() -> str:
    return getattr(sglang(), "__version__", "?")


def _one_rank_attention_tp() -> None:
    ps = importlib.import_module("sglang.srt.distributed.parallel_state")
    if getattr(ps, "_ATTN_TP", None) is None:
        ps._ATTN_TP = types.SimpleNamespace(world_size=1, rank_in_group=0, rank=0)


class StandInKVPool:
    """SGLang's token-to-KV pool API over our KV memory's pool (slot = token, page size 1)."""

    def __init__(self, memory) -> None:
        self.memory = memory

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.memory.pool.k[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.memory.pool.v[layer_id]

    def get_v_head_dim(self) -> int:
        return int(self.memory.pool.v[0].shape[-1])

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None, **kwargs) -> None:
        self.memory.pool.store(layer.layer_id, loc, cache_k, cache_v, 1.0, 1.0)


@dataclass
class ServerArgs:
    """The server args a TritonAttnBackend reads, at SGLang's defaults (TP 1, CUDA graphs on)."""

    speculative_num_draft_tokens: Optional[int] = None
    speculative_num_steps: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None
    triton_attention_num_kv_splits: int = 8
    triton_attention_split_tile_size: Optional[int] = None
    enable_deterministic_inference: bool = False
    disable_cuda_graph: bool = False
    chunked_prefill_size: int = 8192
    page_size: int = 1
    kv_cache_dtype: str = "auto"
    speculative_draft_window_size: Optional[int] = None     # 0.5.23's draft decode: full attention
    speculative_draft_sink_size: Optional[int] = None


class _ModelConfig:
    def __init__(self, config, context_len: int) -> None:
        self.num_attention_heads = config.num_q_heads
        self._kv_heads = config.num_kv_heads
        self.context_len = context_len
        self.is_encoder_decoder = False
        self.attention_arch = None

    def get_num_kv_heads(self, tp_size: int) -> int:
        return max(1, self._kv_heads // tp_size)


class StandInRunner:
    """The attributes of SGLang's ``ModelRunner`` an attention backend's constructor reads."""

    def __init__(self, config, memory, server_args: ServerArgs) -> None:
        self.device = str(memory.device) if memory.device.type == "cpu" else f"cuda:{memory.device.index or 0}"
        self.gpu_id = memory.device.index or 0
        self.server_args = server_args
        self.page_size = 1
        self.model_config = _ModelConfig(config, memory.max_context_len)
        r2t = memory.req_to_token
        self.req_to_token_pool = types.SimpleNamespace(size=int(r2t.shape[0]), req_to_token=r2t)
        self.token_to_kv_pool = StandInKVPool(memory)
        self.token_to_kv_pool_allocator = types.SimpleNamespace(get_kvcache=lambda: self.token_to_kv_pool)
        self.sliding_window_size = None
        self.hybrid_gdn_config = None
        self.kimi_linear_config = None
        self.kv_cache_dtype = config.cache_dtype
        self.dtype = config.dtype
        self.is_hybrid_swa = False


def radix_layer(layer, config):
    """SGLang's own layer object (``RadixAttention``) for one of our ``AttentionLayer``s."""
    from sglang.srt.layers.radix_attention import RadixAttention
    return RadixAttention(num_heads=layer.num_q_heads, head_dim=layer.qk_dim, scaling=layer.scaling,
                          num_kv_heads=layer.num_kv_heads, layer_id=layer.layer_id, v_head_dim=layer.v_dim)


def sgl_mode(mode):
    """SGLang's ``ForwardMode`` for ours. Our DRAFT_EXTEND (every request N rows, ``seq_lens``
    counting them) is SGLang's ``DRAFT_EXTEND_V2`` (``eagle_info_v2.py``,
    ``prepare_for_extend_to_fill_draft_kvcache``: ``seq_lens + num_draft_tokens``, N rows each);
    its ``DRAFT_EXTEND`` (v1) packs ``accept_length`` rows per request, a layout the contract has not."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    return getattr(ForwardMode, "DRAFT_EXTEND_V2" if mode.name == "DRAFT_EXTEND" else mode.name)
