"""The plain-Triton MLA tile's parts, shared by the split pass (``attention._mla_split_kernel``)
and the chunk pass (``balanced``): the tile's query rows, its online softmax over a KV token
range, and its store. Layout and masks: ``attention``'s docstring."""

import triton
import triton.language as tl

from ..extend_attention import visible_mask


@triton.jit
def _mla_tile(q_a, q_b, q_pe, lat_a, lat_b, rope, m_i, l_i, acc_a, acc_b, offs_n, end, j, q_len,
              seq_len, prefix, draft_prefix, mask_ptr, mask_base, scale_log2,
              MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One KV tile: scores over all 576 columns (two latent halves + rope), online softmax,
    then P . V into both output halves."""
    s = tl.dot(q_a, tl.trans(lat_a), input_precision=INPUT_PRECISION)
    s = tl.dot(q_b, tl.trans(lat_b), s, input_precision=INPUT_PRECISION)
    s = tl.dot(q_pe, tl.trans(rope), s, input_precision=INPUT_PRECISION) * scale_log2
    vis = (offs_n[None, :] < end) & visible_mask(offs_n, j, q_len, seq_len, prefix, draft_prefix,
                                                 mask_ptr, mask_base, MASK)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # row masked in this tile
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(lat_a.dtype)
    acc_a = acc_a * alpha[:, None] + tl.dot(p, lat_a, input_precision=INPUT_PRECISION)
    acc_b = acc_b * alpha[:, None] + tl.dot(p, lat_b, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc_a, acc_b


@triton.jit
def _mla_rows(q_ptr, cu_q_ptr, b, wb, hb, stride_qt, stride_qh, W, NUM_HEADS: tl.constexpr,
              BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr,
              RAGGED: tl.constexpr):
    """Row r of a program's tile is query row j = wb*BLOCK_W + r // BLOCK_H of request b, head
    hb*BLOCK_H + r % BLOCK_H: ``(row0, q_len, j, heads, row_ok, q_a, q_b, q_pe)``, the query in
    two latent halves (columns 0..255 and 256..511, bounding the register tiles) and its rope."""
    BLOCK_M: tl.constexpr = BLOCK_W * BLOCK_H
    HALF: tl.constexpr = LATENT // 2
    if RAGGED:  # EXTEND: rows cu[b]..cu[b+1]; W is only the host bound that sized the grid
        row0 = tl.load(cu_q_ptr + b).to(tl.int64)
        q_len = tl.load(cu_q_ptr + b + 1) - tl.load(cu_q_ptr + b)
    else:
        row0 = b.to(tl.int64) * W
        q_len = W
    offs_m = tl.arange(0, BLOCK_M)
    j = wb * BLOCK_W + offs_m // BLOCK_H
    heads = hb * BLOCK_H + offs_m % BLOCK_H
    row_ok = (j < q_len) & (heads < NUM_HEADS)
    offs_c = tl.arange(0, HALF)
    q_row = q_ptr + (row0 + j)[:, None] * stride_qt + heads[:, None] * stride_qh
    q_a = tl.load(q_row + offs_c[None, :], mask=row_ok[:, None], other=0.0)  # [M, 256]
    q_b = tl.load(q_row + HALF + offs_c[None, :], mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(q_row + LATENT + tl.arange(0, ROPE)[None, :], mask=row_ok[:, None], other=0.0)  # [M, 64]
    return row0, q_len, j, heads, row_ok, q_a, q_b, q_pe


@triton.jit
def _mla_walk(q_a, q_b, q_pe, kv_ptr, pt_row, start, end, j, q_len, seq_len, prefix, draft_prefix, mask_ptr,
              mask_base, scale_log2, stride_kvs, BLOCK_M: tl.constexpr, LATENT: tl.constexpr,
              ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
              INPUT_PRECISION: tl.constexpr):
    """The tile's online softmax over KV tokens ``[start, end)`` of the request whose page-table
    row is ``pt_row``: ``(m_i, l_i, acc_a, acc_b)``."""
    HALF: tl.constexpr = LATENT // 2
    # A tile-aligned split never crosses a page when PAGE_SIZE % BLOCK_N == 0: one page
    # lookup per tile and a scalar base instead of per-row slots.
    IN_PAGE: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc_b = tl.zeros([BLOCK_M, HALF], tl.float32)
    offs_c = tl.arange(0, HALF)
    offs_r = tl.arange(0, ROPE)
    offs_t = tl.arange(0, BLOCK_N)
    tile_a = offs_t[:, None].to(tl.int64) * stride_kvs + offs_c[None, :]
    tile_b = offs_t[:, None].to(tl.int64) * stride_kvs + HALF + offs_c[None, :]
    tile_r = offs_t[:, None].to(tl.int64) * stride_kvs + LATENT + offs_r[None, :]
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_t
        mask_n = offs_n < end
        if IN_PAGE:
            page = tl.load(pt_row + n0 // PAGE_SIZE)
            base = kv_ptr + (page.to(tl.int64) * PAGE_SIZE + n0 % PAGE_SIZE) * stride_kvs
            lat_a = tl.load(base + tile_a, mask=mask_n[:, None], other=0.0)
            lat_b = tl.load(base + tile_b, mask=mask_n[:, None], other=0.0)
            rope = tl.load(base + tile_r, mask=mask_n[:, None], other=0.0)
        else:
            page = tl.load(pt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
            slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
            kv_row = kv_ptr + slot[:, None] * stride_kvs
            lat_a = tl.load(kv_row + offs_c[None, :], mask=mask_n[:, None], other=0.0)
            lat_b = tl.load(kv_row + HALF + offs_c[None, :], mask=mask_n[:, None], other=0.0)
            rope = tl.load(kv_row + LATENT + offs_r[None, :], mask=mask_n[:, None], other=0.0)
        if lat_a.dtype.is_fp8():        # an FP8 cache widened on load; its scale: the caller's
            lat_a, lat_b, rope = lat_a.to(q_a.dtype), lat_b.to(q_a.dtype), rope.to(q_a.dtype)
        m_i, l_i, acc_a, acc_b = _mla_tile(
            q_a, q_b, q_pe, lat_a, lat_b, rope, m_i, l_i, acc_a, acc_b, offs_n, end, j, q_len,
            seq_len, prefix, draft_prefix, mask_ptr, mask_base, scale_log2, MASK, INPUT_PRECISION)
    return m_i, l_i, acc_a, acc_b


@triton.jit
def _mla_store(o_rows, lse_rows, m_i, l_i, acc_a, acc_b, row_ok, v_scale, LATENT: tl.constexpr,
               WRITE_LSE: tl.constexpr):
    """The tile's normalised output, times ``v_scale`` (an FP8 cache's: V is the cache), at
    ``o_rows`` ([M, 1] pointers to column 0) and, with WRITE_LSE, its log2-sum-exp at ``lse_rows``
    (-inf where a row saw nothing)."""
    HALF: tl.constexpr = LATENT // 2
    offs_c = tl.arange(0, HALF)
    nonempty = l_i > 0
    inv_l = v_scale / tl.where(nonempty, l_i, 1.0)
    out_a = tl.where(nonempty[:, None], acc_a * inv_l[:, None], 0.0)
    tl.store(o_rows + offs_c[None, :], out_a.to(o_rows.dtype.element_ty), mask=row_ok[:, None])
    out_b = tl.where(nonempty[:, None], acc_b * inv_l[:, None], 0.0)
    tl.store(o_rows + HALF + offs_c[None, :], out_b.to(o_rows.dtype.element_ty), mask=row_ok[:, None])
    if WRITE_LSE:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(lse_rows, lse, mask=row_ok)
