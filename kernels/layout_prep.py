"""The step's prep of a uniform mode in one launch: the pad rule written into the pad rows
of the inputs, in place, and the whole canonical layout built from the result.

What it computes is exactly :func:`attn_backends.layout.write_canonical_pad` followed by the
uniform builder (``_uniform`` and, for draft decode, ``draft_prefix_lens``) of
:mod:`attn_backends.layout`, which take about 30 launches; a captured step replays this prep
once per forward (eight times in an EAGLE step), so it is one graph node here instead of 30.

Rows ``r >= raw_bs`` (``raw_bs`` read from the device) are pad rows: request row 0, seq_len
``pad_seq_len``, tokens (ids, positions, slots) 0, accept length 1. Program ``r < bs`` writes
row ``r``: its pad values (pad rows only), ``cu_seqlens_q[r+1] = (r+1)*W``, ``prefix_lens =
seq - W``, ``seq_lens_k``, ``kv_last_page_len``, ``draft_prefix_lens = max(seq - W*step, 0)``,
its page-table row and its part of ``kv_indices`` (its offset is the sum of the earlier rows'
page counts, recomputed per program from the canonical lengths: a pad row's stored length is
never read, so a program rewriting it races with no reader). Trailing programs zero the unused
tail of ``kv_indices``. No allocation, no host sync.
"""
import torch
import triton
import triton.language as tl

from .index_build import page_row, zero_tail
from .launch_record import cdiv, pow2


@triton.jit
def _uniform_prep_kernel(
    req_ptr, seq_ptr, raw_bs_ptr, tok_ptr, tok_stride, accept_ptr, step_ptr,
    req_to_token_ptr, stride_rt, max_context,
    cu_q_ptr, prefix_ptr, seq_k_ptr, last_ptr, draft_prefix_ptr,
    page_table_ptr, stride_pt, max_pages, kv_indptr_ptr, kv_indices_ptr, capacity,
    bs, pad_seq, W, PAGE_SIZE,
    BLOCK_BS: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    HAS_TOKENS: tl.constexpr, HAS_ACCEPT: tl.constexpr, HAS_DRAFT: tl.constexpr,
):
    pid = tl.program_id(0)
    raw = tl.load(raw_bs_ptr)
    offs_b = tl.arange(0, BLOCK_BS)
    stored = tl.load(seq_ptr + offs_b, mask=offs_b < bs, other=0).to(tl.int32)
    lens = tl.where(offs_b < raw, stored, pad_seq)                 # canonical seq_lens
    counts = tl.where(offs_b < bs, (lens + PAGE_SIZE - 1) // PAGE_SIZE, 0)
    if pid < bs:
        real = pid < raw
        seq = tl.sum(tl.where(offs_b == pid, lens, 0), 0)
        n = tl.sum(tl.where(offs_b == pid, counts, 0), 0)
        start = tl.sum(tl.where(offs_b < pid, counts, 0), 0)
        row = tl.where(real, tl.load(req_ptr + pid), 0).to(tl.int64)
        pad = pid >= raw
        tl.store(req_ptr + pid, row.to(tl.int32), mask=pad)
        tl.store(seq_ptr + pid, seq, mask=pad)
        if HAS_TOKENS:
            w = tl.arange(0, BLOCK_W)
            at = pid * W + w
            zero = tl.zeros([BLOCK_W], tl.int64)
            for k in range(3):
                tl.store(tok_ptr + k * tok_stride + at, zero, mask=pad & (w < W))
        if HAS_ACCEPT:
            tl.store(accept_ptr + pid, 1, mask=pad)
        tl.store(cu_q_ptr + pid + 1, (pid + 1) * W)
        if pid == 0:
            tl.store(cu_q_ptr, 0)
            tl.store(kv_indptr_ptr + 1 + offs_b, tl.cumsum(counts, 0), mask=offs_b < bs)
            tl.store(kv_indptr_ptr, 0)
        tl.store(prefix_ptr + pid, seq - W)
        tl.store(seq_k_ptr + pid, seq)
        tl.store(last_ptr + pid, seq - (n - 1) * PAGE_SIZE)
        if HAS_DRAFT:
            step = tl.load(step_ptr)
            tl.store(draft_prefix_ptr + pid, tl.maximum(seq - W * step, 0))
        page_row(req_to_token_ptr, row, stride_rt, page_table_ptr, pid, stride_pt, kv_indices_ptr, start, n,
                 max_pages, max_context, capacity, PAGE_SIZE, BLOCK_P, True)
    else:
        zero_tail(kv_indices_ptr, counts, pid - bs, capacity, BLOCK_TAIL)


def uniform_prep(req_to_token: torch.Tensor, page_size: int, width: int, pad_seq_len: int,
                 req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, raw_bs: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, prefix_lens: torch.Tensor, seq_lens_k: torch.Tensor,
                 kv_last_page_len: torch.Tensor, page_table: torch.Tensor, kv_indptr: torch.Tensor,
                 kv_indices: torch.Tensor, tokens=None, accept_lens=None, draft_prefix_lens=None,
                 draft_step=None, max_bs: int = 0, max_width: int = 0) -> None:
    """One launch: pad rows of ``req_pool_indices`` / ``seq_lens`` [bs] int32 (and ``tokens``
    [3, >= bs*W] int64 rows of unit stride, ``accept_lens`` [bs] int32) written in place, then
    the layout buffers (int32; ``page_table`` [bs, max_pages] with unit column stride). ``raw_bs``
    and ``draft_step`` are [1] int32 device scalars; ``draft_prefix_lens`` needs ``draft_step``.
    ``max_bs`` / ``max_width``: the largest of the caller's keys (a step's), so that its keys
    share the block sizes (W and the page size are runtime values; Triton still compiles apart
    the integer arguments equal to 1 or divisible by 16)."""
    bs = req_pool_indices.shape[0]
    i32 = [req_pool_indices, seq_lens, raw_bs, cu_seqlens_q, prefix_lens, seq_lens_k, kv_last_page_len, page_table,
           kv_indptr, kv_indices, req_to_token] + [t for t in (accept_lens, draft_prefix_lens, draft_step)
                                                   if t is not None]
    bad = [t for t in i32 if t.dtype != torch.int32 or t.device != req_to_token.device or t.stride(-1) != 1]
    if bad or (tokens is not None and (tokens.dtype != torch.int64 or tokens.stride(-1) != 1)):
        raise ValueError("uniform_prep: int32 buffers (int64 tokens) with unit stride on one device expected")
    if (draft_prefix_lens is None) != (draft_step is None) or bs < 1 or page_table.shape[0] < bs:
        raise ValueError(f"uniform_prep: bs={bs}, page_table {tuple(page_table.shape)}, draft buffers "
                         f"{draft_prefix_lens is not None}/{draft_step is not None}")
    need = {"seq_lens": (seq_lens, bs), "cu_seqlens_q": (cu_seqlens_q, bs + 1), "kv_indptr": (kv_indptr, bs + 1),
            "prefix_lens": (prefix_lens, bs), "seq_lens_k": (seq_lens_k, bs),
            "kv_last_page_len": (kv_last_page_len, bs), "accept_lens": (accept_lens, bs),
            "draft_prefix_lens": (draft_prefix_lens, bs)}
    short = [f"{n} {t.numel()} < {k}" for n, (t, k) in need.items() if t is not None and t.numel() < k]
    if tokens is not None and (tokens.shape[0] != 3 or tokens.shape[1] < bs * width):
        short.append(f"tokens {tuple(tokens.shape)} < (3, {bs * width})")
    if short:
        raise ValueError(f"uniform_prep: buffers too small for bs={bs}, W={width}: {', '.join(short)}")
    capacity = kv_indices.numel()
    block_tail = 1024
    dummy = seq_lens
    _uniform_prep_kernel[(bs + cdiv(capacity, block_tail),)](
        req_pool_indices, seq_lens, raw_bs, tokens if tokens is not None else dummy,
        tokens.stride(0) if tokens is not None else 0, accept_lens if accept_lens is not None else dummy,
        draft_step if draft_step is not None else dummy,
        req_to_token, req_to_token.stride(0), req_to_token.shape[1],
        cu_seqlens_q, prefix_lens, seq_lens_k, kv_last_page_len,
        draft_prefix_lens if draft_prefix_lens is not None else dummy,
        page_table, page_table.stride(0), page_table.shape[1], kv_indptr, kv_indices, capacity,
        bs, pad_seq_len, width, page_size,
        BLOCK_BS=pow2(max(bs, max_bs)),
        BLOCK_P=min(256, pow2(page_table.shape[1])),
        BLOCK_W=pow2(max(width, max_width)),
        BLOCK_TAIL=block_tail, HAS_TOKENS=tokens is not None, HAS_ACCEPT=accept_lens is not None,
        HAS_DRAFT=draft_prefix_lens is not None,
    )
