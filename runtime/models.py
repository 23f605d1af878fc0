"""Tiny models with seeded random weights that call attention through the backend contract.

:class:`TinyModel` of a :class:`TinyConfig`: RMSNorm, RoPE and SwiGLU, with GQA attention
(:class:`GQABlock`) or MLA (:class:`MLABlock`, ``is_mla``: a latent KV, latent + decoupled rope
key in one cache row; q_nope is absorbed into latent space (``q_nope @ W_kc``) and the latent
output leaves through ``W_vc``, in every mode).

Both write their KV through the backend (``save_kv_cache``) into the model's KV pool and
call attention through :func:`attention_hook.attention_call`, the one place a piecewise or
breakable capture may cut the forward.

Attention beyond plain causal (#42), in the style of the families engines serve: ``sliding_window``
in the layers ``layer_pattern`` names sliding (cycled over the layers; None: every layer, as
Mistral), ``logit_softcap`` on every layer's scores (Gemma 2), ``sinks``: a learned sink logit per
query head and layer (gpt-oss), a weight of the block handed to ``ModelConfig.layer(i, sinks=...)``.
:data:`TINY_MODELS` names the tiny configs ``attn-backends generate --model`` builds.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from attn_backends import AttentionBackend, ForwardBatch, ModelConfig
from attn_backends.config import FULL, SLIDING

from .attention_hook import attention_call


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    is_mla: bool = False
    kv_lora_rank: int = 32
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 16
    v_head_dim: int = 16
    page_size: int = 1
    dtype: torch.dtype = torch.float32
    rope_theta: float = 10000.0
    seed: int = 0
    kv_dtype: Optional[torch.dtype] = None    # the KV cache's dtype (None: the model's)
    kv_scale: tuple = (1.0, 1.0)              # an FP8 cache's (k, v) scales, every layer's (MLA: k == v)
    sliding_window: Optional[int] = None      # the window of the sliding layers (module docstring)
    layer_pattern: Optional[tuple] = None     # layer i is layer_pattern[i % len] (Hugging Face's type names)
    logit_softcap: Optional[float] = None
    sinks: bool = False

    def layer_types(self) -> Optional[tuple]:
        """Hugging Face's ``layer_types`` of the model (None: the config's default). The pattern
        cycles, so a draft's layer ``num_layers + i`` has target layer ``i``'s type whenever the
        pattern divides ``num_layers`` (:class:`TinyModel` checks it)."""
        p = self.layer_pattern
        return None if p is None else tuple(p[i % len(p)] for i in range(self.num_layers))

    def attention(self) -> ModelConfig:
        fp8 = dict(sliding_window=self.sliding_window, layer_types=self.layer_types(),
                   logit_softcap=self.logit_softcap, sinks=self.sinks)
        if self.kv_dtype not in (None, self.dtype):
            fp8.update(kv_dtype=self.kv_dtype, kv_scales=(self.kv_scale,) * self.num_layers)
        if self.is_mla:
            return ModelConfig(self.num_layers, self.num_q_heads, 1, is_mla=True, kv_lora_rank=self.kv_lora_rank,
                               qk_rope_head_dim=self.qk_rope_head_dim, qk_nope_head_dim=self.qk_nope_head_dim,
                               page_size=self.page_size, dtype=self.dtype, **fp8)
        return ModelConfig(self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim,
                           page_size=self.page_size, dtype=self.dtype, **fp8)

    @classmethod
    def gpu_gqa(cls, **kw) -> "TinyConfig":
        """Benchmark size: Llama-like attention shapes (32/8 heads, d 128), 4 layers."""
        base = cls(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=4, num_q_heads=32,
                   num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
        return replace(base, **kw)

    @classmethod
    def gpu_mla(cls, **kw) -> "TinyConfig":
        """Benchmark size: DeepSeek-like MLA (16 heads, latent 512 + rope 64), 4 layers."""
        base = cls(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=4, num_q_heads=16,
                   is_mla=True, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                   page_size=64, dtype=torch.bfloat16)
        return replace(base, **kw)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rope_angles(positions: torch.Tensor, d: int, theta: float) -> tuple:
    """``(cos, sin) [T, 1, d/2]`` float32 of rotate-half RoPE at ``positions [T]``: a step computes
    them once for every layer (each layer's own were a dozen graph nodes twice over)."""
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d)
    ang = positions.float()[:, None] * inv[None, :]                      # [T, d/2]
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


def apply_rope(x: torch.Tensor, positions, theta: float) -> torch.Tensor:
    """Rotate-half RoPE over the last dim of ``x [T, heads, d]`` at ``positions [T]``, or with the
    ``(cos, sin)`` of :func:`rope_angles` (the same values)."""
    d = x.shape[-1]
    cos, sin = rope_angles(positions, d, theta) if isinstance(positions, torch.Tensor) else positions
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(g) * u)


def gemma2_like(**kw) -> TinyConfig:
    """Gemma 2's attention at tiny size: sliding and full layers alternating (its window 4096 and
    cap 50 scaled to sequences of tens of tokens: a window of 7, a cap of 2 that binds)."""
    return replace(TinyConfig(sliding_window=7, layer_pattern=(SLIDING, FULL), logit_softcap=2.0), **kw)


def gptoss_like(**kw) -> TinyConfig:
    """gpt-oss's attention at tiny size: windowed and full layers alternating (its 128-token window
    scaled to a window of 5), a learned sink logit per head in every layer."""
    return replace(TinyConfig(sliding_window=5, layer_pattern=(SLIDING, FULL), sinks=True), **kw)


# ``generate --model`` names: the config builder of each tiny model (kw: the fields to change)
TINY_MODELS = {"tiny-gqa": TinyConfig, "tiny-mla": lambda **kw: TinyConfig(is_mla=True, **kw),
               "tiny-gemma2": gemma2_like, "tiny-gptoss": gptoss_like}


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    """A block's sum over tensor-parallel ranks at TP 1 (``tp.shard_model`` sets the all-reduce)."""
    return x


class GQABlock(nn.Module):
    def __init__(self, c: TinyConfig, layer_id: int) -> None:
        super().__init__()
        # a learned weight (seeded): sink logits of a few units, as large as the scores they join
        self.sinks = nn.Parameter(torch.randn(c.num_q_heads) * 2) if c.sinks else None
        self.c, self.layer = c, c.attention().layer(layer_id, sinks=self.sinks)   # the record holds the parameter
        self.norm1, self.norm2 = RMSNorm(c.hidden_size), RMSNorm(c.hidden_size)
        self.qkv = nn.Linear(c.hidden_size, (c.num_q_heads + 2 * c.num_kv_heads) * c.head_dim, bias=False)
        self.o = nn.Linear(c.num_q_heads * c.head_dim, c.hidden_size, bias=False)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.reduce = no_reduce

    def pre_attn(self, h, positions):
        c, t = self.c, h.shape[0]
        q, k, v = self.qkv(self.norm1(h)).split(
            [c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], -1)
        q = apply_rope(q.view(t, c.num_q_heads, c.head_dim), positions, c.rope_theta)
        k = apply_rope(k.view(t, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
        return q, k, v.reshape(t, c.num_kv_heads, c.head_dim)

    def post_attn(self, h, o):
        h = h + self.reduce(self.o(o.reshape(h.shape[0], -1)))
        return h + self.reduce(self.mlp(self.norm2(h)))


class MLABlock(nn.Module):
    def __init__(self, c: TinyConfig, layer_id: int) -> None:
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(c.num_q_heads) * 2) if c.sinks else None    # as GQABlock's
        self.c, self.layer = c, c.attention().layer(layer_id, sinks=self.sinks)
        h, n = c.hidden_size, c.num_q_heads
        self.norm1, self.norm2 = RMSNorm(h), RMSNorm(h)
        self.q_proj = nn.Linear(h, n * (c.qk_nope_head_dim + c.qk_rope_head_dim), bias=False)
        self.kv_a = nn.Linear(h, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(c.kv_lora_rank)
        scale = c.kv_lora_rank ** -0.5
        self.w_kc = nn.Parameter(torch.randn(n, c.qk_nope_head_dim, c.kv_lora_rank) * scale)  # absorbed into q
        self.w_vc = nn.Parameter(torch.randn(n, c.kv_lora_rank, c.v_head_dim) * scale)        # latent -> v
        self.o = nn.Linear(n * c.v_head_dim, h, bias=False)
        self.mlp = SwiGLU(h, c.intermediate_size)
        self.reduce = no_reduce

    def pre_attn(self, h, positions):
        c, t = self.c, h.shape[0]
        x = self.norm1(h)
        q = self.q_proj(x).view(t, c.num_q_heads, c.qk_nope_head_dim + c.qk_rope_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
        latent, k_pe = self.kv_a(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        q_pe = apply_rope(q_pe, positions, c.rope_theta)
        k_pe = apply_rope(k_pe[:, None, :], positions, c.rope_theta)
        q_lat = torch.einsum("thn,hnl->thl", q_nope, self.w_kc.to(q_nope.dtype))   # [T, H, latent]
        q = torch.cat([q_lat, q_pe], -1)                                            # [T, H, latent+rope]
        k = torch.cat([self.kv_norm(latent)[:, None, :], k_pe], -1)               # [T, 1, latent+rope]
        return q, k, None

    def post_attn(self, h, o):
        v = torch.einsum("thl,hlv->thv", o, self.w_vc.to(o.dtype))                 # [T, H, v_head]
        h = h + self.reduce(self.o(v.reshape(h.shape[0], -1)))
        return h + self.reduce(self.mlp(self.norm2(h)))


Backends = Union[AttentionBackend, Sequence[AttentionBackend]]


class TinyModel(nn.Module):
    """``forward(batch, backends)`` -> ``(logits [T, vocab], hidden [T, hidden_dim])`` over all rows.

    ``aux_hidden_layers`` (EAGLE-3): the returned hidden states are the residual stream after
    each listed number of layers, concatenated (``0`` is the embeddings, ``num_layers`` the last
    layer's output before the final norm), instead of the final normed state.
    """

    def __init__(self, c: TinyConfig, device="cpu", aux_hidden_layers: Sequence[int] = ()) -> None:
        super().__init__()
        self.config = c
        bad = [i for i in aux_hidden_layers if not 0 <= i <= c.num_layers]
        if bad:
            raise ValueError(f"aux_hidden_layers {bad} outside 0..num_layers={c.num_layers}")
        self.aux_hidden_layers = tuple(aux_hidden_layers)
        if c.layer_pattern is not None and c.num_layers % len(c.layer_pattern):
            raise ValueError(f"num_layers={c.num_layers} is not a multiple of the layer pattern's "
                             f"{len(c.layer_pattern)} layers (a draft's layers would not mirror the target's types)")
        torch.manual_seed(c.seed)
        block = MLABlock if c.is_mla else GQABlock
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(block(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2 and p is not self.embed.weight:
                    p.mul_(2.0)  # livelier logits: fewer ties in greedy tests
        self.to(device=device, dtype=c.dtype)
        self.requires_grad_(False)   # inference only: graph pieces run outside no_grad too
        self.eval()

    @property
    def hidden_dim(self) -> int:
        """Width of the hidden states a forward returns."""
        return self.config.hidden_size * max(1, len(self.aux_hidden_layers))

    def output_hidden(self, final: torch.Tensor, states: Sequence[torch.Tensor]) -> torch.Tensor:
        """What a forward returns as hidden states: ``final`` ([T, hidden], after the norm), or the
        concatenation of ``states[i]`` (the stream after ``i`` layers) for the aux layers."""
        if not self.aux_hidden_layers:
            return final
        return torch.cat([states[i] for i in self.aux_hidden_layers], -1)    # [T, hidden * n_aux]

    def backends_per_layer(self, backends: Backends) -> list:
        if isinstance(backends, AttentionBackend):
            return [backends] * self.config.num_layers
        if len(backends) != self.config.num_layers:
            raise ValueError(f"{len(backends)} backends for {self.config.num_layers} layers")
        return list(backends)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, backends: Backends, input_embeds: Optional[torch.Tensor] = None):
        per_layer = self.backends_per_layer(backends)
        h = self.embed(batch.input_ids) if input_embeds is None else input_embeds.to(self.config.dtype)
        states = [h]
        c = self.config
        rope = rope_angles(batch.positions, c.qk_rope_head_dim if c.is_mla else c.head_dim, c.rope_theta)
        for block, be in zip(self.layers, per_layer):
            q, k, v = block.pre_attn(h, rope)
            o = attention_call(be, q, k, v, block.layer, batch)
            h = block.post_attn(h, o)
            states.append(h)
        final = self.norm(h)
        return self.lm_head(final).float(), self.output_hidden(final, states)
