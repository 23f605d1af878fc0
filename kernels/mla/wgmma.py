"""Absorbed MLA attention on Hopper in Gluon: one 64-row tile (query rows x heads) per program,
q resident in shared memory, 64-token latent tiles double-buffered by cp.async, the scores
split between the two warp groups by KV token and the 512-wide output split between them by
column, both on wgmma.

The Triton kernel of ``attention`` leaves the layouts to the compiler, which gives a
64-row tile of 8 warps the flash-attention layout ``[8, 1]`` for the scores (they feed a
second dot): both warp groups then compute the whole 64 x 64 score tile, half the tensor work
of a tile wasted. Here the scores take ``[4, 2]`` (each warp group 32 of the 64 tokens, the
row max across the two through shared memory, the row sums kept as per-thread partials until
the last tile), P goes through shared memory to both warp groups, and each accumulates 256 of
the 512 output columns. The loop is software-pipelined: the next tile's scores run on the
tensor cores behind this tile's P . V. Every barrier counts here (a program holds 225 KiB of
shared memory, one per SM), hence 6 barriers a tile (figures: bench/RESULTS.md, 'MLA kernels').
Same interface, masks and split-KV
outputs as ``_mla_split_kernel`` (uniform W rows per request, no ragged EXTEND);
``mla_attention_fwd`` picks it where ``wgmma_refusal`` finds nothing against it and the
warp-specialized kernels (``chunked``, ``dbuf``, ``seesaw``: the defaults on sm_90) do not
serve.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..device_facts import capability, cuda_index
from .chunk_map import PLANNED, gluon_chunk_of

TILE_ROWS, TILE_TOKENS, WARPS = 64, 64, 8
BLOCK_M = gl.constexpr(TILE_ROWS)    # query rows x heads of one tile: one wgmma M per warp group
BLOCK_N = gl.constexpr(TILE_TOKENS)  # KV tokens of one tile
NUM_WARPS = gl.constexpr(WARPS)      # two warp groups


@gluon.jit
def _slots(pt_row, n0, end, PAGE_SIZE: gl.constexpr, layout: gl.constexpr):
    """Cache slots of KV tokens n0 .. n0+BLOCK_N, and which of them are below ``end``."""
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=layout)
    ok = offs_n < end
    page = gl.load(pt_row + offs_n // PAGE_SIZE, mask=ok, other=0)
    return page.to(gl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE, ok


@gluon.jit
def _load_kv_tile(lat_dst, rope_dst, kv_ptr, pt_row, n0, end, stride_kvs,
                  PAGE_SIZE: gl.constexpr, LATENT: gl.constexpr, ROPE: gl.constexpr,
                  LD: gl.constexpr, LR: gl.constexpr):
    """Issue the cp.async copies of KV tokens n0 .. n0+BLOCK_N (those below ``end``; the rest
    zero-filled and never read from global memory) into one stage. The rope columns' slots are
    read from the page table again in their own layout rather than converted from the latent
    columns': a layout conversion goes through shared memory, with barriers (2 % slower on an
    H200)."""
    slot, ok = _slots(pt_row, n0, end, PAGE_SIZE, gl.SliceLayout(1, LD))
    cols = gl.arange(0, LATENT, layout=gl.SliceLayout(0, LD))
    async_copy.async_copy_global_to_shared(
        lat_dst, kv_ptr + slot[:, None] * stride_kvs + cols[None, :], mask=ok[:, None])
    slot_r, ok_r = _slots(pt_row, n0, end, PAGE_SIZE, gl.SliceLayout(1, LR))
    cols_r = LATENT + gl.arange(0, ROPE, layout=gl.SliceLayout(0, LR))
    async_copy.async_copy_global_to_shared(
        rope_dst, kv_ptr + slot_r[:, None] * stride_kvs + cols_r[None, :], mask=ok_r[:, None])


@gluon.jit
def _program(seq_lens_ptr, draft_prefix_ptr, lse_ptr, W, NUM_SPLITS, MASK: gl.constexpr,
             NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
             N: gl.constexpr, CHUNK_BS: gl.constexpr = 0, CHUNK_CAP: gl.constexpr = 0):
    """This program's head block, row block, request, split, the request's prefix and draft
    prefix, its split's KV range [start, end) (split boundaries on N-token tiles) and tile count.

    ``CHUNK_BS`` > 0: the chunk schedule (``chunk_kernels.chunk_of``; ``chunk_map.gluon_chunk_of``) over the grid's
    ``num_programs(1) = |NUM_SPLITS| + bs`` chunk slots, ``NUM_SPLITS`` the chunk budget (``ChunkLaunch.budget``).
    Every chunk writes a partial (the merge pass combines one-chunk requests too), at row ``k * W + j`` of a
    contiguous ``[slots * W, NUM_HEADS, latent]`` workspace and its ``[slots * W + 1, NUM_HEADS]`` log-sum-exps,
    ``k`` the chunk's index in request order (slot ``c`` runs chunk ``k``: ``gluon_chunk_of``): the stores add
    ``split * stride_os`` and ``split`` to the request's row, so ``split`` is the offset ``(k - b) * W * NUM_HEADS``
    with ``stride_os`` the head stride. Under the wave fit (a negative budget) the first program publishes the chunk
    size for the merge pass (``ChunkLaunch.published``): at the log-sum-exp row past the grid's slots
    (``schedule.SCHEDULE_ROWS``), so that the merge's programs need not search for it. Each partition that calls
    this stores the same value there. ``CHUNK_CAP`` > 0 (under the fit alone): the many-waves budget's cap and order
    (``chunk_map``), at least ``PLANNED`` its planned size read there. A slot past the batch's chunks returns the
    head block ``NUM_HB``: no head of it is in range."""
    NUM_HB: gl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    pid = gl.program_id(0)
    hb = pid % NUM_HB
    wb = pid // NUM_HB
    if CHUNK_BS > 0:
        c = gl.program_id(1)
        bs = gl.num_programs(1) - gl.maximum(NUM_SPLITS, -NUM_SPLITS)     # negative: the wave fit
        published = lse_ptr + gl.num_programs(1).to(gl.int64) * W * NUM_HEADS
        b, k, start, end, total, per = gluon_chunk_of(seq_lens_ptr, published, c, bs, NUM_SPLITS, N, CHUNK_BS,
                                                      CHUNK_CAP)
        if CHUNK_CAP < PLANNED:         # else the plan wrote it there
            if NUM_SPLITS < 0:
                if (c == 0) & (pid == 0):
                    gl.store(published, per.to(gl.float32))
        split = (k - b).to(gl.int64) * W * NUM_HEADS
        seq_len = gl.load(seq_lens_ptr + b)
        if c >= total:         # a slot past the batch's last chunk: no tile, and its head block past the heads, so
            end = start        # that it stores no partial (every q and KV load and every store masks heads or tokens)
            hb = hb * 0 + NUM_HB
    else:
        b = gl.program_id(1)
        split = gl.program_id(2)
        seq_len = gl.load(seq_lens_ptr + b)
        split_len = (((seq_len + NUM_SPLITS - 1) // NUM_SPLITS + N - 1) // N) * N
        start = split * split_len
        end = gl.minimum(start + split_len, seq_len)
    prefix = seq_len - W
    draft_prefix = 0
    if MASK == 2:
        draft_prefix = gl.load(draft_prefix_ptr + b)
    if MASK == 0:  # causal: nothing past the block's last row is visible
        end = gl.minimum(end, prefix + wb * BLOCK_W + BLOCK_W)
    num_tiles = gl.maximum(end - start + N - 1, 0) // N
    return hb, wb, b, split, prefix, draft_prefix, start, end, num_tiles


@gluon.jit
def _tile_rows(wb, hb, row0, q_len, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr,
               BLOCK_W: gl.constexpr, layout: gl.constexpr):
    """Query index j, head, flat row and validity of each of the tile's rows, in ``layout``."""
    return _rows_of(gl.arange(0, BLOCK_M, layout=layout), wb, hb, row0, q_len, NUM_HEADS,
                    BLOCK_H, BLOCK_W)


@gluon.jit
def _rows_of(offs_m, wb, hb, row0, q_len, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr,
             BLOCK_W: gl.constexpr):
    """``_tile_rows`` for tile rows ``offs_m``: row r is query j = wb*BLOCK_W + r // BLOCK_H of
    head hb*BLOCK_H + r % BLOCK_H."""
    j = wb * BLOCK_W + offs_m // BLOCK_H
    heads = hb * BLOCK_H + offs_m % BLOCK_H
    return j, heads, row0 + j, (j < q_len) & (heads < NUM_HEADS)


@gluon.jit
def _visible(s_layout: gl.constexpr, n0, end, j, row_ok, prefix, draft_prefix, q_len, mask_ptr,
             mask_base, MASK: gl.constexpr, N: gl.constexpr = BLOCK_N):
    """[BLOCK_M, N] visibility of tokens n0 .. n0+N for the tile's rows (as ``visible_mask``)."""
    offs_n = n0 + gl.arange(0, N, layout=gl.SliceLayout(0, s_layout))
    vis = (offs_n[None, :] < end) & row_ok[:, None]
    if MASK == 0:
        vis = vis & (offs_n[None, :] <= prefix + j[:, None])
    elif MASK == 1:
        rel = offs_n[None, :] - prefix
        tail = vis & (rel >= 0)
        bits = gl.load(mask_ptr + mask_base + j[:, None] * q_len + rel, mask=tail, other=0)
        vis = vis & ((rel < 0) | (bits != 0))
    else:
        rel = offs_n[None, :] - draft_prefix
        vis = vis & ((rel < 0) | (rel % q_len == j[:, None]))
    return vis


@gluon.jit
def _scores(q_lat, q_pe, lat_t, rope_t, s_zero, WAIT: gl.constexpr):
    """Wait for a tile's copies (all but the WAIT latest groups), then issue its scores
    (q . K^T, two wgmma groups): the caller waits for them."""
    async_copy.wait_group(WAIT)
    fence_async_shared()
    gl.thread_barrier()
    s = warpgroup_mma(q_lat, lat_t.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return warpgroup_mma(q_pe, rope_t.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax(s, m_i, l_i, S_L: gl.constexpr, n0, end, j, row_ok, prefix, draft_prefix, q_len,
             mask_ptr, mask_base, scale_log2, MASK: gl.constexpr):
    """Online softmax of one tile's scores: (P, the rescale of the running sums, m, l). The
    row sums ``l_i`` stay a [BLOCK_M, BLOCK_N] tile of per-thread partial sums, reduced once
    after the last tile: each warp group holds half of a row's tokens, so a per-tile row sum
    would cross the warp groups through shared memory (3.6 % slower on an H200)."""
    vis = _visible(S_L, n0, end, j, row_ok, prefix, draft_prefix, q_len, mask_ptr, mask_base,
                   MASK)
    s = gl.where(vis, s * scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)   # a row masked in this tile
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha[:, None] + p


@gluon.jit
def _body(ptrs, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
          LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
          WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr, CHUNK_CAP: gl.constexpr = 0):
    """``_mla_wgmma_kernel`` (``prologue``) on its launch arguments ``ptrs``."""
    (q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
     scale_log2, stride_qt, stride_qh, stride_kvs, stride_pb, stride_ot, stride_oh, stride_os,
     stride_lt, stride_lh, W, NUM_SPLITS) = ptrs
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # Scores [64, 64]: warp groups side by side over the tokens (n = 32 each); output
    # [64, 512]: side by side over the columns (n = 256 each).
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BLOCK_N // 2, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, LATENT // 2, 16])
    # Copies: 16 bytes a thread, a warp over 256 contiguous latent columns of one token.
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [NUM_WARPS, 1], [1, 0])
    LR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    hb, wb, b, split, prefix, draft_prefix, start, end, num_tiles = _program(
        seq_lens_ptr, draft_prefix_ptr, lse_ptr, W, NUM_SPLITS, MASK, NUM_HEADS, BLOCK_H, BLOCK_W, BLOCK_N, CHUNK_BS,
        CHUNK_CAP)
    row0 = b.to(gl.int64) * W
    q_len = W
    mask_base = b.to(gl.int64) * W * W

    q_lat = gl.allocate_shared_memory(dtype, [BLOCK_M, LATENT], SH)
    q_pe = gl.allocate_shared_memory(dtype, [BLOCK_M, ROPE], SH)
    lat = gl.allocate_shared_memory(dtype, [2, BLOCK_N, LATENT], SH)
    rope = gl.allocate_shared_memory(dtype, [2, BLOCK_N, ROPE], SH)
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], SH)

    # q once (its copies join the first tile's group), then the first two tiles.
    j_d, heads_d, rows_d, ok_d = _tile_rows(wb, hb, row0, q_len, NUM_HEADS, BLOCK_H, BLOCK_W,
                                            gl.SliceLayout(1, LD))
    q_row = q_ptr + rows_d[:, None] * stride_qt + heads_d[:, None] * stride_qh
    async_copy.async_copy_global_to_shared(
        q_lat, q_row + gl.arange(0, LATENT, layout=gl.SliceLayout(0, LD))[None, :], mask=ok_d[:, None])
    j_r, heads_r, rows_r, ok_r = _tile_rows(wb, hb, row0, q_len, NUM_HEADS, BLOCK_H, BLOCK_W,
                                            gl.SliceLayout(1, LR))
    async_copy.async_copy_global_to_shared(
        q_pe, q_ptr + rows_r[:, None] * stride_qt + heads_r[:, None] * stride_qh + LATENT
        + gl.arange(0, ROPE, layout=gl.SliceLayout(0, LR))[None, :], mask=ok_r[:, None])
    pt_row = page_table_ptr + b * stride_pb
    for i in gl.static_range(2):
        _load_kv_tile(lat.index(i), rope.index(i), kv_ptr, pt_row, start + i * BLOCK_N, end,
                      stride_kvs, PAGE_SIZE, LATENT, ROPE, LD, LR)
        async_copy.commit_group()

    j, heads, rows, row_ok = _tile_rows(wb, hb, row0, q_len, NUM_HEADS, BLOCK_H, BLOCK_W,
                                        gl.SliceLayout(1, S_L))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([BLOCK_M, LATENT], gl.float32, layout=O_L)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L)
    # Software-pipelined: tile t + 1's scores are issued behind tile t's P . V, so that the tensor
    # cores run both back to back and the copies of tile t + 2 are issued while the scores run.
    l_i = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L)
    s = s_zero
    if num_tiles > 0:
        s = warpgroup_mma_wait(0, deps=(_scores(q_lat, q_pe, lat.index(0), rope.index(0), s_zero, 1),))
    for t in range(num_tiles):
        stage = t % 2
        n0 = start + t * BLOCK_N
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, S_L, n0, end, j, row_ok, prefix, draft_prefix,
                                      q_len, mask_ptr, mask_base, scale_log2, MASK)
        p_smem.store(p.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        pv = warpgroup_mma(p_smem, lat.index(stage), acc, is_async=True)
        if t + 1 < num_tiles:
            nxt = 1 - stage                       # tile t + 1 is in (no later copies issued yet)
            sc = _scores(q_lat, q_pe, lat.index(nxt), rope.index(nxt), s_zero, 0)
            acc = warpgroup_mma_wait(2, deps=(pv,))   # P . V done, the scores may still run
            gl.thread_barrier()                   # both warp groups are done with this stage and P
            _load_kv_tile(lat.index(stage), rope.index(stage), kv_ptr, pt_row, n0 + 2 * BLOCK_N,
                          end, stride_kvs, PAGE_SIZE, LATENT, ROPE, LD, LR)
            async_copy.commit_group()
            s = warpgroup_mma_wait(0, deps=(sc,))
        else:
            acc = warpgroup_mma_wait(0, deps=(pv,))
    async_copy.wait_group(0)    # the masked copies past the last tile land before any scratch use
    l_i = gl.sum(l_i, axis=1)

    nonempty = l_i > 0
    inv_l = 1.0 / gl.where(nonempty, l_i, 1.0)
    if WRITE_LSE:
        lse = gl.where(nonempty, m_i + gl.log2(gl.where(nonempty, l_i, 1.0)), float("-inf"))
        gl.store(lse_ptr + rows * stride_lt + heads * stride_lh + split, lse, mask=row_ok)
    j_o, heads_o, rows_o, ok_o = _tile_rows(wb, hb, row0, q_len, NUM_HEADS, BLOCK_H, BLOCK_W,
                                            gl.SliceLayout(1, O_L))
    inv_o = gl.convert_layout(inv_l, gl.SliceLayout(1, O_L))
    nonempty_o = gl.convert_layout(nonempty, gl.SliceLayout(1, O_L))
    out = gl.where(nonempty_o[:, None], acc * inv_o[:, None], 0.0)   # empty rows: zeros
    cols = gl.arange(0, LATENT, layout=gl.SliceLayout(0, O_L))
    o_ptrs = (o_ptr + rows_o[:, None] * stride_ot + heads_o[:, None] * stride_oh + split * stride_os
              + cols[None, :])
    gl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=ok_o[:, None])


def wgmma_refusal(q, kv_buffer, latent, rope, rows, block_n, num_warps, num_stages, ragged):
    """Why ``_mla_wgmma_kernel`` cannot serve a launch (None where it can): it needs 16-bit
    inputs, the 512 + 64 layout, a 64-row tile (``rows`` = block_w x block_h) of 64 tokens on 8
    warps with two cp.async stages (the caller's knobs None or these), uniform rows per request,
    q and cache rows that its 16-byte copies can read (16-element strides, 16-byte aligned
    bases) and an sm_90 GPU."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"needs float16/bfloat16 (got {q.dtype})"
    if (latent, rope) != (512, 64):
        return f"needs 512 + 64 dims (got {latent} + {rope})"
    if rows != TILE_ROWS:
        return f"needs {TILE_ROWS}-row tiles (block_w x block_h = {rows})"
    if (block_n, num_warps, num_stages) not in [(b, w, s) for b in (None, TILE_TOKENS)
                                                for w in (None, WARPS) for s in (None, 2)]:
        return (f"runs {TILE_TOKENS}-token tiles on {WARPS} warps in 2 stages (got block_n="
                f"{block_n}, num_warps={num_warps}, num_stages={num_stages})")
    if ragged:
        return "needs uniform rows per request (no cu_seqlens_q)"
    if (q.stride(0) % 16 or q.stride(1) % 16 or kv_buffer.stride(0) % 16
            or q.data_ptr() % 16 or kv_buffer.data_ptr() % 16):
        return (f"needs q and kv_buffer strides in multiples of 16 elements and 16-byte aligned "
                f"bases (q strides {q.stride()[:2]}, kv_buffer stride {kv_buffer.stride(0)})")
    if not on_hopper(q):
        return f"needs an sm_90 (Hopper) NVIDIA GPU (q is on {q.device})"
    return None


def on_hopper(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on an sm_90 NVIDIA GPU (``bench/probes/offline_sm90.py`` stands in for one)."""
    return hopper_device(t.device)


def hopper_device(device: torch.device) -> bool:
    """Whether ``device`` is an sm_90 NVIDIA GPU (a ROCm build reports gfx9 GPUs as capability 9
    too)."""
    return device.type == "cuda" and torch.version.hip is None and capability(cuda_index(device))[0] == 9
