"""The KV walk the paged GQA kernels share: a request's tokens ``[start, end)`` in ``BLOCK_N``-token
tiles through its page-table row, each tile one online-softmax step (``paged_tile_update``), with
the extend kernels' masks (``visible_mask``) or none (decode). The split and the chunk passes of
``decode_attention`` and ``extend_attention`` differ only in which range a program walks.
"""
import triton
import triton.language as tl

from .attention_core import paged_tile_update

MASK_KINDS = {"causal": 0, "tree": 1, "draft": 2}
NO_MASK = tl.constexpr(-1)      # decode: every token of the range is visible


@triton.jit
def visible_mask(offs_n, j, q_len, seq_len, prefix, draft_prefix, mask_ptr, mask_base,
                 MASK: tl.constexpr):
    """[BLOCK_M, BLOCK_N] visibility of KV positions offs_n for query indices j."""
    vis = (offs_n[None, :] < seq_len) & (j[:, None] < q_len)
    if MASK == 0:
        vis = vis & (offs_n[None, :] <= prefix + j[:, None])
    elif MASK == 1:
        rel = offs_n[None, :] - prefix
        in_tail = vis & (rel >= 0)
        bits = tl.load(mask_ptr + mask_base + j[:, None] * q_len + rel, mask=in_tail, other=0)
        vis = vis & ((rel < 0) | (bits != 0))
    else:
        rel = offs_n[None, :] - draft_prefix
        vis = vis & ((rel < 0) | (rel % q_len == j[:, None]))
    return vis


@triton.jit
def head_and_item(HEADS_FIRST: tl.constexpr):
    """``(KV head, item, KV heads)`` of a program of the grid ``(Hkv, items, ...)`` where
    ``HEADS_FIRST`` (an item's KV heads adjacent: they read the same tokens' rows of the cache),
    else ``(items, Hkv, ...)``; the item is a request or a chunk."""
    kvh = tl.program_id(1)
    item = tl.program_id(0)
    num_kvh = tl.num_programs(1)
    if HEADS_FIRST:
        kvh = tl.program_id(0)
        item = tl.program_id(1)
        num_kvh = tl.num_programs(0)
    return kvh, item, num_kvh


@triton.jit
def walk_paged(q, k_ptr, v_ptr, pt_row, start, end, kvh, stride_ks, stride_kh, stride_vs, stride_vh,
               offs_d, mask_d, offs_dv, mask_dv, scale_log2, v_scale, m_i, l_i, acc,
               j, q_len, seq_len, prefix, draft_prefix, mask_ptr, mask_base,
               PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Tokens ``[start, end)`` of the request whose page-table row is ``pt_row`` into the running
    ``(m_i, l_i, acc)``; ``MASK``: a ``MASK_KINDS`` value (with the row indices ``j`` and the
    mask's inputs) or ``NO_MASK``."""
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(pt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE  # int64: slot*stride can pass 2^31
        vis = mask_n[None, :]
        if MASK >= 0:
            vis = vis & visible_mask(offs_n, j, q_len, seq_len, prefix, draft_prefix, mask_ptr, mask_base, MASK)
        m_i, l_i, acc = paged_tile_update(
            q, k_ptr, v_ptr, slot, mask_n, vis, kvh, stride_ks, stride_kh, stride_vs, stride_vh,
            offs_d, mask_d, offs_dv, mask_dv, scale_log2, v_scale, m_i, l_i, acc, INPUT_PRECISION)
    return m_i, l_i, acc
