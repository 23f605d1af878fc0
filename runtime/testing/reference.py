"""An independent float64 attention backend for the runner checks (I9 against a reference).

It shares nothing with the backends under test: no layout, no page table, no step. Each
request's K/V is gathered through ``req_to_token`` and its mask is derived from the batch's
definition (the layout contract of ``attn_backends/layout.py``: ``seq_lens`` includes this
forward's tokens; causal, tree and draft-branch rules), so a wrong causal or tree mask in a kernel,
or a mask offset taken from another request, shows as a difference even where replay and eager
agree. A layer's window, cap and sinks as issue #42 defines them: every token at its absolute
position (a tree-verify draft token at the prefix plus its depth, a draft-decode token at the
draft prefix plus its step), the cap on the scaled score, the sink a softmax column with no value.
Eager only; the output has q's dtype.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from attn_backends import ForwardMode, LayoutError
from attn_backends.base import AttentionBackend, Capabilities, GraphSupport
from attn_backends.config import FP8_KV

F64 = torch.float64


def visible(batch, i: int, prefix: int, n_new: int, seq_len: int) -> torch.Tensor:
    """``[n_new, seq_len]`` bool: may new token ``j`` of request ``i`` see position ``p``."""
    spec, mode = batch.spec_info, batch.forward_mode
    j = torch.arange(n_new)[:, None]
    p = torch.arange(seq_len)[None, :]
    if spec is not None and mode == ForwardMode.DECODE and spec.is_draft_decode:
        base = seq_len - spec.topk * spec.draft_step              # the prompt prefix before the branches
        return (p < base) | ((p >= base) & ((p - base) % spec.topk == j))
    if spec is not None and mode == ForwardMode.TARGET_VERIFY and spec.topk > 1:
        vis = (p < prefix).expand(n_new, seq_len).clone()
        vis[:, prefix:] = spec.tree_mask[i].cpu()
        return vis
    return p <= prefix + j


def token_positions(batch, i: int, prefix: int, n_new: int, seq_len: int) -> tuple:
    """``(rows [n_new], keys [seq_len])`` int64: the absolute position of request ``i``'s new
    tokens and of its KV entries (the entry index, but past a tree's prefix the depth, past a
    draft decode's prefix the step)."""
    spec, mode = batch.spec_info, batch.forward_mode
    keys, rows = torch.arange(seq_len), prefix + torch.arange(n_new)
    if spec is not None and mode == ForwardMode.DECODE and spec.is_draft_decode:
        base = seq_len - spec.topk * spec.draft_step
        keys = torch.where(keys < base, keys, base + (keys - base).div(spec.topk, rounding_mode="floor"))
        rows = torch.full((n_new,), base + spec.draft_step - 1)
    elif spec is not None and mode == ForwardMode.TARGET_VERIFY and spec.topk > 1:
        depth = spec.tree_mask[i].cpu().long().sum(-1) - 1                  # ancestors, itself excluded
        keys = torch.cat([keys[:prefix], prefix + depth])
        rows = prefix + depth
    return rows, keys


class Float64Reference(AttentionBackend):
    """Dense float64 attention per request, from first principles (eager only)."""

    name: ClassVar[str] = "float64_reference"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                         ForwardMode.DRAFT_EXTEND}), mha=True, mla=True, topk_gt1=True, graph=GraphSupport.NEVER,
        kv_dtypes=FP8_KV, windows=True, sinks=True, softcap=True)

    def init_forward_metadata(self, batch) -> None:
        self.forward_metadata = batch

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        pass                    # runners built for their eager path call it; nothing to allocate

    def init_forward_metadata_capture_cuda_graph(self, inputs) -> None:
        raise LayoutError(f"{self.name} runs eagerly only")

    init_forward_metadata_replay_cuda_graph = init_forward_metadata_capture_cuda_graph

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def graph_buffers(self) -> dict:
        return {}

    def forward(self, q, k, v, layer, batch, save_kv_cache: bool = True):
        if save_kv_cache:
            self.memory.pool.store(layer.layer_id, batch.out_cache_loc, k, v, layer.k_scale, layer.v_scale)
        pool, mem = self.memory.pool, self.memory
        if mem.is_mla:
            kc = pool.kv[layer.layer_id]
            vc = kc[..., :self.config.kv_lora_rank]       # MLA's one scale: k_scale == v_scale (the config's rule)
        else:
            kc, vc = pool.k[layer.layer_id], pool.v[layer.layer_id]
        seq = batch.seq_lens_cpu.tolist()
        new = batch.extend_seq_lens_cpu.tolist() if batch.forward_mode == ForwardMode.EXTEND \
            else [batch.width] * batch.batch_size
        out = torch.zeros(q.shape[0], q.shape[1], vc.shape[-1], dtype=q.dtype, device=q.device)
        row = 0
        for i in range(batch.raw_bs):
            n = new[i]
            slots = mem.req_to_token[int(batch.req_pool_indices[i]), :seq[i]].long()
            kk, vv = kc[slots].to(F64) * layer.k_scale, vc[slots].to(F64) * layer.v_scale   # [S, Hkv, D], dequantized
            rep = q.shape[1] // kk.shape[1]
            kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
            s = torch.einsum("qhd,khd->hqk", q[row:row + n].to(F64), kk) * layer.scaling
            if layer.softcap is not None:
                s = layer.softcap * torch.tanh(s / layer.softcap)
            vis = visible(batch, i, seq[i] - n, n, seq[i])
            if layer.window is not None:
                rows, keys = token_positions(batch, i, seq[i] - n, n, seq[i])
                vis = vis & (keys[None, :] > rows[:, None] - layer.window)
            s = s.masked_fill(~vis.to(q.device)[None], float("-inf"))
            if layer.sinks is not None:             # a column of the softmax, dropped: no value
                sink = layer.sinks.to(device=q.device, dtype=F64)[:, None, None].expand(-1, n, 1)
                p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
            else:
                p = torch.softmax(s, -1)
            vv = torch.where(vis.any(0).to(q.device)[:, None, None], vv, 0)   # KV no row sees may hold NaN
            out[row:row + n] = torch.einsum("hqk,khd->qhd", p, vv).to(q.dtype)
            row += n
        return out
