"""Model-level attention configuration and the per-layer record backends receive."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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

    def __post_init__(self) -> None:
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

    def layer(self, layer_id: int) -> "AttentionLayer":
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(f"layer_id={layer_id} outside 0..{self.num_layers - 1}")
        return AttentionLayer(layer_id, self.num_q_heads, self.num_kv_heads, self.qk_dim,
                              self.out_dim, self.sm_scale, self.is_mla)


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
