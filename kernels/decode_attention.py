"""Paged GQA decode attention: split-KV pass plus a log-sum-exp merge pass.

One query row per request. Pass 1 runs one program per (request, KV head, split):
it loads every KV page of its split once and scores all query heads of the KV head
group against it (GQA), keeping an online softmax in float32. Split boundaries are
computed in the kernel from ``seq_lens_k`` on the device, so the grid depends only on
host ints (``bs``, ``Hkv``, ``num_kv_splits``) and the launch is CUDA-graph safe. From
``HEADS_FIRST_BS`` requests on, a request's KV heads are on the fastest grid axis.
Pass 2 (``merge_splits``, shared with the extend and MLA kernels) merges the per-split
partial outputs with their log-sum-exp; where a KV head's partials are small
(``fuse_merge``) the split program that finishes last merges them itself (``merge_if_last``),
one launch in all.

Layout: ``k_buffer [num_slots, Hkv, D]``, ``v_buffer [num_slots, Hkv, Dv]``; slot of
position t of request i = ``page_table[i, t // page_size] * page_size + t % page_size``.
"""

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .attention_core import (
    FP8_KV_DTYPES,
    LOG2E,
    check_fp8_widening,
    check_paged_inputs,
    fuse_merge,
    heads_first_grid,
    merge_chunk,
    merge_if_last,
    merge_splits,
    split_targets,
    store_partial,
)
from .chunk_kernels import chunk_of, merge_chunks_if_last
from .device_facts import device_sms
from .kv_walk import NO_MASK, feature_args, head_and_item, sink_state, slot64, walk_paged, window_lo
from .launch_record import launch, pow2
from .pdl import split_merge
from .schedule import check_schedule, chunk_launch

# Registers a thread the chunk pass may use (ptxas ``maxnreg``) where a tile of 16-bit KV is at most
# CHUNK_MAXNREG_ELEMS elements a head row (d128 x 32 tokens, d64 x 64), the query tile at most 16 heads
# (a GQA group of <= 16) and the batch has more than CHUNK_MAXNREG_BS requests: 8 programs an SM as the
# split pass's, against the compiler's 6-7 (``chunk_resident``). Larger tiles, groups of 32, FP8 caches and (at
# d128) batches of up to 16 spill at 64 on sm_90, and a small batch's grid fits the SMs anyway: those keep the
# compiler's count (bench/RESULTS.md, 'Ragged batches'). And only where the budget's programs take a wave
# fewer at 8 an SM than at the compiler's count (e.g. 6 < budget <= 8, 15.5, 31 an SM at 6): where both take as
# many the bound only slows each program (32/8 d128 bs 48, 11.6 an SM: 879 us bounded, 767 not).
# A budget of at most the compiler's count is one wave of it where the chunks stay within the budget: there
# the compiler's registers, and the wave fit (``chunk_kernels._balanced_per``) where the compiled pass holds
# fewer than the budget's programs an SM plus one (GQA 32/8 and 28/4 d128: 6 an SM), so that a ragged batch's
# whole chunks do not overrun one wave; where it holds more (8/1 d128, 32/8 d64: 7) the fit's longer chunks only
# cost balance (measured at 5.3-5.8 an SM: bench/RESULTS.md, 'Ragged batches'). Whole chunks overrun a budget by
# up to bs chunks a KV head (budget / splits a request programs an SM); "one an SM" is the measured rows' margin.
# The rules read the wrapper's default launch (4 warps, 2 stages): another keeps the compiler's registers, no fit.
CHUNK_MAXNREG = 64
CHUNK_MAXNREG_ELEMS = 128 * 32
CHUNK_MAXNREG_BS = 16
CHUNK_MAXNREG_HEADS = 16
CHUNK_MAXNREG_WAVE = 8
OFFLINE_SMS = 132     # an sm_90 card's (H100, H200): the rule's SMs where the tensors are on no GPU (offline compiles)
# A decode chunk's fewest KV tokens (the schedule's MIN_CHUNK_TOKENS is the other modes', whose chunks
# re-read W query rows): one row a chunk re-reads costs little, and at 256 a batch of 2-8 requests of
# 4096 tokens at one KV head ran on 32-128 programs, slower than at 64; at 4-8 KV heads equal within the
# noise (bench/RESULTS.md, 'Ragged batches').
DECODE_MIN_CHUNK_TOKENS = 64
# merge="pass" at S <= DECODE_FEW_LAST chunks a request: requests of at most pow2(S) chunks merged by their last
# chunk program in one load of their chunks (as the split pass merges), the rest by the pass. Its compile moves the
# chunk pass's registers, which the wave fit's rule reads (``chunk_resident``, by pow2(S)). Off (0): on at 8, the
# 36 decode rows through the backend ran 0.5-2.8 % faster on ten, up to 8 % slower on d64 and at bs 48 (RESULTS.md).
DECODE_FEW_LAST = 0


def decode_block_n(kv_dtype: torch.dtype, head_dim: int, schedule: str) -> int:
    """The KV tile of a decode launch: 64 tokens on FP8 caches, and at head dims <= 64 in the chunk passes; else 32."""
    return 64 if kv_dtype in FP8_KV_DTYPES or (schedule != "split" and head_dim <= 64) else 32


def _chunk_bound_fits(kv_dtype: torch.dtype, head_dim: int, block_n: int, bs: int, group: int) -> bool:
    return (kv_dtype in (torch.bfloat16, torch.float16) and head_dim * block_n <= CHUNK_MAXNREG_ELEMS
            and bs > CHUNK_MAXNREG_BS and group <= CHUNK_MAXNREG_HEADS)   # next_power_of_2(group) <= 16 as well


# GQA groups whose chunk pass holds 6 programs an SM at d128 (else 7 or more), by its FEW_LAST: triton 3.6's
# compiler's registers on sm_90 (79-80 against 62-72), checked by tests/kernels/test_offline_sm90.py.
_SIX_AN_SM = {0: (2, 3, 4, 5, 6, 7), 2: (1, 2, 3, 4), 4: (2, 3, 4), 8: (1, 3, 4, 5, 6, 7)}


def chunk_resident(head_dim: int, group: int, few: int = 0) -> int:
    """Programs an SM the chunk pass holds at the compiler's registers on sm_90 (4 warps), on the tiles the register
    bound serves, compiled with FEW_LAST ``few``: 6 at d128 for the groups of ``_SIX_AN_SM``, else 7 (groups of 8
    and 16, d64: at least 7)."""
    if few not in _SIX_AN_SM:
        raise ValueError(f"chunk_resident: FEW_LAST {few} not in {sorted(_SIX_AN_SM)}, the compiles measured "
                         "(DECODE_FEW_LAST <= 8, or pass maxnreg and fit)")
    return 6 if head_dim > 64 and group in _SIX_AN_SM[few] else 7


def few_last(num_kv_splits: int, schedule: str, merge: str) -> int:
    """The chunk pass's FEW_LAST at ``num_kv_splits`` chunks a request: pow2 up to DECODE_FEW_LAST, else 0."""
    few = merge == "pass" and schedule == "chunks" and 1 < num_kv_splits <= DECODE_FEW_LAST
    return pow2(num_kv_splits) if few else 0


def chunk_maxnreg(kv_dtype: torch.dtype, head_dim: int, block_n: int, bs: int, group: int = 1,
                  per_sm: Optional[float] = None, few: int = 0):
    """The chunk pass's register bound for ``bs`` requests of GQA ``group`` on a cache of ``kv_dtype``
    whose chunk budget is ``per_sm`` programs an SM (None: not known, the invariant schedule's), compiled with
    FEW_LAST ``few``, or None: the compiler's."""
    if not _chunk_bound_fits(kv_dtype, head_dim, block_n, bs, group):
        return None
    waves = (per_sm is None or math.ceil(per_sm / CHUNK_MAXNREG_WAVE)
             < math.ceil(per_sm / chunk_resident(head_dim, group, few)))
    return CHUNK_MAXNREG if waves else None


def chunk_fit(kv_dtype: torch.dtype, head_dim: int, block_n: int, bs: int, group: int = 1,
              per_sm: Optional[float] = None, few: int = 0) -> bool:
    """Whether the chunk pass of :func:`chunk_maxnreg`'s arguments asks for the wave fit: a budget of one
    wave at the compiler's registers (:func:`chunk_resident`), on the rows the bound serves, whose overrun (a
    program an SM) the compiled pass has no room for."""
    if per_sm is None or not _chunk_bound_fits(kv_dtype, head_dim, block_n, bs, group):
        return False
    held = chunk_resident(head_dim, group, few)
    return held < per_sm + 1 and per_sm <= held


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, o_ptr, lse_ptr, out_ptr, sem_ptr,
    scale_log2, v_scale, window, softcap_log2, sinks_ptr,
    stride_qb, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_pb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_xb, stride_xh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    FUSED: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
    HEADS_FIRST: tl.constexpr, CHUNK_DV: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr, SLOT64: tl.constexpr,
    PDL_TRIGGER: tl.constexpr = False,
):
    if PDL_TRIGGER:                 # the separate merge (merge_splits) may launch once every program has started
        tl.extra.cuda.gdc_launch_dependents()
    kvh, b, num_kvh = head_and_item(HEADS_FIRST)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    lo = 0
    if WINDOW:      # the one row sees its window's last `window` tokens: the splits cut those alone
        lo = window_lo(seq_len, 1, 0, 0, window, NO_MASK)
    # Splits are rounded up to whole BLOCK_N tiles so that only the last tile of a
    # split needs a bound mask; trailing splits may be empty (they write lse = -inf).
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V

    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    m_i, l_i = sink_state(sinks_ptr, heads, mask_h, split == 0, m_i, l_i, SINKS)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    pt_row = page_table_ptr + b * stride_pb
    m_i, l_i, acc = walk_paged(q, k_ptr, v_ptr, pt_row, start, end, kvh, stride_ks, stride_kh, stride_vs, stride_vh,
                               offs_d, mask_d, offs_dv, mask_dv, scale_log2, v_scale, m_i, l_i, acc, 0, 0, 0, 0, 0,
                               pt_row, 0, window, softcap_log2, PAGE_SIZE, BLOCK_N, NO_MASK, INPUT_PRECISION, WINDOW,
                               SOFTCAP, 1, SLOT64)

    o_off = b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_dv[None, :]
    store_partial(acc, m_i, l_i, o_ptr + o_off, mask_h[:, None] & mask_dv[None, :],
                  lse_ptr + b * stride_lb + heads * stride_lh + split, mask_h, NUM_SPLITS)
    if FUSED:  # out_ptr / sem_ptr: the output and this KV head's counter
        g = tl.arange(0, GROUP_PAD)
        hg = kvh * GROUP + g
        merge_if_last(sem_ptr + b * num_kvh + kvh, o_ptr + b * stride_ob + hg * stride_oh,
                      lse_ptr + b * stride_lb + hg * stride_lh, out_ptr + b * stride_xb + hg * stride_xh,
                      g < GROUP, stride_os, HEAD_DIM_V, GROUP_PAD, BLOCK_DV, NUM_SPLITS, BLOCK_S, CHUNK_DV,
                      NUM_SPLITS, 1)


@triton.jit
def _decode_chunk_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, o_ptr, lse_ptr, out_ptr, sem_ptr,
    scale_log2, v_scale, bs, num_chunks, window, softcap_log2, sinks_ptr,
    stride_qb, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_pb,
    stride_oc, stride_oh,
    stride_lc, stride_lh,
    stride_xb, stride_xh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr, FIXED_TILES: tl.constexpr,
    BLOCK_BS: tl.constexpr, INPUT_PRECISION: tl.constexpr, GROUP_PAD: tl.constexpr, CHUNK_DV: tl.constexpr,
    HEADS_FIRST: tl.constexpr, MERGE_LAST: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr, SLOT64: tl.constexpr,
    PDL_TRIGGER: tl.constexpr = False, FEW_LAST: tl.constexpr = 0,
):
    """The chunk schedule's split pass (``chunk_kernels.chunk_of``): program (KV head, chunk c); the grid
    covers the most chunks a schedule can make (``schedule.chunk_slots``), programs past the batch's
    last do nothing. One chunk a program: a loop over chunks cost the KV walk its pipelining.
    ``PDL_TRIGGER``: the merge pass may launch once every program has started (``ChunkLaunch.trigger``).
    ``FEW_LAST``: a request of at most that many chunks is merged by its last chunk program in one load of
    its chunks (``merge_if_last``), the separate pass merging the longer ones."""
    if PDL_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    kvh, c, num_kvh = head_and_item(HEADS_FIRST)
    b, first, count, start, end, total = chunk_of(seq_lens_ptr, c, bs, num_chunks, window, 1, seq_lens_ptr, BLOCK_N,
                                                  MIN_TILES, FIXED_TILES, BLOCK_BS, NO_MASK, WINDOW)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    if c < total:
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        m_i, l_i = sink_state(sinks_ptr, heads, mask_h, c == first, m_i, l_i, SINKS)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        pt_row = page_table_ptr + b.to(tl.int64) * stride_pb
        m_i, l_i, acc = walk_paged(q, k_ptr, v_ptr, pt_row, start, end, kvh, stride_ks, stride_kh, stride_vs,
                                   stride_vh, offs_d, mask_d, offs_dv, mask_dv, scale_log2, v_scale, m_i, l_i, acc, 0,
                                   0, 0, 0, 0, pt_row, 0, window, softcap_log2, PAGE_SIZE, BLOCK_N, NO_MASK,
                                   INPUT_PRECISION, WINDOW, SOFTCAP, 1, SLOT64)
        tile = mask_h[:, None] & mask_dv[None, :]
        if count == 1:                   # a whole request: its output, no partial
            store_partial(acc, m_i, l_i, out_ptr + b * stride_xb + heads[:, None] * stride_xh + offs_dv[None, :],
                          tile, lse_ptr, mask_h, 1)
        else:
            jj = c.to(tl.int64)
            store_partial(acc, m_i, l_i, o_ptr + jj * stride_oc + heads[:, None] * stride_oh + offs_dv[None, :],
                          tile, lse_ptr + jj * stride_lc + heads * stride_lh, mask_h, 2)
            g = tl.arange(0, GROUP_PAD)
            hg = kvh * GROUP + g
            f = first.to(tl.int64)
            if FEW_LAST > 1:
                if count <= FEW_LAST:
                    merge_if_last(sem_ptr + b * num_kvh + kvh, o_ptr + f * stride_oc + hg * stride_oh,
                                  lse_ptr + f * stride_lc + hg * stride_lh, out_ptr + b * stride_xb + hg * stride_xh,
                                  g < GROUP, stride_oc, HEAD_DIM_V, GROUP_PAD, BLOCK_DV, FEW_LAST, FEW_LAST, CHUNK_DV,
                                  count, stride_lc)
            if MERGE_LAST:           # else the separate pass merges (schedule.ChunkLaunch.merge_pass)
                merge_chunks_if_last(sem_ptr + b * num_kvh + kvh, count, o_ptr + f * stride_oc + hg * stride_oh,
                                     lse_ptr + f * stride_lc + hg * stride_lh, out_ptr + b * stride_xb + hg * stride_xh,
                                     g < GROUP, stride_oc, stride_lc, HEAD_DIM_V, GROUP_PAD, BLOCK_DV, CHUNK_DV)


def decode_attention_fwd(q, k_buffer, v_buffer, page_table, seq_lens_k, page_size, sm_scale,
                         num_kv_splits, out, workspace=None, block_n=None, num_warps=4,
                         num_stages=2, heads_first=None, schedule="split", merge="last", k_scale=1.0,
                         v_scale=1.0, window=None, softcap=None, sinks=None, maxnreg=..., fit=...):
    """Paged GQA decode attention, written into ``out``.

    Parameters
    ----------
    q : [bs, H, D] float16/bfloat16/float32
    k_buffer, v_buffer : [num_slots, Hkv, D] / [num_slots, Hkv, Dv], q's dtype or FP8
        (``attention_core.FP8_KV_DTYPES``: the cache holds value / scale)
    page_table : [>=bs, max_pages] int32; seq_lens_k : [>=bs] int32 (>= 1 each)
    page_size, num_kv_splits : host ints (fixed per captured graph)
    out : [bs, H, Dv], dtype of q
    workspace : optional ``(part [bs, H, S, Dv] f32, lse [bs, H, S] f32, counters)`` from
        ``decode_workspace``; allocated here when None (not inside a graph then).
    block_n : KV tokens a tile (None: 64 for an FP8 cache, and in the chunk passes where the head dims
        are <= 64, else 32: bench/RESULTS.md, 'Ragged batches' and 'FP8 KV')
    heads_first : a request's KV heads on the fastest grid axis (None: from ``HEADS_FIRST_BS``
        requests on, where it measured faster; ``attention_core.heads_first_grid``)
    schedule : "split": ``num_kv_splits`` equal splits of every request; "chunks": the batch's KV
        cut into about ``bs * num_kv_splits`` equal chunks on the device (``chunk_kernels.chunk_of``),
        ``workspace`` then from ``schedule.chunk_workspace`` (rows_per_chunk 1, chunks a request
        ``schedule.slots_per_request``); "invariant": chunks of ``INVARIANT_CHUNK_TOKENS`` whatever
        the batch (a request's output bitwise the same in any batch and bucket; ``num_kv_splits`` unused)
    merge : the chunk schedules' merge: "last" (a request's last chunk program, one launch) or
        "pass" (a second launch spread over rows, heads and columns: ``schedule.ChunkLaunch.merge_pass``)
    k_scale, v_scale : an FP8 cache's per-tensor scales (1.0 otherwise)
    window, softcap, sinks : the row sees its last ``window`` tokens (read alone); scores capped
        as ``softcap * tanh(s / softcap)``; ``sinks [H]``, a logit a head in the softmax's
        denominator (``AttentionLayer``'s; None: off)
    maxnreg : the chunk pass's register bound a thread (None: the compiler's; default: ``chunk_maxnreg``,
        read at the call)
    fit : the chunk schedule's wave fit (``chunk_kernels._balanced_per``; default: ``chunk_fit``)
    """
    bs, H, D = q.shape
    Hkv, Dv = k_buffer.shape[1], v_buffer.shape[2]
    check_paged_inputs("decode_attention_fwd", q, (k_buffer, v_buffer), page_table,
                       seq_lens_k, page_size, bs, fp8_ok=True, scales=(k_scale, v_scale))
    check_fp8_widening("decode_attention_fwd", q, k_buffer)
    if H % Hkv != 0 or k_buffer.shape[2] != D or v_buffer.shape[1] != Hkv:
        raise ValueError(f"decode_attention_fwd: q heads {H} x dim {D} incompatible with "
                         f"k_buffer {tuple(k_buffer.shape)} / v_buffer {tuple(v_buffer.shape)}")
    if tuple(out.shape) != (bs, H, Dv) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"decode_attention_fwd: out {tuple(out.shape)} {out.dtype}, "
                         f"expected ({bs}, {H}, {Dv}) {q.dtype} with contiguous last dim")
    if num_kv_splits < 1:
        raise ValueError(f"decode_attention_fwd: num_kv_splits={num_kv_splits} must be >= 1")
    check_schedule("decode_attention_fwd", schedule, merge)
    window, softcap_log2, sinks_arg, feats = feature_args("decode_attention_fwd", q, window, softcap, sinks)
    if bs == 0:
        return out
    group = H // Hkv
    # tl.dot needs M >= 16; spare head rows are masked out.
    block_h = max(16, pow2(group))
    group_pad, block_d, block_dv = pow2(group), pow2(D), pow2(Dv)
    if block_n is None:
        block_n = decode_block_n(k_buffer.dtype, max(D, Dv), schedule)
    if schedule != "split":
        few = few_last(num_kv_splits, schedule, merge)
        if maxnreg is ... or fit is ...:
            sms = device_sms(q.device) or OFFLINE_SMS
            per_sm = bs * Hkv * num_kv_splits / sms if schedule == "chunks" else None
            rule = (k_buffer.dtype, max(D, Dv), block_n, bs, H // Hkv, per_sm)
            default = (num_warps, num_stages) == (4, 2)      # the launch the rules were measured and compiled at
            maxnreg = (chunk_maxnreg(*rule, few=few) if default else None) if maxnreg is ... else maxnreg
            fit = (default and chunk_fit(*rule, few=few)) if fit is ... else fit
        cl = chunk_launch("decode_attention_fwd", out, workspace, bs, num_kv_splits, 1, Hkv, page_table, page_size,
                          schedule, block_n, heads_first, window, min_tokens=DECODE_MIN_CHUNK_TOKENS, fit=fit,
                          merged_upto=max(few, 1))
        part, lse = cl.part, cl.lse
        # int64 slots whatever the cache: the chunk pass's rules read its registers at int64 (chunk_resident);
        # at int32 it holds 7 an SM, not 6, and uniform batches ran 2-3 % slower (bench/RESULTS.md, 'Ragged batches')
        feats["SLOT64"] = True
        launch(_decode_chunk_kernel, cl.grid,
            q, k_buffer, v_buffer, page_table, seq_lens_k, part, lse, out, cl.counters,
            sm_scale * LOG2E * k_scale, v_scale, bs, cl.budget, window, softcap_log2, sinks_arg,
            q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
            v_buffer.stride(0), v_buffer.stride(1), page_table.stride(0),
            part.stride(0), part.stride(1), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            GROUP=group, BLOCK_H=block_h, HEAD_DIM=D, BLOCK_D=block_d,
            HEAD_DIM_V=Dv, BLOCK_DV=block_dv, PAGE_SIZE=page_size, BLOCK_N=block_n,
            INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", GROUP_PAD=group_pad,
            CHUNK_DV=merge_chunk(group_pad, block_dv, num_warps), MERGE_LAST=merge == "last",
            PDL_TRIGGER=merge == "pass" and cl.trigger, FEW_LAST=few,
            num_warps=num_warps, num_stages=num_stages, **cl.consts, **feats,
            **({} if maxnreg is None else dict(maxnreg=maxnreg)))
        if merge == "pass":
            cl.merge_pass(seq_lens_k, None, out)
        return out
    feats["SLOT64"] = slot64(k_buffer, v_buffer)       # the split pass: int32 slots where the cache allows
    fused = fuse_merge(group_pad, num_kv_splits, Dv, num_warps, workspace)
    block_s = pow2(num_kv_splits)
    o, lse, counters, o_strides, lse_strides = split_targets(
        "decode_attention_fwd", out, workspace, num_kv_splits, bs * Hkv if fused else 0)
    heads_first, grid = heads_first_grid("decode_attention_fwd", heads_first, bs, 1,
                                         (Hkv, bs, num_kv_splits), (bs, Hkv, num_kv_splits))
    launch(_decode_split_kernel, grid,
        q, k_buffer, v_buffer, page_table, seq_lens_k, o, lse, out, counters,
        sm_scale * LOG2E * k_scale, v_scale, window, softcap_log2, sinks_arg,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        page_table.stride(0),
        *o_strides, *lse_strides,
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_H=block_h,
        HEAD_DIM=D, BLOCK_D=block_d,
        HEAD_DIM_V=Dv, BLOCK_DV=block_dv,
        PAGE_SIZE=page_size, BLOCK_N=block_n, NUM_SPLITS=num_kv_splits,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FUSED=fused, GROUP_PAD=group_pad, BLOCK_S=block_s, HEADS_FIRST=heads_first,
        CHUNK_DV=merge_chunk(group_pad, block_dv, num_warps), num_warps=num_warps, num_stages=num_stages,
        PDL_TRIGGER=num_kv_splits > 1 and not fused and split_merge(q.device), **feats,
    )
    if num_kv_splits > 1 and not fused:
        merge_splits(o, lse, out)
    return out
