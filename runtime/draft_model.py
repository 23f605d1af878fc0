"""EAGLE draft models for the tiny targets: a shared trunk plus seeded noise, so that the
draft's agreement with the target is a knob (``noise``), from always accepted to rarely.

The draft runs the target's own first ``num_layers`` blocks (the same weights) over its own KV
layers (pool layers ``target_layers..`` of the shared :class:`KVMemory`, same slots as the
target), then the target's final norm and LM head, plus ``noise`` times a seeded random head.
Its input at position ``p`` is the embedding of token ``p`` plus ``noise`` times a seeded
projection of the target's *features* at ``p - 1``: the target's final hidden state (EAGLE) or
its auxiliary layers' residual streams concatenated (EAGLE-3). The head's logits are divided
by ``temperature`` (< 1: a confident draft, as a trained EAGLE head is; the argmax is unchanged),
which is what the tree's rerank by cumulative log-probability reads. The features live in a per-slot
pool (``features [num_slots, feature_dim]``) written by the worker after each target forward and
read here through ``req_to_token``, so the draft reads them inside its captured graphs without
any extra input. Draft-decode rows (tokens the target has not seen) read no features.

Alignment: the draft is one token ahead of the target. When the target's KV holds positions
``0..T-1`` and the pending token sits at ``T``, the draft's KV holds ``0..T``; its last row
predicts position ``T+1``.

With ``noise == 0`` and all target layers in the trunk, the draft computes the target's own
next-token distribution, so drafts are accepted unless rounding flips a near tie. A cheaper
draft (fewer layers) is a model of its own (the target's first layers, its own KV layers, the
target's final norm and head): it reads the target's weights and never writes them, so it is
accepted less often, and the output stays the target's. It agrees exactly only with a target
whose top layers cannot change its argmax: :func:`make_top_layers_skippable` builds one, which
a user asks for explicitly (``EngineConfig.skippable_from``: the benchmarks do).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import nn

from attn_backends import ForwardBatch, ForwardMode, KVMemory

from .attention_hook import attention_call
from .models import TinyModel

# draft noise per acceptance level of the tiny models; tests/runtime/test_eagle.py holds their order
# (mean accept length high > mid > low)
ACCEPTANCE_LEVELS = {"high": 0.0, "mid": 0.1, "low": 1.0}


def eagle3_layers(num_layers: int) -> tuple:
    """EAGLE-3's auxiliary layers: a low, a middle and the top residual stream."""
    return tuple(sorted({0, num_layers // 2, num_layers}))


def pool_layers(memory: KVMemory) -> int:
    pool = memory.pool
    return len(pool.kv if memory.is_mla else pool.k)


class SharedBlock(nn.Module):
    """A target block's weights under another attention layer id (the draft's own KV layer)."""

    def __init__(self, block: nn.Module, layer) -> None:
        super().__init__()
        self.block, self.layer = block, layer

    def pre_attn(self, h, positions):
        return self.block.pre_attn(h, positions)

    def post_attn(self, h, o):
        return self.block.post_attn(h, o)


class DraftHead(nn.Module):
    """The target's LM head plus ``noise`` times a seeded random head of the same scale, over
    ``temperature``."""

    def __init__(self, head: nn.Linear, noise: float, temperature: float, generator: torch.Generator) -> None:
        super().__init__()
        self.head, self.noise, self.temperature = head, noise, temperature
        w = head.weight
        self.perturb = nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            self.perturb.weight.copy_(torch.randn(w.shape, generator=generator) * float(w.float().std()))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.head(h)
        if self.noise:
            out = out + self.noise * self.perturb(h)
        return out / self.temperature


class DraftModel(nn.Module):
    """``forward(batch, backends, input_embeds=None)`` -> ``(logits [T, vocab], hidden [T, hidden])``,
    the interface of :class:`TinyModel`, so every runner drives it the same way."""

    def __init__(self, target: TinyModel, memory: KVMemory, *, num_layers: Optional[int] = None,
                 noise: float = 0.0, temperature: float = 1.0, seed: int = 1) -> None:
        super().__init__()
        c = target.config
        k = c.num_layers if num_layers is None else num_layers
        if not 1 <= k <= c.num_layers:
            raise ValueError(f"draft num_layers={k} outside 1..{c.num_layers} (the target's layers)")
        if pool_layers(memory) < c.num_layers + k:
            raise ValueError(f"the KV memory has {pool_layers(memory)} layers; the target and the draft need "
                             f"{c.num_layers} + {k}")
        if noise < 0 or temperature <= 0:
            raise ValueError(f"noise={noise} must be >= 0 and temperature={temperature} > 0")
        self.config, self.noise = replace(c, num_layers=k), noise
        attn = replace(c, num_layers=c.num_layers + k).attention()
        self.embed, self.norm = target.embed, target.norm
        # draft layer i: target block i's weights (its sink logits too) over the draft's own KV layer
        self.layers = nn.ModuleList(SharedBlock(target.layers[i], attn.layer(c.num_layers + i,
                                                                             getattr(target.layers[i], "sinks", None)))
                                    for i in range(k))
        g = torch.Generator().manual_seed(seed)
        self.lm_head = DraftHead(target.lm_head, noise, temperature, g)
        self.feature_dim = target.hidden_dim
        self.fc = nn.Linear(self.feature_dim, c.hidden_size, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(self.fc.weight.shape, generator=g) / self.feature_dim ** 0.5)
        dev = memory.device
        self.lm_head.perturb.to(device=dev, dtype=c.dtype)
        self.fc.to(device=dev, dtype=c.dtype)
        self.requires_grad_(False)
        self.req_to_token = memory.req_to_token
        self.features = torch.zeros(memory.num_slots, self.feature_dim, dtype=c.dtype, device=dev)  # [slots, F]

    def backends_per_layer(self, backends) -> list:
        if isinstance(backends, (list, tuple)):
            if len(backends) != len(self.layers):
                raise ValueError(f"{len(backends)} backends for {len(self.layers)} draft layers")
            return list(backends)
        return [backends] * len(self.layers)

    def output_hidden(self, final: torch.Tensor, states) -> torch.Tensor:
        return final

    def input_embeds(self, batch: ForwardBatch) -> torch.Tensor:
        """``[T, hidden]``: token embeddings plus ``noise * fc(features at p - 1)``."""
        e = self.embed(batch.input_ids)
        spec = batch.spec_info
        if spec is not None and spec.is_draft_decode:
            return e                                  # branch tokens: the target has no features yet
        req = batch.req_pool_indices.long()
        if batch.forward_mode == ForwardMode.EXTEND:
            req = req.repeat_interleave(batch.extend_seq_lens.long(), output_size=batch.num_tokens)
        else:                                          # uniform: W rows per request (no host sync under capture)
            req = req[:, None].expand(-1, batch.width).reshape(-1)
        prev = batch.positions - 1
        slot = self.req_to_token[req, prev.clamp(min=0)].long()
        f = torch.where((prev >= 0)[:, None], self.features[slot], 0)                   # [T, F]
        return e + self.noise * self.fc(f)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, backends, input_embeds: Optional[torch.Tensor] = None):
        per_layer = self.backends_per_layer(backends)
        h = self.input_embeds(batch) if input_embeds is None else input_embeds.to(self.config.dtype)
        for block, be in zip(self.layers, per_layer):
            q, k, v = block.pre_attn(h, batch.positions)
            o = attention_call(be, q, k, v, block.layer, batch)
            h = block.post_attn(h, o)
        h = self.norm(h)
        return self.lm_head(h).float(), h


def make_top_layers_skippable(target: TinyModel, trunk_layers: int) -> None:
    """Make layers ``trunk_layers..`` unable to change the target's greedy tokens, so that a draft
    of ``trunk_layers`` layers agrees with it exactly at ``noise == 0``: they write only into the
    last quarter of the residual dimensions, which the LM head ignores (the final RMSNorm then
    scales a row's logits by one positive factor, which keeps the argmax). They still run real
    attention over their own KV: the target costs what its layer count says."""
    c = target.config
    if not 1 <= trunk_layers <= c.num_layers:
        raise ValueError(f"trunk_layers={trunk_layers} outside 1..{c.num_layers}")
    if trunk_layers == c.num_layers:
        return
    s = c.hidden_size - c.hidden_size // 4
    with torch.no_grad():
        for block in target.layers[trunk_layers:]:
            block.o.weight[:s].zero_()
            block.mlp.down.weight[:s].zero_()
        target.lm_head.weight[:, s:].zero_()
