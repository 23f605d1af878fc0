"""``torch_native``: the reference backend, written for clarity, in plain PyTorch.

Every mode, MHA/GQA and absorbed MLA, causal / tree / draft-branch masks, any page size.
One vectorised path for every mode: queries are laid out as ``[bs, max_seq_len_q]`` and
keys as ``[bs, max_seq_len_k]`` positions gathered through the page table, so the same
code runs eagerly and under a CUDA graph (shapes come from host ints only).
Accumulation in float32; the output has the query's dtype.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from ..base import Capabilities, ForwardMetadata, GraphSupport, LayoutBackend
from ..batch import ForwardMode
from ..config import FP8_KV, AttentionLayer
from ..layout import Layout, MaskKind

ALL_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                       ForwardMode.DRAFT_EXTEND})


def visible(lay: Layout, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``[bs, Q, K]`` bool: may query row ``q_pos`` (within its request) see KV position ``k_pos``."""
    prefix = lay.prefix_lens.long()[:, None, None]
    qp, kp = q_pos[None, :, None], k_pos[None, None, :]
    in_kv = kp < lay.seq_lens_k.long()[:, None, None]
    if lay.mask == MaskKind.CAUSAL:
        return in_kv & (kp <= prefix + qp)
    if lay.mask == MaskKind.TREE:
        w = lay.width
        tree = lay.custom_mask.view(lay.bs, w, w)                        # [bs, W, W]
        d = (kp - prefix).clamp(0, w - 1).expand(lay.bs, w, -1)          # [bs, W, K]
        return in_kv & ((kp < prefix) | torch.gather(tree, 2, d))
    if lay.mask == MaskKind.DRAFT:
        base = lay.draft_prefix_lens.long()[:, None, None]
        return in_kv & ((kp < base) | ((kp - base) % lay.width == qp))
    raise ValueError(f"unknown mask kind {lay.mask}")


def paged_attention(q, k_cache, v_cache, lay: Layout, scaling: float, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """``q [T, H, D]`` against the paged cache ``k_cache [slots, Hkv, D]``,
    ``v_cache [slots, Hkv, Dv]`` -> ``[T, H, Dv]`` in ``q.dtype``; the cache dequantized to float32
    (``value * scale``, an FP8 cache's per-tensor scales)."""
    ps = lay.page_size
    nq, nk = lay.max_seq_len_q, lay.max_seq_len_k
    dev = q.device
    h, hkv = q.shape[1], k_cache.shape[1]
    # query rows: [bs, nq] indices into q, clamped; rows past a request's length are dropped.
    q_pos = torch.arange(nq, device=dev)
    q_len = (lay.cu_seqlens_q[1:] - lay.cu_seqlens_q[:-1]).long()
    q_row = lay.cu_seqlens_q[:-1].long()[:, None] + q_pos[None, :]        # [bs, nq]
    q_ok = q_pos[None, :] < q_len[:, None]
    q_row = torch.where(q_ok, q_row, 0)
    # key positions -> slots through the page table: [bs, nk]
    k_pos = torch.arange(nk, device=dev)
    slot = lay.page_table.long()[:, k_pos // ps] * ps + k_pos % ps
    kk = k_cache[slot].float() * k_scale                                 # [bs, nk, Hkv, D]
    # Positions past a request's length read through the reserved page, where padding rows store
    # their K/V (garbage, NaN): their probability is 0, but 0 * NaN = NaN, so zero them first.
    in_kv = k_pos[None, :] < lay.seq_lens_k.long()[:, None]              # [bs, nk]
    vv = torch.where(in_kv[:, :, None, None], v_cache[slot].float() * v_scale, 0.0)  # [bs, nk, Hkv, Dv]
    if h != hkv:
        kk = kk.repeat_interleave(h // hkv, dim=2)
        vv = vv.repeat_interleave(h // hkv, dim=2)
    qq = q[q_row].float()                                                # [bs, nq, H, D]
    s = torch.einsum("bqhd,bkhd->bhqk", qq, kk) * scaling
    ok = visible(lay, q_pos, k_pos) | ~q_ok[:, :, None]                 # dropped rows: no NaN
    s = s.masked_fill(~ok[:, None], float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), vv)    # [bs, nq, H, Dv]
    out = torch.empty(q.shape[0] + 1, h, v_cache.shape[2], device=dev, dtype=q.dtype)
    # scatter back; dropped rows go to the extra last row
    dst = torch.where(q_ok, q_row, q.shape[0])
    out[dst.reshape(-1)] = o.reshape(-1, h, v_cache.shape[2]).to(q.dtype)
    return out[:-1]


class TorchNativeBackend(LayoutBackend):
    """MHA/GQA over ``k``/``v`` pools; MLA absorbed over the ``[latent 512, rope 64]`` pool,
    output in latent space (``v`` is the latent part of the same rows)."""

    name: ClassVar[str] = "torch_native"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=ALL_MODES, mha=True, mla=True, page_sizes=(1, 16, 64), topk_gt1=True,
        graph=GraphSupport.UNIFORM_BATCH, devices=("cpu", "cuda"), kv_dtypes=FP8_KV, fp8_min_sm=0)

    def _run(self, q: torch.Tensor, layer: AttentionLayer, meta: ForwardMetadata) -> torch.Tensor:
        pool, lid = self.memory.pool, layer.layer_id
        if self.config.is_mla:
            kv = pool.kv[lid]                                             # [slots, 1, 576]
            return paged_attention(q, kv, kv[..., :self.config.kv_lora_rank], meta.layout, layer.scaling,
                                   layer.k_scale, layer.v_scale)
        return paged_attention(q, pool.k[lid], pool.v[lid], meta.layout, layer.scaling, layer.k_scale, layer.v_scale)
