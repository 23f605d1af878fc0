"""``torch_native``: the reference backend, written for clarity, in plain PyTorch.

Every mode, MHA/GQA and absorbed MLA, causal / tree / draft-branch masks, any page size.
One vectorised path for every mode: queries are laid out as ``[bs, max_seq_len_q]`` and
keys as ``[bs, max_seq_len_k]`` positions gathered through the page table, so the same
code runs eagerly and under a CUDA graph (shapes come from host ints only).
Accumulation in float32; the output has the query's dtype.

It defines the semantics of a layer's window, sinks and softcap (``AttentionLayer``): scores
``s = q.k * scaling`` are capped first (``c * tanh(s / c)``), then masked; the window keeps the
keys whose absolute position is within ``window - 1`` of the query row's own (:func:`positions`:
a tree-verify draft token sits at the prefix plus its depth, a draft-decode token at the draft
prefix plus its step); a head's sink logit joins its softmax as a column with no value.
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


def positions(lay: Layout, k_pos: torch.Tensor) -> torch.Tensor:
    """``[bs, K]`` int64: the absolute (token) position of each request's KV entry ``k_pos``. The
    entry's index, except past the prefix of a tree verify (draft token ``j`` is at ``prefix +
    depth(j)``, its ancestors in the tree mask minus itself) and of a draft decode (the ``W``
    branches' step-``t`` tokens all sit at ``draft_prefix + t``): entries are stored in draft order,
    tokens are positioned by the path that leads to them."""
    kp = k_pos[None, :].expand(lay.bs, -1)
    if lay.mask == MaskKind.TREE:
        w, prefix = lay.width, lay.prefix_lens.long()[:, None]
        depth = lay.custom_mask.view(lay.bs, w, w).sum(-1) - 1             # [bs, W]
        return torch.where(kp < prefix, kp, prefix + torch.gather(depth, 1, (kp - prefix).clamp(0, w - 1)))
    if lay.mask == MaskKind.DRAFT:
        base = lay.draft_prefix_lens.long()[:, None]
        return torch.where(kp < base, kp, base + (kp - base).div(lay.width, rounding_mode="floor"))
    return kp


def in_window(lay: Layout, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``[bs, Q, K]`` bool: KV entry ``k_pos`` within ``window`` positions of query row ``q_pos``,
    whose own entry is ``prefix + q_pos`` (every mode writes a row's KV before reading it)."""
    kpos = positions(lay, k_pos)                                            # [bs, K]
    own = (lay.prefix_lens.long()[:, None] + q_pos[None, :]).clamp(0, k_pos.shape[0] - 1)   # a bad layout: no crash
    qpos = torch.gather(kpos, 1, own)                                       # [bs, Q]
    return kpos[:, None, :] > qpos[:, :, None] - window


def paged_attention(q, k_cache, v_cache, lay: Layout, scaling: float, k_scale: float = 1.0,
                    v_scale: float = 1.0, window=None, softcap=None, sinks=None) -> torch.Tensor:
    """``q [T, H, D]`` against the paged cache ``k_cache [slots, Hkv, D]``,
    ``v_cache [slots, Hkv, Dv]`` -> ``[T, H, Dv]`` in ``q.dtype``; the cache dequantized to float32
    (``value * scale``, an FP8 cache's per-tensor scales); ``window``, ``softcap``, ``sinks [H]``
    as ``AttentionLayer`` defines them (None: none)."""
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
    ok = visible(lay, q_pos, k_pos)
    if ok.shape[1] != nq:       # a tree mask's W rows against a layout's other row count (a bad layout): its
        ok = torch.nn.functional.pad(ok, (0, 0, 0, max(0, nq - ok.shape[1])))[:, :nq]   # rows, no crash
    if window is not None:
        ok = ok & in_window(lay, q_pos, k_pos, window)
    # KV no row sees (past a request's length: the reserved page where padding rows store their
    # K/V; before every row's window) may hold garbage or NaN: its probability is 0, but
    # 0 * NaN = NaN, so zero its values first.
    seen = (ok & q_ok[:, :, None]).any(1)                                # [bs, nk]
    vv = torch.where(seen[:, :, None, None], v_cache[slot].float() * v_scale, 0.0)  # [bs, nk, Hkv, Dv]
    if h != hkv:
        kk = kk.repeat_interleave(h // hkv, dim=2)
        vv = vv.repeat_interleave(h // hkv, dim=2)
    qq = q[q_row].float()                                                # [bs, nq, H, D]
    s = torch.einsum("bqhd,bkhd->bhqk", qq, kk) * scaling
    if softcap is not None:                                              # before the mask: -inf stays -inf
        s = softcap * torch.tanh(s / softcap)
    ok = ok | ~q_ok[:, :, None]                                          # dropped rows: no NaN
    s = s.masked_fill(~ok[:, None], float("-inf"))
    if sinks is not None:                                                # a last column, with no value
        sink = sinks.to(device=dev, dtype=torch.float32)[None, :, None, None].expand(*s.shape[:3], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    o = torch.einsum("bhqk,bkhd->bqhd", p, vv)                           # [bs, nq, H, Dv]
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
        graph=GraphSupport.UNIFORM_BATCH, devices=("cpu", "cuda"), kv_dtypes=FP8_KV, fp8_min_sm=0,
        windows=True, sinks=True, softcap=True)

    def _run(self, q: torch.Tensor, layer: AttentionLayer, meta: ForwardMetadata) -> torch.Tensor:
        pool, lid = self.memory.pool, layer.layer_id
        extra = dict(window=layer.window, softcap=layer.softcap, sinks=layer.sinks)
        if self.config.is_mla:
            kv = pool.kv[lid]                                             # [slots, 1, 576]
            return paged_attention(q, kv, kv[..., :self.config.kv_lora_rank], meta.layout, layer.scaling,
                                   layer.k_scale, layer.v_scale, **extra)
        return paged_attention(q, pool.k[lid], pool.v[lid], meta.layout, layer.scaling, layer.k_scale,
                               layer.v_scale, **extra)
