"""Paged GQA extend / verify attention with causal, tree and draft-branch masks.

Query rows of request i are ``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]``; they attend to the
request's whole KV extent (prefix and the new tokens, which were stored in the cache
first) through the page table. One program handles BLOCK_Q query rows times every query
head of one KV head group, flattened into BLOCK_M = BLOCK_Q * GROUP_PAD rows, so each KV
tile is loaded once per group and, for verify (W <= 8), once per request. An optional
split-KV axis (merged by ``merge_splits``, or by the tile's last split program where its
partials are small: ``fuse_merge``) adds parallelism for short queries over long caches.

The grid is ``(cdiv(max_q_len, BLOCK_Q) * num_kv_splits, bs, Hkv)``, from host ints only
(``max_q_len`` is a bound given by the caller, e.g. W), so the launch is graph safe;
programs past a request's rows do no work. Query blocks of one request and KV head are
adjacent on the fastest axis, so their repeated KV tile reads hit L2. From ``HEADS_FIRST_BS``
requests on, with one query block a request (``heads_first_grid``), the grid is
``(Hkv, cdiv(max_q_len, BLOCK_Q) * num_kv_splits, bs)``: a request's KV heads, which read the
same tokens' contiguous runs of the cache, are adjacent instead.

Masks (query row j of request i, KV position p, prefix = seq_lens_k[i] - q_len_i):
  causal: p <= prefix + j
  tree:   p < prefix or custom_mask[i*W*W + j*W + (p - prefix)]     (uniform W rows)
  draft:  p < draft_prefix_lens[i] or (p - draft_prefix_lens[i]) % W == j
"""

import torch
import triton
import triton.language as tl

from .attention_core import (
    LOG2E,
    check_fp8_widening,
    check_paged_inputs,
    fit_block_n,
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
from .kv_walk import (  # noqa: F401  (visible_mask: mla.attention's)
    MASK_KINDS,
    feature_args,
    head_and_item,
    sink_state,
    visible_mask,
    walk_paged,
    window_lo,
)
from .launch_record import cdiv, launch, pow2
from .schedule import check_schedule, chunk_launch


@triton.jit
def _extend_split_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, cu_q_ptr, mask_ptr, draft_prefix_ptr,
    o_ptr, lse_ptr, out_ptr, sem_ptr,
    scale_log2, v_scale, window, softcap_log2, sinks_ptr,
    stride_qt, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_pb,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    stride_xt, stride_xh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    FUSED: tl.constexpr, BLOCK_S: tl.constexpr, HEADS_FIRST: tl.constexpr, CHUNK_DV: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr, BLOCK_W: tl.constexpr,
    SLOT64: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    if HEADS_FIRST:  # a request's KV heads adjacent: they read the same pages' rows
        kvh = tl.program_id(0)
        qs = tl.program_id(1)
        b = tl.program_id(2)
        num_qb = tl.num_programs(1) // NUM_SPLITS
        num_kvh = tl.num_programs(0)
    else:
        qs = tl.program_id(0)
        b = tl.program_id(1)
        kvh = tl.program_id(2)
        num_qb = tl.num_programs(0) // NUM_SPLITS
        num_kvh = tl.num_programs(2)
    qb = qs % num_qb
    split = qs // num_qb

    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len
    draft_prefix = 0
    if MASK == 2:
        draft_prefix = tl.load(draft_prefix_ptr + b)
    mask_base = b.to(tl.int64) * q_len * q_len  # tree masks are uniform W x W blocks

    # Row r of the tile is query index j = qb*BLOCK_Q + r // GROUP_PAD of head g = r % GROUP_PAD.
    offs_m = tl.arange(0, BLOCK_M)
    j = qb * BLOCK_Q + offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    row_ok = (j < q_len) & (g < GROUP)
    heads = kvh * GROUP + g
    rows = (q_start + j).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # KV extent this tile can see: causal rows stop at prefix + last row; a tile past
    # the request's rows (the grid is sized for max_q_len) sees nothing.
    kv_end = seq_len
    if MASK == 0:
        kv_end = tl.minimum(seq_len, prefix + qb * BLOCK_Q + BLOCK_Q)
    kv_end = tl.where(qb * BLOCK_Q < q_len, kv_end, 0)
    lo = 0
    if WINDOW:      # the block's rows see nothing before their window (kv_walk.window_lo)
        lo = tl.minimum(window_lo(seq_len, q_len, draft_prefix, qb * BLOCK_Q, window, MASK), kv_end)
    split_len = tl.cdiv(tl.cdiv(kv_end - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i, l_i = sink_state(sinks_ptr, heads, row_ok, split == 0, m_i, l_i, SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    pt_row = page_table_ptr + b * stride_pb
    m_i, l_i, acc = walk_paged(q, k_ptr, v_ptr, pt_row, start, end, kvh, stride_ks, stride_kh, stride_vs, stride_vh,
                               offs_d, mask_d, offs_dv, mask_dv, scale_log2, v_scale, m_i, l_i, acc, j, q_len, seq_len,
                               prefix, draft_prefix, mask_ptr, mask_base, window, softcap_log2, PAGE_SIZE, BLOCK_N,
                               MASK, INPUT_PRECISION, WINDOW, SOFTCAP, BLOCK_W, SLOT64)

    o_off = rows[:, None] * stride_ot + heads[:, None] * stride_oh + split * stride_os
    store_partial(acc, m_i, l_i, o_ptr + o_off + offs_dv[None, :], row_ok[:, None] & mask_dv[None, :],
                  lse_ptr + rows * stride_lt + heads * stride_lh + split, row_ok, NUM_SPLITS)
    if FUSED:  # out_ptr / sem_ptr: the output and this tile's counter
        tile = (b * num_qb + qb) * num_kvh + kvh
        merge_if_last(sem_ptr + tile, o_ptr + rows * stride_ot + heads * stride_oh,
                      lse_ptr + rows * stride_lt + heads * stride_lh,
                      out_ptr + rows * stride_xt + heads * stride_xh, row_ok, stride_os, HEAD_DIM_V,
                      BLOCK_M, BLOCK_DV, NUM_SPLITS, BLOCK_S, CHUNK_DV, NUM_SPLITS, 1)


@triton.jit
def _extend_chunk_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, cu_q_ptr, mask_ptr, draft_prefix_ptr,
    o_ptr, lse_ptr, out_ptr, sem_ptr,
    scale_log2, v_scale, bs, num_chunks, rows_per_chunk, window, softcap_log2, sinks_ptr,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pb,
    stride_ot, stride_oh, stride_lt, stride_lh, stride_xt, stride_xh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr, FIXED_TILES: tl.constexpr,
    BLOCK_BS: tl.constexpr, MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr, CHUNK_DV: tl.constexpr,
    HEADS_FIRST: tl.constexpr, MERGE_LAST: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr, BLOCK_W: tl.constexpr,
    SLOT64: tl.constexpr, PDL_TRIGGER: tl.constexpr = False,
):
    """The chunk schedule (``chunk_kernels.chunk_of``) over requests whose rows fit one tile (verify,
    draft rows): program (KV head, chunk c) scores the request's every row against its chunk;
    chunk c's partials are rows ``c * rows_per_chunk + j`` of the workspace. ``PDL_TRIGGER``: the merge
    pass may launch once every program has started (``ChunkLaunch.trigger``)."""
    if PDL_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    kvh, c, num_kvh = head_and_item(HEADS_FIRST)
    b, first, count, start, end, total = chunk_of(seq_lens_ptr, c, bs, num_chunks, window, rows_per_chunk,
                                                  draft_prefix_ptr, BLOCK_N, MIN_TILES, FIXED_TILES, BLOCK_BS, MASK,
                                                  WINDOW)
    offs_m = tl.arange(0, BLOCK_M)
    j = offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    heads = kvh * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V
    if c < total:                # one chunk a program (see _decode_chunk_kernel)
        q_start = tl.load(cu_q_ptr + b)
        q_len = tl.load(cu_q_ptr + b + 1) - q_start
        seq_len = tl.load(seq_lens_ptr + b)
        draft_prefix = 0
        if MASK == 2:
            draft_prefix = tl.load(draft_prefix_ptr + b)
        row_ok = (j < q_len) & (g < GROUP)
        rows = (q_start + j).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & mask_d[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        m_i, l_i = sink_state(sinks_ptr, heads, row_ok, c == first, m_i, l_i, SINKS)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        pt_row = page_table_ptr + b.to(tl.int64) * stride_pb
        m_i, l_i, acc = walk_paged(q, k_ptr, v_ptr, pt_row, start, end, kvh, stride_ks, stride_kh, stride_vs,
                                   stride_vh, offs_d, mask_d, offs_dv, mask_dv, scale_log2, v_scale, m_i, l_i, acc, j,
                                   q_len, seq_len, seq_len - q_len, draft_prefix, mask_ptr,
                                   b.to(tl.int64) * q_len * q_len, window, softcap_log2, PAGE_SIZE, BLOCK_N, MASK,
                                   INPUT_PRECISION, WINDOW, SOFTCAP, BLOCK_W, SLOT64)
        tile = row_ok[:, None] & mask_dv[None, :]
        if count == 1:                   # a whole request: its output, no partial
            store_partial(acc, m_i, l_i, out_ptr + rows[:, None] * stride_xt + heads[:, None] * stride_xh
                          + offs_dv[None, :], tile, lse_ptr, row_ok, 1)
        else:
            mine = c.to(tl.int64) * rows_per_chunk + j
            store_partial(acc, m_i, l_i, o_ptr + mine[:, None] * stride_ot + heads[:, None] * stride_oh
                          + offs_dv[None, :], tile, lse_ptr + mine * stride_lt + heads * stride_lh, row_ok, 2)
            if MERGE_LAST:           # else the separate pass merges (schedule.ChunkLaunch.merge_pass)
                at = first.to(tl.int64) * rows_per_chunk + j
                sem = sem_ptr + b * num_kvh + kvh
                outs = out_ptr + rows * stride_xt + heads * stride_xh
                merge_chunks_if_last(sem, count, o_ptr + at * stride_ot + heads * stride_oh,
                                     lse_ptr + at * stride_lt + heads * stride_lh, outs, row_ok,
                                     rows_per_chunk * stride_ot, rows_per_chunk * stride_lt, HEAD_DIM_V, BLOCK_M,
                                     BLOCK_DV, CHUNK_DV)


def pick_block_q(max_q_len, group_pad, max_rows=64):
    """Query rows per tile: all W rows of a verify request when they fit in max_rows,
    and at least 16 rows in all (tl.dot needs M >= 16)."""
    block_q = min(pow2(max(max_q_len, 1)), max(1, max_rows // group_pad))
    return max(block_q, 16 // min(group_pad, 16))


def chunk_fits(max_q_len, group) -> bool:
    """Whether requests of at most ``max_q_len`` rows of a KV group of ``group`` heads fit one
    tile, as the chunk schedule needs (verify, draft rows; not prefill)."""
    return cdiv(max_q_len, pick_block_q(max_q_len, pow2(group))) == 1


def wide_verify_tile(max_q_len, rows):
    """Whether a tile of ``rows`` rows (query rows x padded KV-group heads) over requests of at
    most ``max_q_len`` rows is the 32-row verify tile (GQA 64/8 verify4), which runs 2 warps
    (16 rows a warp, as the 16-row tiles run with 4) and 3 stages of 64-token KV tiles."""
    return max_q_len <= 4 and rows == 32


def extend_attention_fwd(q, k_buffer, v_buffer, page_table, seq_lens_k, cu_seqlens_q,
                         page_size, sm_scale, max_q_len, out, mask="causal", custom_mask=None,
                         draft_prefix_lens=None, num_kv_splits=1, workspace=None, block_q=None,
                         block_n=None, num_warps=None, num_stages=None, heads_first=None, fuse=None,
                         schedule="split", merge="last", k_scale=1.0, v_scale=1.0, window=None, softcap=None,
                         sinks=None):
    """Paged extend / verify attention, written into ``out``.

    Parameters
    ----------
    q : [T, H, D]; k_buffer [num_slots, Hkv, D], v_buffer [num_slots, Hkv, Dv] (q's dtype, or FP8
        holding value / scale: ``k_scale``, ``v_scale``, the per-tensor scales)
    page_table : [>=bs, max_pages] int32; seq_lens_k : [>=bs] int32
    cu_seqlens_q : [bs+1] int32 with ``cu[bs] == T`` (rows past cu[bs] are undefined)
    page_size, max_q_len, num_kv_splits : host ints; ``max_q_len`` bounds every
        request's rows (it sizes the grid; rows beyond it are not computed)
    out : [T, H, Dv], q's dtype
    mask : "causal" | "tree" (needs ``custom_mask`` bool/uint8 [bs*W*W], uniform W rows)
        | "draft" (needs ``draft_prefix_lens`` [bs] int32, uniform W rows)
    workspace : ``decode_workspace(T, H, Dv, num_kv_splits)`` when num_kv_splits > 1 (its
        counters must number ``bs * cdiv(max_q_len, block_q) * Hkv`` where the merge is fused)
    heads_first : a request's KV heads on the fastest grid axis (None: from ``HEADS_FIRST_BS``
        requests on, for one query block a request, where it measured faster;
        ``attention_core.heads_first_grid``)
    fuse : whether the split pass merges its own partials (``merge_if_last``; None:
        ``attention_core.fuse_merge``'s rule; True: fused, where there are splits to merge (with
        one split nothing is merged), the workspace holding counters or None; False: the
        separate merge pass)
    schedule : "split" (``num_kv_splits`` equal splits of every request) or "chunks" (the batch's
        KV cut into about ``bs * num_kv_splits`` equal chunks on the device, ``chunk_kernels.chunk_of``;
        every request's rows in one tile, ``chunk_fits``; ``workspace`` from
        ``schedule.chunk_workspace`` with ``max_q_len`` rows a chunk and
        ``schedule.slots_per_request`` chunks a request), or "invariant" (fixed chunks: a
        request's output bitwise the same in any batch and bucket; ``num_kv_splits`` unused)
    merge : the chunk schedules' merge, "last" or "pass" (as ``decode_attention_fwd``'s)
    window, softcap, sinks : as ``decode_attention_fwd``'s, a row's window measured from its own
        position (``kv_walk.key_positions``: a tree's rows by depth, draft branches by step)
    """
    name = "extend_attention_fwd"
    T, H, D = q.shape
    bs = cu_seqlens_q.shape[0] - 1
    Hkv, Dv = k_buffer.shape[1], v_buffer.shape[2]
    check_paged_inputs(name, q, (k_buffer, v_buffer), page_table, seq_lens_k, page_size, bs, fp8_ok=True,
                       scales=(k_scale, v_scale))
    check_fp8_widening(name, q, k_buffer)
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.device != q.device:
        raise ValueError(f"{name}: cu_seqlens_q must be int32 on {q.device}, got "
                         f"{cu_seqlens_q.dtype} on {cu_seqlens_q.device}")
    if H % Hkv != 0 or k_buffer.shape[2] != D or v_buffer.shape[1] != Hkv:
        raise ValueError(f"{name}: q heads {H} x dim {D} incompatible with k_buffer "
                         f"{tuple(k_buffer.shape)} / v_buffer {tuple(v_buffer.shape)}")
    if tuple(out.shape) != (T, H, Dv) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"{name}: out {tuple(out.shape)} {out.dtype}, expected "
                         f"({T}, {H}, {Dv}) {q.dtype} with contiguous last dim")
    if mask not in MASK_KINDS:
        raise ValueError(f"{name}: mask={mask!r} not in {sorted(MASK_KINDS)}")
    check_schedule(name, schedule, merge)
    if schedule != "split" and fuse is not None:
        raise ValueError(f"{name}: fuse={fuse} applies to the split schedule; schedule={schedule!r} always merges "
                         f"in its last chunk program")
    if num_kv_splits < 1 or max_q_len < 1:
        raise ValueError(f"{name}: num_kv_splits={num_kv_splits} and max_q_len={max_q_len} "
                         f"must be >= 1")
    mask_arg, draft_arg = cu_seqlens_q, cu_seqlens_q  # placeholders, never read
    if mask == "tree":
        if custom_mask is None or custom_mask.numel() < bs * max_q_len * max_q_len:
            got = None if custom_mask is None else custom_mask.numel()
            raise ValueError(f"{name}: tree mask needs custom_mask with >= bs*W*W = "
                             f"{bs * max_q_len * max_q_len} elements, got {got}")
        if custom_mask.dtype not in (torch.bool, torch.uint8) or custom_mask.device != q.device:
            raise ValueError(f"{name}: custom_mask must be bool/uint8 on {q.device}, got "
                             f"{custom_mask.dtype} on {custom_mask.device}")
        mask_arg = custom_mask.view(torch.uint8) if custom_mask.dtype == torch.bool else custom_mask
    if mask == "draft":
        if (draft_prefix_lens is None or draft_prefix_lens.dtype != torch.int32
                or draft_prefix_lens.shape[0] < bs or draft_prefix_lens.device != q.device):
            raise ValueError(f"{name}: draft mask needs draft_prefix_lens int32 [>= {bs}] "
                             f"on {q.device}")
        draft_arg = draft_prefix_lens
    window, softcap_log2, sinks_arg, feats = feature_args(name, q, window, softcap, sinks)
    # int64 slots whatever the cache: int32 ones spill the fused verify split pass on sm_90 (test_offline_sm90)
    feats["SLOT64"] = True
    feats["BLOCK_W"] = pow2(max_q_len) if mask == "tree" and feats["WINDOW"] else 1
    if bs == 0 or T == 0:
        return out
    group = H // Hkv
    group_pad, block_d, block_dv = pow2(group), pow2(D), pow2(Dv)
    block_q = block_q or pick_block_q(max_q_len, group_pad)
    wide = wide_verify_tile(max_q_len, block_q * group_pad)
    # The 32-row verify tile on 2 warps, 64-token KV tiles and 3 stages at every split count:
    # faster than the 32-token tiles it ran before except at bs 1 kv 2048, where a split is whole
    # KV tiles and half of its 64 splits idle. The 16-row tiles keep 4 warps (slower on 2 and 1).
    # Figures: bench/RESULTS.md, 'GQA launch parameters'.
    if num_warps is None:
        num_warps = 2 if wide else 4
    if num_stages is None:
        num_stages = 3 if wide else 2
    if block_n is None:  # as many tokens as the card's shared memory stages (float32 at head dim 256: 32)
        tile_dims = block_d + block_dv    # one token of K and of V
        block_n = fit_block_n(q, 64, tile_dims * q.element_size())
    num_qb = cdiv(max_q_len, block_q)
    if schedule != "split":
        if num_qb != 1:
            raise ValueError(f"{name}: the chunk schedule needs every request's rows in one tile: "
                             f"max_q_len={max_q_len} > block_q={block_q}")
        cl = chunk_launch(name, out, workspace, bs, num_kv_splits, max_q_len, Hkv, page_table, page_size, schedule,
                          block_n, heads_first, window, MASK_KINDS[mask], draft_arg)
        part, lse = cl.part, cl.lse
        launch(_extend_chunk_kernel, cl.grid,
            q, k_buffer, v_buffer, page_table, seq_lens_k, cu_seqlens_q, mask_arg, draft_arg, part, lse, out,
            cl.counters, sm_scale * LOG2E * k_scale, v_scale, bs, cl.budget, max_q_len, window, softcap_log2,
            sinks_arg,
            q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
            page_table.stride(0), part.stride(0), part.stride(1), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_DIM=D, BLOCK_D=block_d,
            HEAD_DIM_V=Dv, BLOCK_DV=block_dv, PAGE_SIZE=page_size, BLOCK_N=block_n,
            MASK=MASK_KINDS[mask], INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            CHUNK_DV=merge_chunk(block_q * group_pad, block_dv, num_warps),
            MERGE_LAST=merge == "last", PDL_TRIGGER=merge == "pass" and cl.trigger,
            num_warps=num_warps, num_stages=num_stages, **cl.consts, **feats)
        if merge == "pass":
            cl.merge_pass(seq_lens_k, cu_seqlens_q, out)
        return out
    fused = (fuse_merge(block_q * group_pad, num_kv_splits, Dv, num_warps, workspace, share=0.5, one_block=num_qb == 1,
                        programs=bs * num_qb * Hkv * num_kv_splits, sms=device_sms(q.device)) if fuse is None
             else bool(fuse) and num_kv_splits > 1)
    block_s = pow2(num_kv_splits)
    o, lse, counters, o_strides, lse_strides = split_targets(
        name, out, workspace, num_kv_splits, bs * num_qb * Hkv if fused else 0)
    heads_first, grid = heads_first_grid(name, heads_first, bs, num_qb, (Hkv, num_qb * num_kv_splits, bs),
                                         (num_qb * num_kv_splits, bs, Hkv))
    launch(_extend_split_kernel, grid,
        q, k_buffer, v_buffer, page_table, seq_lens_k, cu_seqlens_q, mask_arg, draft_arg,
        o, lse, out, counters,
        sm_scale * LOG2E * k_scale, v_scale, window, softcap_log2, sinks_arg,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        page_table.stride(0),
        *o_strides, *lse_strides,
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        HEAD_DIM=D, BLOCK_D=block_d,
        HEAD_DIM_V=Dv, BLOCK_DV=block_dv,
        PAGE_SIZE=page_size, BLOCK_N=block_n, NUM_SPLITS=num_kv_splits,
        MASK=MASK_KINDS[mask], INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FUSED=fused, BLOCK_S=block_s, HEADS_FIRST=heads_first,
        CHUNK_DV=merge_chunk(block_q * group_pad, block_dv, num_warps), num_warps=num_warps, num_stages=num_stages,
        **feats,
    )
    if num_kv_splits > 1 and not fused:
        merge_splits(o, lse, out)
    return out
