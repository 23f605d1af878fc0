"""Absorbed MLA attention on Hopper in Gluon, warp-specialized and double-buffered: one 64-token
KV tile at a time in each of 2 stages, for the memory-bound launches (few query rows per KV
byte: MLA with 16 heads).

Why: ``chunked`` runs FlashMLA's seesaw, whose two groups each score their own tile, so both
stages are read at once through a pass and a stage is refilled only as parts of it are freed:
where a program streams a request's KV it reaches a lower share of the DRAM peak than
FlashInfer's Hopper MLA kernel moving the same bytes (ncu on an H200). Here both groups work on
the same tile while the loader fills the other stage, so a whole tile is in flight while one is
in use.

- The left warp group (the default partition, output columns 0..127) waits for the tile chunk
  by chunk (nine 64-column chunks, a barrier each), computes all the scores (N = 64), the
  softmax, stores P into the tile's rope columns (read only by the scores) with the rescale of
  the running sums beside it, then runs P . V[:, :128] from registers.
- The right warp group (columns 128..511) takes P and the rescale, and runs P . V[:, 128:] from
  shared memory. The split is uneven because the left group also scores (``LEFT``).
- The loader warp group copies q, then each tile by masked cp.async (tokens past the split's
  end zero-filled: NaN in unused slots stays out) into a stage both groups have freed, its page
  indices loaded a tile ahead.

The left group carries the scores and the row sums; the right group's row sums are zero and
its max unused at the end (``_row_sums``).

Where it runs (``attention._pick_kernel``): where one program reads each request's KV
(MLA16 verify with W <= 4; decode with 64 heads, the same work a program, not measured). It
gains over ``chunked`` where a program has few tiles (the pipeline fills sooner), up to 10 %;
with one split only through the left group's 128 columns (``LEFT``). Not measured where several
programs share a request's KV (128 heads): those launches are compute-bound, and keep the
chunked kernel, whose two groups both score. Figures: bench/RESULTS.md, 'MLA kernels'.

Same interface, masks and split outputs as ``wgmma`` where pages hold whole 64-token tiles
(``dbuf_refusal`` says why not elsewhere).
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

from .chunked import BLOCK_N, CHUNK, RING, ROW64, S64, TILE_TOKENS, _chunk_src
from .warpspec import (
    BLOCK_M,
    HALF,
    O_L,
    _copy_q,
    _dot_a,
    _group_start,
    _loader_start,
    _row_sums,
    _scale,
    _softmax,
    _softmax_args,
    _store_out,
    _tile_at,
    warp_specialized_refusal,
)

NUM_STAGES = gl.constexpr(2)   # tile t in stage t % 2 (tiles, chunks, barriers: the chunked kernel's)
# The left group's output columns: it also computes the scores and the softmax, so the right
# group takes the other 384 (2-6 % faster with one split on an H200, within 1 % with splits).
# The right group's [64, 384] is two accumulators (shapes are powers of two), its half and the
# EXTRA columns beside the left group's.
LEFT = gl.constexpr(128)
EXTRA = gl.constexpr(HALF.value - LEFT.value)   # the right group's columns beyond its half
OL_LEFT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, LEFT.value, 16]))
OL_EXTRA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, EXTRA.value, 16]))


@gluon.jit
def _copy_tile(lat_t, rope_t, base, n0, end, stride_kvs, ready, empty, stage, ph,
               LATENT: gl.constexpr):
    """Wait for ``stage`` to be freed by both groups, then copy its tile in nine 64-column
    chunks (tokens at or past ``end`` zero-filled), each arriving on its own barrier as its
    copies land."""
    src, ok = _chunk_src(base, n0, end, stride_kvs)
    mbarrier.wait(empty.index(stage), ph)
    for c in gl.static_range(LATENT // CHUNK):
        async_copy.async_copy_global_to_shared(lat_t.slice(c * CHUNK, CHUNK, dim=1), src + c * CHUNK, mask=ok)
        async_copy.mbarrier_arrive(ready.index(RING * stage + c), increment_count=False)
    async_copy.async_copy_global_to_shared(rope_t, src + LATENT, mask=ok)
    async_copy.mbarrier_arrive(ready.index(RING * stage + RING - 1), increment_count=False)


@gluon.jit
def _loader(ptrs, smem, bars, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
            LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
            WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr, CHUNK_CAP: gl.constexpr = 0):
    """The loader warp group: q (tracked by tile 0's first chunk barrier), then tile t into
    stage t % 2 once both groups have freed it."""
    q_lat, q_pe, lat, rope, alpha_x, l_x = smem
    ready, empty, p_ready, bar_l = bars
    start, end, num_tiles, pt_row, kv_ptr, stride_kvs, q_src = _loader_start(
        ptrs, NUM_HEADS, BLOCK_H, BLOCK_W, MASK, BLOCK_N, CHUNK_BS, CHUNK_CAP)
    if num_tiles > 0:   # q first (an empty split reads nothing)
        _copy_q(q_src, q_lat.index(0), q_pe.index(0), NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE)
    page = gl.load(pt_row + start // PAGE_SIZE, mask=num_tiles > 0, other=0)
    for t in range(num_tiles):
        stage = t % NUM_STAGES
        n0, base, page = _tile_at(kv_ptr, stride_kvs, pt_row, page, start, t, num_tiles, PAGE_SIZE, BLOCK_N)
        _copy_tile(lat.index(stage), rope.index(stage), base, n0, end, stride_kvs, ready, empty,
                   stage, ((t // NUM_STAGES) & 1) ^ 1, LATENT)


@gluon.jit
def _tile_scores(q_lat, q_pe, lat, rope, ready, stage, ph, zero, LATENT: gl.constexpr):
    """q . K^T of the tile in ``stage``, each chunk's wgmma issued as soon as it has landed;
    ``zero`` is a run-time 0 indexing q (``chunked._score_part`` says why)."""
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S64)
    for c in gl.static_range(LATENT // CHUNK):
        mbarrier.wait(ready.index(RING * stage + c), ph)
        fence_async_shared()
        s = warpgroup_mma(q_lat.index(zero).slice(c * CHUNK, CHUNK, dim=1),
                          lat.index(stage).slice(c * CHUNK, CHUNK, dim=1).permute((1, 0)), s,
                          use_acc=c > 0, is_async=True)
    mbarrier.wait(ready.index(RING * stage + RING - 1), ph)
    fence_async_shared()
    s = warpgroup_mma(q_pe.index(zero), rope.index(stage).permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(0, deps=(s,))


@gluon.jit
def _left(ptrs, smem, bars, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
          LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
          WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr, CHUNK_CAP: gl.constexpr = 0):
    """Columns 0..127: each tile's scores and softmax, P and the rescale to the right group,
    P . V[:, :128]; the stage freed after it."""
    q_ptr, mask_ptr, scale_log2, W = _softmax_args(ptrs)
    q_lat, q_pe, lat, rope, alpha_x, l_x = smem
    ready, empty, p_ready, bar_l = bars
    (hb, wb, split, prefix, draft_prefix, start, end, num_tiles, row0, j, heads, rows, row_ok,
     mask_base, m, l_i, acc) = _group_start(ptrs, NUM_HEADS, BLOCK_H, BLOCK_W, MASK, BLOCK_N, CHUNK_BS, CHUNK_CAP,
                                            ROW64,
                                            LEFT, OL_LEFT)
    for t in range(num_tiles):
        stage = t % NUM_STAGES
        s = _tile_scores(q_lat, q_pe, lat, rope, ready, stage, (t // NUM_STAGES) & 1,
                         t // (num_tiles + 2), LATENT)
        p, m, alpha, psum = _softmax(s, m, start + t * BLOCK_N, end, j, row_ok, prefix, draft_prefix,
                                     W, mask_ptr, mask_base, scale_log2, MASK, S64, BLOCK_N)
        l_i = l_i * alpha + psum
        p16 = p.to(q_ptr.dtype.element_ty)
        rope.index(stage).store(p16)                       # P, where the scores read the rope
        alpha_x.index(stage).store(alpha)
        fence_async_shared()
        mbarrier.arrive(p_ready.index(stage))
        acc = _scale(acc, alpha, OL_LEFT)
        acc = warpgroup_mma(_dot_a(p16, OL_LEFT), lat.index(stage).slice(0, LEFT, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(stage))
    l_i = _row_sums(l_i, m, l_x, bar_l, 0, ptrs, rows, heads, row_ok, split, WRITE_LSE, ROW64)
    _store_out(acc, l_i, ptrs, split, wb, hb, row0, 0, NUM_HEADS, BLOCK_H, BLOCK_W, LEFT, OL_LEFT)


@gluon.jit
def _right(ptrs, smem, bars, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
           LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
           WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr, CHUNK_CAP: gl.constexpr = 0):
    """Columns 128..511 (two accumulators: 256..511 and 128..255): with each tile's P and
    rescale from the left group, P . V[:, 128:]; the stage freed after it."""
    q_lat, q_pe, lat, rope, alpha_x, l_x = smem
    ready, empty, p_ready, bar_l = bars
    (hb, wb, split, prefix, draft_prefix, start, end, num_tiles, row0, j, heads, rows, row_ok,
     mask_base, m, l_i, acc) = _group_start(ptrs, NUM_HEADS, BLOCK_H, BLOCK_W, MASK, BLOCK_N, CHUNK_BS, CHUNK_CAP,
                                            ROW64)
    acc_x = gl.zeros([BLOCK_M, EXTRA], gl.float32, layout=OL_EXTRA)
    for t in range(num_tiles):
        stage = t % NUM_STAGES
        mbarrier.wait(p_ready.index(stage), (t // NUM_STAGES) & 1)
        alpha = alpha_x.index(stage).load(ROW64)
        acc = _scale(acc, alpha)
        acc = warpgroup_mma(rope.index(stage), lat.index(stage).slice(HALF, HALF, dim=1), acc,
                            is_async=True)
        acc_x = _scale(acc_x, alpha, OL_EXTRA)
        acc_x = warpgroup_mma(rope.index(stage), lat.index(stage).slice(LEFT, EXTRA, dim=1), acc_x,
                              is_async=True)
        acc, acc_x = warpgroup_mma_wait(0, deps=(acc, acc_x))
        mbarrier.arrive(empty.index(stage))
    l_i = _row_sums(l_i, m, l_x, bar_l, 1, ptrs, rows, heads, row_ok, split, WRITE_LSE, ROW64)
    _store_out(acc, l_i, ptrs, split, wb, hb, row0, HALF, NUM_HEADS, BLOCK_H, BLOCK_W, HALF, O_L)
    _store_out(acc_x, l_i, ptrs, split, wb, hb, row0, LEFT, NUM_HEADS, BLOCK_H, BLOCK_W, EXTRA, OL_EXTRA)


def dbuf_refusal(page_size: int, block_n=None, num_warps=None, num_stages=None):
    """Why ``_mla_dbuf_kernel`` cannot serve a launch that ``wgmma`` serves (None where it
    can)."""
    return warp_specialized_refusal(TILE_TOKENS, NUM_STAGES.value, page_size, block_n, num_warps, num_stages)
