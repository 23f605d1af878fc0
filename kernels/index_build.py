"""Build paged attention indices from the request-to-token table, in place.

From ``req_to_token [max_reqs+1, max_context]`` (row 0 reserved, all zeros),
``req_pool_indices [bs]`` and ``seq_lens [bs]`` this writes, into buffers the caller
allocated once (graph-static):

* ``page_table [bs, max_pages]`` int32: page ids of each row, zeros past its
  ``cdiv(seq_len, page_size)`` pages;
* ``kv_indptr [bs+1]`` int32: cumulative pages per row, ``kv_indptr[0] = 0``;
* ``kv_indices [capacity]`` int32: the rows' page ids back to back, zeros past
  ``kv_indptr[bs]``.

Pages are page-aligned, so page j of a row is ``req_to_token[r, j*page_size] // page_size``.
No allocation, no host sync: programs 0..bs-1 each fill one row (its flat offset is the
sum of the earlier rows' page counts, recomputed per program from seq_lens), and the
trailing programs zero the unused tail of kv_indices. Writes past ``max_pages`` columns or
``capacity`` entries are dropped: callers size the buffers for the worst case.
"""

import torch
import triton
import triton.language as tl

from .launch_record import cdiv, pow2


@triton.jit
def page_row(req_to_token_ptr, row, stride_rt, page_table_ptr, pid, stride_pt, kv_indices_ptr, start, n,
             max_pages, max_context, capacity, PAGE_SIZE: tl.constexpr, BLOCK_P: tl.constexpr,
             WRITE_FLAT: tl.constexpr):
    """Row ``pid`` of the page table (its ``n`` pages from request row ``row`` of the token
    table, zeros after them) and, with ``WRITE_FLAT``, its pages at ``kv_indices[start:]``."""
    for p0 in range(0, max_pages, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        valid = (p < n) & (p * PAGE_SIZE < max_context)
        tok = tl.load(req_to_token_ptr + row * stride_rt + p * PAGE_SIZE, mask=valid, other=0)
        page = tl.where(valid, tok // PAGE_SIZE, 0)
        tl.store(page_table_ptr + pid.to(tl.int64) * stride_pt + p, page, mask=p < max_pages)
        if WRITE_FLAT:
            tl.store(kv_indices_ptr + start + p, page, mask=valid & (start + p < capacity))


@triton.jit
def zero_tail(kv_indices_ptr, counts, block, capacity, BLOCK_TAIL: tl.constexpr):
    """Block ``block`` of the flat indices past the rows' pages (``counts`` summed), zeroed."""
    offs = block * BLOCK_TAIL + tl.arange(0, BLOCK_TAIL)
    tl.store(kv_indices_ptr + offs, tl.zeros([BLOCK_TAIL], tl.int32),
             mask=(offs >= tl.sum(counts, 0)) & (offs < capacity))


@triton.jit
def _build_index_kernel(
    req_to_token_ptr, req_pool_ptr, seq_lens_ptr,
    page_table_ptr, kv_indptr_ptr, kv_indices_ptr,
    bs, max_pages, max_context, capacity,
    stride_rt, stride_pt,
    PAGE_SIZE: tl.constexpr, BLOCK_BS: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_TAIL: tl.constexpr, WRITE_FLAT: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_BS)
    lens = tl.load(seq_lens_ptr + offs_b, mask=offs_b < bs, other=0).to(tl.int32)
    counts = (lens + PAGE_SIZE - 1) // PAGE_SIZE  # [BLOCK_BS] pages per row
    if pid < bs:
        start = tl.sum(tl.where(offs_b < pid, counts, 0), 0)
        n = tl.sum(tl.where(offs_b == pid, counts, 0), 0)
        row = tl.load(req_pool_ptr + pid).to(tl.int64)
        page_row(req_to_token_ptr, row, stride_rt, page_table_ptr, pid, stride_pt, kv_indices_ptr, start, n,
                 max_pages, max_context, capacity, PAGE_SIZE, BLOCK_P, WRITE_FLAT)
        if WRITE_FLAT:
            if pid == 0:
                tl.store(kv_indptr_ptr + 1 + offs_b, tl.cumsum(counts, 0), mask=offs_b < bs)
                tl.store(kv_indptr_ptr, 0)
    else:
        zero_tail(kv_indices_ptr, counts, pid - bs, capacity, BLOCK_TAIL)


def build_page_indices(req_to_token, req_pool_indices, seq_lens, page_size, page_table,
                       kv_indptr=None, kv_indices=None):
    """Fill ``page_table`` (and ``kv_indptr`` / ``kv_indices`` when given) in place.

    Parameters
    ----------
    req_to_token : [max_reqs+1, max_context] int32 (row 0 reserved)
    req_pool_indices : [bs] int32/int64; seq_lens : [bs] int32/int64
    page_size : host int
    page_table : [>=bs, max_pages] int32, contiguous columns (rows >= bs untouched)
    kv_indptr : [>=bs+1] int32; kv_indices : [capacity] int32 (both or neither)
    """
    name = "build_page_indices"
    bs = req_pool_indices.shape[0]
    dev = req_to_token.device
    if (kv_indptr is None) != (kv_indices is None):
        raise ValueError(f"{name}: pass both kv_indptr and kv_indices, or neither")
    if page_size < 1:
        raise ValueError(f"{name}: page_size={page_size} must be >= 1")
    if seq_lens.shape[0] != bs:
        raise ValueError(f"{name}: seq_lens has {seq_lens.shape[0]} rows, req_pool_indices {bs}")
    for t_name, t, dtypes in [("req_to_token", req_to_token, (torch.int32,)),
                              ("req_pool_indices", req_pool_indices, (torch.int32, torch.int64)),
                              ("seq_lens", seq_lens, (torch.int32, torch.int64)),
                              ("page_table", page_table, (torch.int32,)),
                              ("kv_indptr", kv_indptr, (torch.int32,)),
                              ("kv_indices", kv_indices, (torch.int32,))]:
        if t is None:
            continue
        if t.dtype not in dtypes or t.device != dev:
            raise ValueError(f"{name}: {t_name} is {t.dtype} on {t.device}, expected one of "
                             f"{dtypes} on {dev}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {t_name} needs a contiguous last dim, stride={t.stride()}")
    if page_table.dim() != 2 or page_table.shape[0] < bs:
        raise ValueError(f"{name}: page_table {tuple(page_table.shape)} needs >= {bs} rows")
    if kv_indptr is not None and kv_indptr.numel() < bs + 1:
        raise ValueError(f"{name}: kv_indptr has {kv_indptr.numel()} entries, needs {bs + 1}")
    if bs == 0:
        if kv_indptr is not None:
            kv_indptr[:1].zero_()
            kv_indices.zero_()
        return page_table
    capacity = 0 if kv_indices is None else kv_indices.numel()
    block_tail = 1024
    grid = (bs + cdiv(capacity, block_tail),)
    _build_index_kernel[grid](
        req_to_token, req_pool_indices, seq_lens,
        page_table, kv_indptr if kv_indptr is not None else page_table,
        kv_indices if kv_indices is not None else page_table,
        bs, page_table.shape[1], req_to_token.shape[1], capacity,
        req_to_token.stride(0), page_table.stride(0),
        PAGE_SIZE=page_size, BLOCK_BS=pow2(bs),
        BLOCK_P=min(256, pow2(page_table.shape[1])),
        BLOCK_TAIL=block_tail, WRITE_FLAT=kv_indices is not None,
    )
    return page_table
