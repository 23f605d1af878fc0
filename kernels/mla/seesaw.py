"""Absorbed MLA attention on Hopper in Gluon, warp-specialized: the "seesaw" schedule of
FlashMLA's deep dive (docs/20250422-new-kernel-deep-dive.md in deepseek-ai/FlashMLA), written
anew for our interface, with 32-token tiles.

One program holds a 64-row tile (query rows x heads) and walks its split's KV two 32-token tiles
a pass, A and B. Three partitions:

- the left warp group (the default partition) owns output columns 0..255: it computes the
  scores of A (q . A^T), A's softmax, P_A . V_A[:, :256] with P_A from registers, then
  P_B . V_B[:, :256] with P_B from shared memory;
- the right warp group owns columns 256..511: the scores of B and B's softmax, P_A . V_A[:, 256:]
  with P_A from shared memory (B's softmax runs behind it), then P_B . V_B[:, 256:] from
  registers;
- a loader warp group copies q, then each KV tile by masked cp.async (tokens past the split's end
  zero-filled: NaN in unused slots stays out) into a stage both groups have freed.

The running max passes between the groups through shared memory (m after A, left to right; m
after B, right to left): one group's softmax runs on the CUDA cores while the other's products
run on the tensor cores. P_A and P_B go through their stage's rope columns (unread after that
tile's scores); each group keeps its tiles' row sums, added at the end, and issues its next
tile's scores behind its P_B . V_B.

Why 32-token tiles in 4 stages: q (72 KiB) and the stages share one program's 227 KiB. With
64-token tiles only 2 stages fit, both in use by a pass; released whole, a stage is refilled only
after the pass, and the loads do not overlap the products (slower than the loads and the
products added). With 32-token tiles the loader fills the next pass's two stages during this
one, faster than the lock-step ``wgmma`` (figures: bench/RESULTS.md, 'MLA kernels').
The cost: each group's scores run at N = 32, q read from shared memory per 32 tokens (as
in ``wgmma``). ``chunked`` keeps 64-token tiles and refills each stage part by part, and
is faster (it and ``dbuf`` are the defaults where pages hold whole 64-token tiles); this kernel serves pages
of an odd multiple of 32 tokens.

Serves what ``wgmma`` serves where pages hold whole 32-token tiles, with the same arguments,
masks and split outputs (``seesaw_refusal`` says why not elsewhere).
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
    _slabs,
    _softmax,
    _softmax_args,
    _tile_at,
    warp_specialized_refusal,
)

TILE_TOKENS = 32
BLOCK_N = gl.constexpr(TILE_TOKENS)   # KV tokens of a tile
NUM_STAGES = gl.constexpr(4)          # tiles in shared memory: a pass's A and B, and the next pass's
# A warp group's scores [64, BLOCK_N] on wgmma (4 warps).
S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                             instr_shape=[16, BLOCK_N.value, 16]))
ROW = gl.constexpr(gl.SliceLayout(1, S_L.value))


@gluon.jit
def _loader(ptrs, smem, bars, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
            LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
            WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr, CHUNK_CAP: gl.constexpr = 0):
    """The loader warp group: q, then KV tile t into stage t % NUM_STAGES once both groups have
    freed it."""
    q_lat, q_pe, lat, rope, m_a, m_b, l_x = smem
    ready, empty, bar_a, bar_b, bar_l = bars
    start, end, num_tiles, pt_row, kv_ptr, stride_kvs, q_src = _loader_start(
        ptrs, NUM_HEADS, BLOCK_H, BLOCK_W, MASK, BLOCK_N, CHUNK_BS, CHUNK_CAP)
    r_d, r_r, c_d, c_r = _slabs(LATENT, ROPE)   # KV tiles in the slabs of q
    if num_tiles > 0:   # q first, tracked by the first tile's arrival (an empty split reads nothing)
        _copy_q(q_src, q_lat, q_pe, NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE)
    page = gl.load(pt_row + start // PAGE_SIZE, mask=num_tiles > 0, other=0)
    for t in range(num_tiles):
        stage = t % NUM_STAGES
        n0, base, page = _tile_at(kv_ptr, stride_kvs, pt_row, page, start, t, num_tiles, PAGE_SIZE, BLOCK_N)
        mbarrier.wait(empty.index(stage), ((t // NUM_STAGES) & 1) ^ 1)
        for r in gl.static_range(0, BLOCK_N, 8):
            ok = (n0 + r + r_d) < end
            src = base + (r + r_d[:, None]).to(gl.int64) * stride_kvs + c_d[None, :]
            async_copy.async_copy_global_to_shared(lat.index(stage).slice(r, 8, dim=0), src,
                                                   mask=ok[:, None])
        for r in gl.static_range(0, BLOCK_N, 16):
            ok_r = (n0 + r + r_r) < end
            src_r = base + (r + r_r[:, None]).to(gl.int64) * stride_kvs + LATENT + c_r[None, :]
            async_copy.async_copy_global_to_shared(rope.index(stage).slice(r, 16, dim=0), src_r,
                                                   mask=ok_r[:, None])
        # each loader thread arrives as its copies land (``ready`` counts the loader's threads)
        async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)


@gluon.jit
def _wait_tile(ready, t):
    """Wait until KV tile t (stage t % NUM_STAGES) has landed."""
    mbarrier.wait(ready.index(t % NUM_STAGES), (t // NUM_STAGES) & 1)
    fence_async_shared()


@gluon.jit
def _scores(q_lat, q_pe, lat, rope, t):
    """Issue q . K^T of tile t over all 576 columns for this warp group's 64 rows (N = BLOCK_N):
    two wgmma groups, waited for by the caller."""
    s0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L)
    st = t % NUM_STAGES
    s = warpgroup_mma(q_lat, lat.index(st).permute((1, 0)), s0, use_acc=False, is_async=True)
    return warpgroup_mma(q_pe, rope.index(st).permute((1, 0)), s, is_async=True)


@gluon.jit
def _p_view(rope_t):
    """A stage's rope columns ([BLOCK_N, ROPE], free once that tile's scores are done) as the
    [BLOCK_M, BLOCK_N] P of that tile: same bytes, the swizzle of a BLOCK_N-wide row."""
    P_SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=2 * BLOCK_N, element_bitwidth=16,
                                              rank=2)
    return rope_t._reinterpret(rope_t.dtype, [BLOCK_M, BLOCK_N], P_SH)


@gluon.jit
def _left(ptrs, smem, bars, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
          LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
          WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr, CHUNK_CAP: gl.constexpr = 0):
    """Columns 0..255: tile A's scores and softmax, P_A . V_A and P_B . V_B."""
    q_ptr, mask_ptr, scale_log2, W = _softmax_args(ptrs)
    q_lat, q_pe, lat, rope, m_a, m_b, l_x = smem
    ready, empty, bar_a, bar_b, bar_l = bars
    (hb, wb, split, prefix, draft_prefix, start, end, num_tiles, row0, j, heads, rows, row_ok,
     mask_base, m, l_i, acc) = _group_start(ptrs, NUM_HEADS, BLOCK_H, BLOCK_W, MASK, BLOCK_N, CHUNK_BS, CHUNK_CAP, ROW)
    # Software-pipelined: the next tile A's scores are issued behind P_B . V_B.
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L)
    if num_tiles > 0:
        _wait_tile(ready, 0)
        s = warpgroup_mma_wait(0, deps=(_scores(q_lat, q_pe, lat, rope, 0),))
    for i in range((num_tiles + 1) // 2):
        n0 = start + 2 * i * BLOCK_N
        sa = (2 * i) % NUM_STAGES                 # tile A's stage; B's is the next
        has_b = 2 * i + 1 < num_tiles
        p, m, alpha, psum = _softmax(s, m, n0, end, j, row_ok, prefix, draft_prefix, W, mask_ptr,
                                     mask_base, scale_log2, MASK, S_L, BLOCK_N)
        l_i = l_i * alpha + psum
        p16 = p.to(q_ptr.dtype.element_ty)
        _p_view(rope.index(sa)).store(p16)     # P_A for the right group (A's rope is read)
        m_a.store(m)
        fence_async_shared()
        mbarrier.arrive(bar_a)
        acc = _scale(acc, alpha)
        pv = warpgroup_mma(_dot_a(p16), lat.index(sa).slice(0, HALF, dim=1), acc,
                           is_async=True)
        mbarrier.wait(bar_b, i & 1, pred=has_b)   # P_B and the max after B
        fence_async_shared()
        m_new = gl.where(has_b, m_b.load(ROW), m)
        beta = _rescale(m, m_new)
        m = m_new
        l_i = l_i * beta
        acc = warpgroup_mma_wait(0, deps=(pv,))
        mbarrier.arrive(empty.index(sa))
        acc = _scale(acc, beta)
        if has_b:
            pv = warpgroup_mma(_p_view(rope.index(sa + 1)), lat.index(sa + 1).slice(0, HALF, dim=1),
                               acc, is_async=True)
            if 2 * i + 2 < num_tiles:
                _wait_tile(ready, 2 * i + 2)
                sc = _scores(q_lat, q_pe, lat, rope, 2 * i + 2)
                acc = warpgroup_mma_wait(2, deps=(pv,))   # P_B . V_B done, the scores may run
                mbarrier.arrive(empty.index(sa + 1))
                s = warpgroup_mma_wait(0, deps=(sc,))
            else:
                acc = warpgroup_mma_wait(0, deps=(pv,))
                mbarrier.arrive(empty.index(sa + 1))
    _finish(acc, l_i, m, l_x, bar_l, 0, ptrs, rows, heads, row_ok, split, wb, hb, row0,
            NUM_HEADS, BLOCK_H, BLOCK_W, WRITE_LSE, ROW)


@gluon.jit
def _right(ptrs, smem, bars, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
           LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
           WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr, CHUNK_CAP: gl.constexpr = 0):
    """Columns 256..511: tile B's scores and softmax, P_A . V_A (behind which B's softmax runs)
    and P_B . V_B."""
    q_ptr, mask_ptr, scale_log2, W = _softmax_args(ptrs)
    q_lat, q_pe, lat, rope, m_a, m_b, l_x = smem
    ready, empty, bar_a, bar_b, bar_l = bars
    (hb, wb, split, prefix, draft_prefix, start, end, num_tiles, row0, j, heads, rows, row_ok,
     mask_base, m, l_i, acc) = _group_start(ptrs, NUM_HEADS, BLOCK_H, BLOCK_W, MASK, BLOCK_N, CHUNK_BS, CHUNK_CAP, ROW)
    # Software-pipelined: the next tile B's scores are issued behind P_B . V_B.
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L)   # no tile B: all masked
    if num_tiles > 1:
        _wait_tile(ready, 1)
        s = warpgroup_mma_wait(0, deps=(_scores(q_lat, q_pe, lat, rope, 1),))
    for i in range((num_tiles + 1) // 2):
        n0 = start + 2 * i * BLOCK_N
        sa = (2 * i) % NUM_STAGES
        has_b = 2 * i + 1 < num_tiles
        mbarrier.wait(bar_a, i & 1)                # P_A and the max after A
        fence_async_shared()
        m_new = m_a.load(ROW)
        alpha = _rescale(m, m_new)
        m = m_new
        l_i = l_i * alpha
        acc = _scale(acc, alpha)
        pv = warpgroup_mma(_p_view(rope.index(sa)), lat.index(sa).slice(HALF, HALF, dim=1), acc,
                           is_async=True)
        p, m, beta, psum = _softmax(s, m, n0 + BLOCK_N, end, j, row_ok, prefix, draft_prefix, W,
                                    mask_ptr, mask_base, scale_log2, MASK, S_L, BLOCK_N)
        l_i = l_i * beta + psum
        p16 = p.to(q_ptr.dtype.element_ty)
        if has_b:
            _p_view(rope.index(sa + 1)).store(p16)   # P_B for the left group
            m_b.store(m)
            fence_async_shared()
            mbarrier.arrive(bar_b)
        acc = warpgroup_mma_wait(0, deps=(pv,))
        mbarrier.arrive(empty.index(sa))
        acc = _scale(acc, beta)
        if has_b:
            pv = warpgroup_mma(_dot_a(p16), lat.index(sa + 1).slice(HALF, HALF, dim=1), acc,
                               is_async=True)
            if 2 * i + 3 < num_tiles:
                _wait_tile(ready, 2 * i + 3)
                sc = _scores(q_lat, q_pe, lat, rope, 2 * i + 3)
                acc = warpgroup_mma_wait(2, deps=(pv,))
                mbarrier.arrive(empty.index(sa + 1))
                s = warpgroup_mma_wait(0, deps=(sc,))
            else:
                acc = warpgroup_mma_wait(0, deps=(pv,))
                mbarrier.arrive(empty.index(sa + 1))
    _finish(acc, l_i, m, l_x, bar_l, 1, ptrs, rows, heads, row_ok, split, wb, hb, row0,
            NUM_HEADS, BLOCK_H, BLOCK_W, WRITE_LSE, ROW)


def seesaw_refusal(page_size: int, block_n=None, num_warps=None, num_stages=None):
    """Why ``_mla_seesaw_kernel`` cannot serve a launch that ``wgmma`` serves (None where it
    can)."""
    return warp_specialized_refusal(TILE_TOKENS, NUM_STAGES.value, page_size, block_n, num_warps,
                                    num_stages)
