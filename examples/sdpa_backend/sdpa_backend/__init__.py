"""An example plugin backend: MHA/GQA paged attention through ``torch.nn.functional.
scaled_dot_product_attention``, in every mode, eagerly and under CUDA graphs.

It subclasses :class:`attn_backends.LayoutBackend`, so the canonical layout of each step (from
the view of the step it is handed) arrives as ``meta.layout`` and the backend
writes one method, ``_run``. The mask rules it implements are the contract's
(the masks of docs/plugin-guide.md); the KV pool is ``self.memory.pool`` (``k[layer]``,
``v[layer]``: ``[num_slots, Hkv, D]``; the slot of position ``p`` of request ``i`` is
``page_table[i, p // page_size] * page_size + p % page_size``).
"""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from attn_backends import Capabilities, ForwardMode, GraphSupport, LayoutBackend
from attn_backends.layout import Layout, MaskKind

MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND})


def visible(lay: Layout, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``[bs, Q, K]`` bool: may query row ``q_pos`` of each request see KV position ``k_pos``."""
    prefix = lay.prefix_lens.long()[:, None, None]                       # [bs, 1, 1]
    qp, kp = q_pos[None, :, None], k_pos[None, None, :]
    ok = kp < lay.seq_lens_k.long()[:, None, None]
    if lay.mask == MaskKind.CAUSAL:          # row j sees the prefix and the new tokens up to itself
        return ok & (kp <= prefix + qp)
    if lay.mask == MaskKind.TREE:            # the prefix, then the W x W draft block of custom_mask
        w = lay.width
        block = lay.custom_mask.view(lay.bs, w, w)
        rel = (kp - prefix).clamp(0, w - 1).expand(lay.bs, w, -1)
        return ok & ((kp < prefix) | torch.gather(block, 2, rel))
    base = lay.draft_prefix_lens.long()[:, None, None]   # DRAFT: the prompt, then its own branch
    return ok & ((kp < base) | ((kp - base) % lay.width == qp))


class SdpaBackend(LayoutBackend):
    """MHA/GQA through SDPA over the gathered pages of each request."""

    name: ClassVar[str] = "example_sdpa"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=MODES, mha=True, mla=False, page_sizes=(1, 16, 64), topk_gt1=True,
        graph=GraphSupport.UNIFORM_BATCH, devices=("cpu", "cuda"), preference=-1)

    def _run(self, q: torch.Tensor, layer, meta) -> torch.Tensor:
        lay = meta.layout
        k_cache, v_cache = self.memory.pool.k[layer.layer_id], self.memory.pool.v[layer.layer_id]
        nq, nk, ps, dev = lay.max_seq_len_q, lay.max_seq_len_k, lay.page_size, q.device
        q_pos, k_pos = torch.arange(nq, device=dev), torch.arange(nk, device=dev)
        q_len = (lay.cu_seqlens_q[1:] - lay.cu_seqlens_q[:-1]).long()
        q_ok = q_pos[None, :] < q_len[:, None]                                  # [bs, Q]
        q_row = torch.where(q_ok, lay.cu_seqlens_q[:-1].long()[:, None] + q_pos[None, :], 0)
        slot = lay.page_table.long()[:, k_pos // ps] * ps + k_pos % ps          # [bs, K]
        mask = visible(lay, q_pos, k_pos) | ~q_ok[:, :, None]                   # dropped rows: any key
        seen = mask.any(1)                                                      # [bs, K]
        # positions no row may see are zeroed, so that stale or NaN slots cannot leak through
        k = torch.where(seen[..., None, None], k_cache[slot], 0).transpose(1, 2)   # [bs, Hkv, K, D]
        v = torch.where(seen[..., None, None], v_cache[slot], 0).transpose(1, 2)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        o = F.scaled_dot_product_attention(q[q_row].transpose(1, 2), k, v, attn_mask=mask[:, None],
                                           scale=layer.scaling)                  # [bs, H, Q, Dv]
        out = torch.empty(q.shape[0] + 1, q.shape[1], v.shape[-1], device=dev, dtype=q.dtype)
        out[torch.where(q_ok, q_row, q.shape[0]).reshape(-1)] = o.transpose(1, 2).reshape(-1, *out.shape[1:])
        return out[:-1]
