"""Model-level attention configuration and the per-layer record backends receive."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

# The FP8 KV cache dtypes a config may name (e4m3: more mantissa, the engines' default; e5m2: more range).
FP8_KV = (torch.float8_e4m3fn, torch.float8_e5m2)
# the command lines' names of a KV dtype (vLLM's --kv-cache-dtype names); model: the model's dtype
KV_DTYPE_NAMES = {"model": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class ModelConfig:
    """The attention shape of a model, as backends and ``select`` see it.

    MHA/GQA: ``num_q_heads``, ``num_kv_heads``, ``head_dim`` (``v_head_dim`` defaults to it).
    MLA (absorbed): ``num_kv_heads == 1``; q and the cache rows are
    ``kv_lora_rank + qk_rope_head_dim`` wide (512 + 64); the output is ``kv_lora_rank`` wide.
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int = 1
    head_dim: int = 128
    v_head_dim: int = 0
    is_mla: bool = False
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128   # MLA: the unabsorbed head size; only the softmax scale uses it
    page_size: int = 1
    dtype: torch.dtype = torch.float32
    # The KV cache's dtype (None: the model's) and, for an FP8 cache, the per-tensor (k, v) scale of
    # each layer as checkpoints ship them (None: 1.0): the cache holds value / scale, saturated.
    kv_dtype: Optional[torch.dtype] = None
    kv_scales: Optional[tuple] = None

    def __post_init__(self) -> None:
        self._check_kv()
        if self.is_mla:
            if self.num_kv_heads != 1:
                raise ValueError(f"MLA has one latent KV head, got num_kv_heads={self.num_kv_heads}")
        else:
            if self.num_q_heads % self.num_kv_heads:
                raise ValueError(f"num_q_heads={self.num_q_heads} is not a multiple of "
                                 f"num_kv_heads={self.num_kv_heads}")
            if not self.v_head_dim:
                object.__setattr__(self, "v_head_dim", self.head_dim)

    @property
    def qk_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def out_dim(self) -> int:
        return self.kv_lora_rank if self.is_mla else self.v_head_dim

    @property
    def sm_scale(self) -> float:
        if self.is_mla:
            return 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype the KV cache holds: ``kv_dtype``, else the model's."""
        return self.kv_dtype or self.dtype

    def _check_kv(self) -> None:
        if self.kv_dtype not in (None, self.dtype) + FP8_KV:
            raise ValueError(f"kv_dtype={self.kv_dtype} is neither the model's dtype {self.dtype} nor one of {FP8_KV}")
        if self.kv_scales is None:
            return
        object.__setattr__(self, "kv_scales", tuple((float(k), float(v)) for k, v in self.kv_scales))  # hashable
        if self.cache_dtype not in FP8_KV:
            raise ValueError(f"kv_scales need an FP8 kv_dtype {FP8_KV}, the cache is {self.cache_dtype}")
        if len(self.kv_scales) != self.num_layers:
            raise ValueError(f"kv_scales has {len(self.kv_scales)} (k, v) pairs, the model {self.num_layers} layers")
        for i, (ks, vs) in enumerate(self.kv_scales):
            if not (math.isfinite(ks) and math.isfinite(vs) and ks > 0 and vs > 0):
                raise ValueError(f"kv_scales[{i}] = ({ks}, {vs}): scales are finite and > 0")
            if self.is_mla and ks != vs:     # one latent row is both K and V
                raise ValueError(f"kv_scales[{i}] = ({ks}, {vs}): MLA's latent cache has one scale (k == v)")

    def layer(self, layer_id: int) -> "AttentionLayer":
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(f"layer_id={layer_id} outside 0..{self.num_layers - 1}")
        ks, vs = self.kv_scales[layer_id] if self.kv_scales is not None else (1.0, 1.0)
        return AttentionLayer(layer_id, self.num_q_heads, self.num_kv_heads, self.qk_dim,
                              self.out_dim, self.sm_scale, self.is_mla, float(ks), float(vs))


@dataclass(frozen=True)
class AttentionLayer:
    """What ``forward`` needs to know of the calling layer."""

    layer_id: int
    num_q_heads: int
    num_kv_heads: int
    qk_dim: int
    v_dim: int
    scaling: float
    is_mla: bool = False
    k_scale: float = 1.0      # an FP8 cache's per-tensor scales: the cache holds value / scale
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.is_mla and self.k_scale != self.v_scale:     # one latent row is both K and V
            raise ValueError(f"MLA layer {self.layer_id}: k_scale {self.k_scale} != v_scale {self.v_scale} "
                             "(the latent cache has one scale)")
