"""Absorbed MLA attention on Hopper in Gluon, warp-specialized, on 64-token tiles in 2 stages,
each tile landing in 64-column chunks (a barrier each) and freed in three parts: the seesaw
schedule and fine-grained copy-GEMM pipelining of FlashMLA's deep dive (docs/20250422-new-kernel-deep-dive.md in
deepseek-ai/FlashMLA and its sm90 dense decode kernel), written anew for our interface, with
cp.async by a loader warp group in place of TMA.

Why: ``seesaw``'s 32-token tiles run the scores at N = 32, where each wgmma reads twice
as many bytes of q from shared memory as of K; at N = 64 the scores read a third fewer
shared-memory bytes per flop. q (72 KiB) and two 64-token tiles (144 KiB) fill one program's shared memory, so a stage
is refilled part by part as each part is done with. A stage is nine 64-column chunks, each with
its own "landed" barrier, freed in three parts by the group that reads each last:

- tile A (stage 0, the left group's scores): latent 0..255 after the left group's P_A . V_A;
  latent 256..511 and the rope (then holding P_A) after the right group's P_A . V_A;
- tile B (stage 1, the right group's scores): latent 256..511 after the right group's
  P_B . V_B; latent 0..255 and the rope (then holding P_B) after the left group's P_B . V_B.

A pass (FlashMLA's order): the left group scores A and publishes the max after A; the right
group takes it, scores B against it and publishes the max after B and P_B; the left group
rescales P_A to the max after B and publishes it; the right group runs its own P_B . V_B before
P_A . V_A, so B's latent 256..511 is freed mid-pass. The loader refills the parts in the order
they are freed (A 0..255; B 256..511; A rope, 256..511; B 0..255, rope) and each group's scores
wait chunk by chunk in that order (A: 0..255, rope, 256..511; B: 256..511, 0..255, rope), so the
next tile's scores start on the chunks already landed.

The stage and q descriptors are indexed at run time (by a zero the compiler cannot fold): as
constants, the compiler hoisted all 36 of them out of the loop and ptxas spilled them (496
bytes of stack), and beside 217.5 KiB of shared memory the reloads mostly missed L1, a third
of the kernel's time (figures: bench/RESULTS.md, 'MLA kernels'; tests/kernels/test_offline_sm90.py
bounds the stack).

Same interface, masks and split outputs as ``wgmma`` where pages hold whole 64-token tiles
(``chunked_refusal`` says why not elsewhere).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .warpspec import (
    BLOCK_M,
    HALF,
    _copy_q,
    _dot_a,
    _finish,
    _group_start,
    _loader_start,
    _rescale,
    _scale,
    _softmax,
    _softmax_args,
    warp_specialized_refusal,
)

TILE_TOKENS = 64
BLOCK_N = gl.constexpr(TILE_TOKENS)  # KV tokens of a tile
CHUNK = gl.constexpr(64)      # columns of one copy-and-barrier chunk (one 128-byte swizzle row)
LO_CHUNKS = gl.constexpr(4)   # latent 0..255: chunks 0..3; latent 256..511: 4..7; rope: 8
RING = gl.constexpr(9)        # "landed" barriers of a stage
NUM_STAGES = gl.constexpr(2)  # tile A in stage 0, tile B in stage 1
PARTS = gl.constexpr(3)       # parts a stage is freed in: empty.index(PARTS * stage + part)
S64 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                             instr_shape=[16, TILE_TOKENS, 16]))
ROW64 = gl.constexpr(gl.SliceLayout(1, S64.value))
LO, ROPE_PART, HI = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)


@gluon.jit
def _chunk_src(base, n0, end, stride_kvs):
    """Addresses of a 64-token tile's first 64 columns in the loader's copy layout (4 rows x 16
    bytes a thread; a chunk c adds c * CHUNK) and which rows are before ``end``."""
    LC: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r_c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LC))
    c_c = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, LC))
    ok = ((n0 + r_c) < end)[:, None]
    return base + r_c[:, None].to(gl.int64) * stride_kvs + c_c[None, :], ok


@gluon.jit
def _copy_part(lat_t, rope_t, base, n0, end, stride_kvs, ready, empty, STAGE: gl.constexpr,
               PART: gl.constexpr, ph, LATENT: gl.constexpr):
    """Wait for ``PART`` of the stage to be freed, then copy its chunks of 64 tokens (those at or
    past ``end`` zero-filled), each arriving on its own barrier as its copies land."""
    src, ok = _chunk_src(base, n0, end, stride_kvs)
    mbarrier.wait(empty.index(PARTS * STAGE + PART), ph)
    if PART == ROPE_PART:
        async_copy.async_copy_global_to_shared(rope_t, src + LATENT, mask=ok)
        async_copy.mbarrier_arrive(ready.index(RING * STAGE + 2 * LO_CHUNKS), increment_count=False)
    else:
        for c in gl.static_range(PART // 2 * LO_CHUNKS, (PART // 2 + 1) * LO_CHUNKS):
            async_copy.async_copy_global_to_shared(lat_t.slice(c * CHUNK, CHUNK, dim=1),
                                                   src + c * CHUNK, mask=ok)
            async_copy.mbarrier_arrive(ready.index(RING * STAGE + c), increment_count=False)


@gluon.jit
def _pages(pt_row, start, t, num_tiles, PAGE_SIZE: gl.constexpr):
    """The pages of tiles ``t`` and ``t + 1`` of the split (0 past its last tile). The loader
    loads a pass's pages during the pass before: loaded where they were used, their latency
    stalled the loader on every pass (a quarter of the warp stall samples in ncu; a pass ahead
    gained 0.5-1.5 %, the rest hidden behind the waits for freed parts)."""
    n0 = start + t * BLOCK_N
    page_a = gl.load(pt_row + n0 // PAGE_SIZE, mask=t < num_tiles, other=0)
    page_b = gl.load(pt_row + (n0 + BLOCK_N) // PAGE_SIZE, mask=t + 1 < num_tiles, other=0)
    return page_a, page_b


@gluon.jit
def _loader(ptrs, smem, bars, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
            LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
            WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr, CHUNK_CAP: gl.constexpr = 0):
    """The loader warp group: q (tracked by the first chunks' barriers), then per pass the parts
    of tiles A (stage 0) and B (stage 1) in the order they are freed: A's latent 0..255 (left
    group), B's 256..511 (right group's own P_B . V_B), A's rope and 256..511 (right group's
    P_A . V_A), B's 0..255 and rope (left group's P_B . V_B)."""
    q_lat, q_pe, lat, rope, m_a, m_b, l_x = smem
    ready, empty, bar_a, bar_b, bar_l = bars
    start, end, num_tiles, pt_row, kv_ptr, stride_kvs, q_src = _loader_start(
        ptrs, NUM_HEADS, BLOCK_H, BLOCK_W, MASK, BLOCK_N, CHUNK_BS, CHUNK_CAP)
    if num_tiles > 0:   # q first (an empty split reads nothing)
        _copy_q(q_src, q_lat.index(0), q_pe.index(0), NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE)
    page_a, page_b = _pages(pt_row, start, 0, num_tiles, PAGE_SIZE)
    for i in range((num_tiles + 1) // 2):
        ph = (i & 1) ^ 1
        n0 = start + 2 * i * BLOCK_N
        has_b = 2 * i + 1 < num_tiles
        base_a = kv_ptr + (page_a.to(gl.int64) * PAGE_SIZE + n0 % PAGE_SIZE) * stride_kvs
        base_b = kv_ptr + (page_b.to(gl.int64) * PAGE_SIZE + (n0 + BLOCK_N) % PAGE_SIZE) * stride_kvs
        page_a, page_b = _pages(pt_row, start, 2 * i + 2, num_tiles, PAGE_SIZE)   # the next pass's
        lat_a, rope_a, lat_b, rope_b = lat.index(0), rope.index(0), lat.index(1), rope.index(1)
        _copy_part(lat_a, rope_a, base_a, n0, end, stride_kvs, ready, empty, 0, LO, ph, LATENT)
        if has_b:
            _copy_part(lat_b, rope_b, base_b, n0 + BLOCK_N, end, stride_kvs, ready, empty, 1, HI,
                       ph, LATENT)
        _copy_part(lat_a, rope_a, base_a, n0, end, stride_kvs, ready, empty, 0, ROPE_PART, ph,
                   LATENT)
        _copy_part(lat_a, rope_a, base_a, n0, end, stride_kvs, ready, empty, 0, HI, ph, LATENT)
        if has_b:
            _copy_part(lat_b, rope_b, base_b, n0 + BLOCK_N, end, stride_kvs, ready, empty, 1, LO,
                       ph, LATENT)
            _copy_part(lat_b, rope_b, base_b, n0 + BLOCK_N, end, stride_kvs, ready, empty, 1,
                       ROPE_PART, ph, LATENT)


@gluon.jit
def _score_part(s, q_lat, q_pe, lat, rope, ready, STAGE: gl.constexpr, PART: gl.constexpr, ph,
                FIRST: gl.constexpr, zero):
    """Issue q . K^T over one part of the tile in ``STAGE`` (LO: chunks 0..3, HI: 4..7, or the
    rope), each chunk's wgmma group as soon as that chunk has landed (``FIRST``: the scores'
    first part, overwriting ``s``). ``zero`` is a run-time 0 that indexes q and the stage: with
    constant indices the compiler hoists the 36 descriptors out of the loop and ptxas spills
    them (tests/kernels/test_offline_sm90.py bounds the stack)."""
    if PART == ROPE_PART:
        mbarrier.wait(ready.index(RING * STAGE + 2 * LO_CHUNKS), ph)
        fence_async_shared()
        s = warpgroup_mma(q_pe.index(zero), rope.index(STAGE + zero).permute((1, 0)), s, use_acc=not FIRST,
                          is_async=True)
    else:
        for c in gl.static_range(PART // 2 * LO_CHUNKS, (PART // 2 + 1) * LO_CHUNKS):
            mbarrier.wait(ready.index(RING * STAGE + c), ph)
            fence_async_shared()
            s = warpgroup_mma(q_lat.index(zero).slice(c * CHUNK, CHUNK, dim=1),
                              lat.index(STAGE + zero).slice(c * CHUNK, CHUNK, dim=1).permute((1, 0)), s,
                              use_acc=(not FIRST) or (c % LO_CHUNKS > 0), is_async=True)
    return s


@gluon.jit
def _scores(q_lat, q_pe, lat, rope, ready, STAGE: gl.constexpr, ph, zero):
    """q . K^T of the tile in ``STAGE`` in the order its parts land (A: latent 0..255, rope,
    256..511; B: 256..511, 0..255, rope), waited for; ``zero``: a run-time 0 (``_score_part``)."""
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S64)
    if STAGE == 0:
        s = _score_part(s, q_lat, q_pe, lat, rope, ready, 0, LO, ph, True, zero)
        s = _score_part(s, q_lat, q_pe, lat, rope, ready, 0, ROPE_PART, ph, False, zero)
        s = _score_part(s, q_lat, q_pe, lat, rope, ready, 0, HI, ph, False, zero)
    else:
        s = _score_part(s, q_lat, q_pe, lat, rope, ready, 1, HI, ph, True, zero)
        s = _score_part(s, q_lat, q_pe, lat, rope, ready, 1, LO, ph, False, zero)
        s = _score_part(s, q_lat, q_pe, lat, rope, ready, 1, ROPE_PART, ph, False, zero)
    return warpgroup_mma_wait(0, deps=(s,))


@gluon.jit
def _left(ptrs, smem, bars, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
          LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
          WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr, CHUNK_CAP: gl.constexpr = 0):
    """Columns 0..255: tile A's scores and softmax (the max after A to the right group), P_A .
    V_A; then, with the max after B, P_A rescaled to it for the right group, and P_B . V_B."""
    q_ptr, mask_ptr, scale_log2, W = _softmax_args(ptrs)
    q_lat, q_pe, lat, rope, m_a, m_b, l_x = smem
    ready, empty, bar_a, bar_b, bar_l = bars
    (hb, wb, split, prefix, draft_prefix, start, end, num_tiles, row0, j, heads, rows, row_ok,
     mask_base, m, l_i, acc) = _group_start(ptrs, NUM_HEADS, BLOCK_H, BLOCK_W, MASK, BLOCK_N, CHUNK_BS, CHUNK_CAP,
                                            ROW64)
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S64)
    if num_tiles > 0:
        s = _scores(q_lat, q_pe, lat, rope, ready, 0, 0, num_tiles // (num_tiles + 2))
    for i in range((num_tiles + 1) // 2):
        has_b = 2 * i + 1 < num_tiles
        p, m, alpha, psum = _softmax(s, m, start + 2 * i * BLOCK_N, end, j, row_ok, prefix,
                                     draft_prefix, W, mask_ptr, mask_base, scale_log2, MASK,
                                     S64, BLOCK_N)
        m_a.store(m)
        mbarrier.arrive(bar_a.index(0))           # the max after A
        l_i = l_i * alpha + psum
        p16 = p.to(q_ptr.dtype.element_ty)
        acc = _scale(acc, alpha)
        acc = warpgroup_mma(_dot_a(p16), lat.index(0).slice(0, HALF, dim=1), acc, is_async=True)
        mbarrier.wait(bar_b.index(0), i & 1, pred=has_b)   # the max after B
        m_new = gl.where(has_b, m_b.load(ROW64), m)
        beta = _rescale(m, m_new)
        m = m_new
        l_i = l_i * beta
        rope.index(0).store((p * beta[:, None]).to(q_ptr.dtype.element_ty))   # P_A at the max after B
        fence_async_shared()
        mbarrier.arrive(bar_a.index(1))           # P_A for the right group
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(PARTS * 0 + LO))  # A's latent 0..255 read
        acc = _scale(acc, beta)
        if has_b:
            mbarrier.wait(bar_b.index(1), i & 1)  # P_B
            acc = warpgroup_mma(rope.index(1), lat.index(1).slice(0, HALF, dim=1), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(PARTS * 1 + LO))
            mbarrier.arrive(empty.index(PARTS * 1 + ROPE_PART))
        if 2 * i + 2 < num_tiles:
            s = _scores(q_lat, q_pe, lat, rope, ready, 0, (i + 1) & 1, i // (num_tiles + 2))
    _finish(acc, l_i, m, l_x, bar_l, 0, ptrs, rows, heads, row_ok, split, wb, hb, row0,
            NUM_HEADS, BLOCK_H, BLOCK_W, WRITE_LSE, ROW64)


@gluon.jit
def _right(ptrs, smem, bars, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
           LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
           WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr, CHUNK_CAP: gl.constexpr = 0):
    """Columns 256..511: tile B's scores and, with the max after A, its softmax (the max after B
    and P_B to the left group); P_B . V_B from registers, then P_A . V_A with P_A from the left
    group."""
    q_ptr, mask_ptr, scale_log2, W = _softmax_args(ptrs)
    q_lat, q_pe, lat, rope, m_a, m_b, l_x = smem
    ready, empty, bar_a, bar_b, bar_l = bars
    (hb, wb, split, prefix, draft_prefix, start, end, num_tiles, row0, j, heads, rows, row_ok,
     mask_base, m, l_i, acc) = _group_start(ptrs, NUM_HEADS, BLOCK_H, BLOCK_W, MASK, BLOCK_N, CHUNK_BS, CHUNK_CAP,
                                            ROW64)
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S64)   # no tile B: all masked
    if num_tiles > 1:
        s = _scores(q_lat, q_pe, lat, rope, ready, 1, 0, num_tiles // (num_tiles + 2))
    for i in range((num_tiles + 1) // 2):
        has_b = 2 * i + 1 < num_tiles
        mbarrier.wait(bar_a.index(0), i & 1)      # the max after A
        m_new = m_a.load(ROW64)
        alpha = _rescale(m, m_new)
        m = m_new
        p, m, beta, psum = _softmax(s, m, start + (2 * i + 1) * BLOCK_N, end, j, row_ok, prefix,
                                    draft_prefix, W, mask_ptr, mask_base, scale_log2, MASK,
                                    S64, BLOCK_N)
        l_i = l_i * (alpha * beta) + psum
        acc = _scale(acc, alpha * beta)
        if has_b:
            m_b.store(m)
            mbarrier.arrive(bar_b.index(0))
            p16 = p.to(q_ptr.dtype.element_ty)
            rope.index(1).store(p16)              # P_B for the left group (B's rope is read)
            fence_async_shared()
            mbarrier.arrive(bar_b.index(1))
            p_b = _dot_a(p16)
            pv = warpgroup_mma(p_b, lat.index(1).slice(HALF, HALF, dim=1), acc, is_async=True)
            mbarrier.wait(bar_a.index(1), i & 1)  # P_A, at the max after B
            pv = warpgroup_mma(rope.index(0), lat.index(0).slice(HALF, HALF, dim=1), pv,
                               is_async=True)
            warpgroup_mma_wait(1, deps=(p_b,))
            mbarrier.arrive(empty.index(PARTS * 1 + HI))   # B's latent 256..511 read
        else:
            mbarrier.wait(bar_a.index(1), i & 1)
            pv = warpgroup_mma(rope.index(0), lat.index(0).slice(HALF, HALF, dim=1), acc,
                               is_async=True)
        acc = warpgroup_mma_wait(0, deps=(pv,))
        mbarrier.arrive(empty.index(PARTS * 0 + HI))
        mbarrier.arrive(empty.index(PARTS * 0 + ROPE_PART))
        if 2 * i + 3 < num_tiles:
            s = _scores(q_lat, q_pe, lat, rope, ready, 1, (i + 1) & 1, i // (num_tiles + 2))
    _finish(acc, l_i, m, l_x, bar_l, 1, ptrs, rows, heads, row_ok, split, wb, hb, row0,
            NUM_HEADS, BLOCK_H, BLOCK_W, WRITE_LSE, ROW64)


def chunked_refusal(page_size: int, block_n=None, num_warps=None, num_stages=None):
    """Why ``_mla_chunked_kernel`` cannot serve a launch that ``wgmma`` serves (None where it
    can)."""
    return warp_specialized_refusal(TILE_TOKENS, NUM_STAGES.value, page_size, block_n, num_warps, num_stages)
