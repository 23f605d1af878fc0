"""The Gluon MLA kernels' entry points, side by side: each takes the launch arguments of
``mla_attention_fwd`` (those of the Triton kernel without ``cu_q_ptr``), checks its shapes,
allocates its shared memory and barriers, and starts its partitions (``chunked``, ``dbuf``,
``seesaw``, ``swap``) or its body (``wgmma``).

Why one module: the five kernels share one argument list, and a Gluon kernel's parameters
cannot be shared otherwise; side by side, their shared memory and barriers read as the
differences they are. The partitions and the rules of each kernel stay in its own module.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from . import chunked, dbuf, seesaw, swap, wgmma
from .warpspec import BLOCK_M, GROUP_REGS, GROUP_WARPS, HALF, LOADER_REGS, LOADER_WARPS

SH = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
ROW_SH = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[0]))   # a value a tile row
BAR = gl.constexpr(mbarrier.MBarrierLayout())


@gluon.jit
def _mla_chunked_kernel(
    q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kvs,
    stride_pb,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    W, NUM_SPLITS,
    NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
    LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr = 0, CHUNK_CAP: gl.constexpr = 0,
):
    STAGES: gl.constexpr = chunked.NUM_STAGES
    RING: gl.constexpr = chunked.RING
    PARTS: gl.constexpr = chunked.PARTS
    gl.static_assert(BLOCK_W * BLOCK_H == BLOCK_M)
    gl.static_assert((LATENT == 2 * HALF) & (HALF == chunked.LO_CHUNKS * chunked.CHUNK) & (ROPE == chunked.CHUNK))
    gl.static_assert((PAGE_SIZE % chunked.BLOCK_N == 0) & (BLOCK_M == chunked.BLOCK_N)
                     & (ROPE == chunked.BLOCK_N))   # P in the rope
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_lat = gl.allocate_shared_memory(dtype, [1, BLOCK_M, LATENT], SH)   # indexed at run time:
    q_pe = gl.allocate_shared_memory(dtype, [1, BLOCK_M, ROPE], SH)      # descriptors not hoisted
    lat = gl.allocate_shared_memory(dtype, [STAGES, chunked.BLOCK_N, LATENT], SH)
    rope = gl.allocate_shared_memory(dtype, [STAGES, chunked.BLOCK_N, ROPE], SH)
    m_a = gl.allocate_shared_memory(gl.float32, [BLOCK_M], ROW_SH)
    m_b = gl.allocate_shared_memory(gl.float32, [BLOCK_M], ROW_SH)
    l_x = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_M], ROW_SH)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES * RING, 1], BAR)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES * PARTS, 1], BAR)
    bar_a = gl.allocate_shared_memory(gl.int64, [2, 1], BAR)   # left -> right: the max, P_A
    bar_b = gl.allocate_shared_memory(gl.int64, [2, 1], BAR)   # right -> left: the max, P_B
    bar_l = gl.allocate_shared_memory(gl.int64, [1], BAR)
    for c in gl.static_range(STAGES * RING):
        mbarrier.init(ready.index(c), count=LOADER_WARPS * 32)   # each loader thread's copies
    for c in gl.static_range(STAGES * PARTS):
        mbarrier.init(empty.index(c), count=1)                   # one group frees each part
    for k in gl.static_range(2):
        mbarrier.init(bar_a.index(k), count=1)
        mbarrier.init(bar_b.index(k), count=1)
    mbarrier.init(bar_l, count=2)
    # (Tuples are built in the call: an assigned tuple would hold the constexprs as tensors.)
    ptrs = (q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
            scale_log2, stride_qt, stride_qh, stride_kvs, stride_pb, stride_ot, stride_oh,
            stride_os, stride_lt, stride_lh, W, NUM_SPLITS)
    smem = (q_lat, q_pe, lat, rope, m_a, m_b, l_x)
    bars = (ready, empty, bar_a, bar_b, bar_l)
    gl.warp_specialize([
        (chunked._left, (ptrs, smem, bars, NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE, PAGE_SIZE, WRITE_LSE, MASK,
                         CHUNK_BS, CHUNK_CAP)),
        (chunked._right, (ptrs, smem, bars, NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE, PAGE_SIZE, WRITE_LSE, MASK,
                          CHUNK_BS, CHUNK_CAP)),
        (chunked._loader, (ptrs, smem, bars, NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE, PAGE_SIZE, WRITE_LSE, MASK,
                           CHUNK_BS, CHUNK_CAP)),
    ], [GROUP_WARPS, LOADER_WARPS], [GROUP_REGS, LOADER_REGS])


@gluon.jit
def _mla_dbuf_kernel(
    q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kvs,
    stride_pb,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    W, NUM_SPLITS,
    NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
    LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr = 0, CHUNK_CAP: gl.constexpr = 0,
):
    STAGES: gl.constexpr = dbuf.NUM_STAGES
    RING: gl.constexpr = dbuf.RING
    CHUNK: gl.constexpr = dbuf.CHUNK
    gl.static_assert(BLOCK_W * BLOCK_H == BLOCK_M)
    gl.static_assert((LATENT == 2 * HALF) & (LATENT % CHUNK == 0) & (ROPE == CHUNK))
    gl.static_assert((PAGE_SIZE % dbuf.BLOCK_N == 0) & (BLOCK_M == dbuf.BLOCK_N)
                     & (ROPE == dbuf.BLOCK_N))   # P in the rope
    gl.static_assert((LATENT // CHUNK + 1 == RING) & (dbuf.EXTRA > 0))
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_lat = gl.allocate_shared_memory(dtype, [1, BLOCK_M, LATENT], SH)   # indexed at run time:
    q_pe = gl.allocate_shared_memory(dtype, [1, BLOCK_M, ROPE], SH)      # descriptors not hoisted
    lat = gl.allocate_shared_memory(dtype, [STAGES, dbuf.BLOCK_N, LATENT], SH)
    rope = gl.allocate_shared_memory(dtype, [STAGES, dbuf.BLOCK_N, ROPE], SH)
    alpha_x = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], ROW_SH)
    l_x = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_M], ROW_SH)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES * RING, 1], BAR)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BAR)
    p_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BAR)
    bar_l = gl.allocate_shared_memory(gl.int64, [1], BAR)
    for c in gl.static_range(STAGES * RING):
        mbarrier.init(ready.index(c), count=LOADER_WARPS * 32)   # each loader thread's copies
    for k in gl.static_range(STAGES):
        mbarrier.init(empty.index(k), count=2)                   # both groups free a stage
        mbarrier.init(p_ready.index(k), count=1)
    mbarrier.init(bar_l, count=2)
    ptrs = (q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
            scale_log2, stride_qt, stride_qh, stride_kvs, stride_pb, stride_ot, stride_oh,
            stride_os, stride_lt, stride_lh, W, NUM_SPLITS)
    smem = (q_lat, q_pe, lat, rope, alpha_x, l_x)
    bars = (ready, empty, p_ready, bar_l)
    gl.warp_specialize([
        (dbuf._left, (ptrs, smem, bars, NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE, PAGE_SIZE, WRITE_LSE, MASK,
                      CHUNK_BS, CHUNK_CAP)),
        (dbuf._right, (ptrs, smem, bars, NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE, PAGE_SIZE, WRITE_LSE, MASK,
                       CHUNK_BS, CHUNK_CAP)),
        (dbuf._loader, (ptrs, smem, bars, NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE, PAGE_SIZE, WRITE_LSE, MASK,
                        CHUNK_BS, CHUNK_CAP)),
    ], [GROUP_WARPS, LOADER_WARPS], [GROUP_REGS, LOADER_REGS])


@gluon.jit
def _mla_seesaw_kernel(
    q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kvs,
    stride_pb,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    W, NUM_SPLITS,
    NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
    LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr = 0, CHUNK_CAP: gl.constexpr = 0,
):
    STAGES: gl.constexpr = seesaw.NUM_STAGES
    N: gl.constexpr = seesaw.BLOCK_N
    gl.static_assert(BLOCK_W * BLOCK_H == BLOCK_M)
    gl.static_assert(LATENT == 2 * HALF)
    gl.static_assert((PAGE_SIZE % N == 0) & (ROPE == BLOCK_M))   # _p_view: P in the rope
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_lat = gl.allocate_shared_memory(dtype, [BLOCK_M, LATENT], SH)
    q_pe = gl.allocate_shared_memory(dtype, [BLOCK_M, ROPE], SH)
    lat = gl.allocate_shared_memory(dtype, [STAGES, N, LATENT], SH)
    rope = gl.allocate_shared_memory(dtype, [STAGES, N, ROPE], SH)
    m_a = gl.allocate_shared_memory(gl.float32, [BLOCK_M], ROW_SH)
    m_b = gl.allocate_shared_memory(gl.float32, [BLOCK_M], ROW_SH)
    l_x = gl.allocate_shared_memory(gl.float32, [2 * BLOCK_M], ROW_SH)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BAR)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BAR)
    bar_a = gl.allocate_shared_memory(gl.int64, [1], BAR)
    bar_b = gl.allocate_shared_memory(gl.int64, [1], BAR)
    bar_l = gl.allocate_shared_memory(gl.int64, [1], BAR)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=LOADER_WARPS * 32)
        mbarrier.init(empty.index(s), count=2)
    mbarrier.init(bar_a, count=1)
    mbarrier.init(bar_b, count=1)
    mbarrier.init(bar_l, count=2)
    ptrs = (q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
            scale_log2, stride_qt, stride_qh, stride_kvs, stride_pb, stride_ot, stride_oh,
            stride_os, stride_lt, stride_lh, W, NUM_SPLITS)
    smem = (q_lat, q_pe, lat, rope, m_a, m_b, l_x)
    bars = (ready, empty, bar_a, bar_b, bar_l)
    gl.warp_specialize([
        (seesaw._left, (ptrs, smem, bars, NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE, PAGE_SIZE, WRITE_LSE, MASK,
                        CHUNK_BS, CHUNK_CAP)),
        (seesaw._right, (ptrs, smem, bars, NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE, PAGE_SIZE, WRITE_LSE, MASK,
                         CHUNK_BS, CHUNK_CAP)),
        (seesaw._loader, (ptrs, smem, bars, NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE, PAGE_SIZE, WRITE_LSE, MASK,
                          CHUNK_BS, CHUNK_CAP)),
    ], [GROUP_WARPS, LOADER_WARPS], [GROUP_REGS, LOADER_REGS])


@gluon.jit
def _mla_swap_kernel(
    q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kvs,
    stride_pb,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    W, NUM_SPLITS,
    NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
    LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr = 0, CHUNK_CAP: gl.constexpr = 0,
):
    STAGES: gl.constexpr = swap.NUM_STAGES
    RING: gl.constexpr = swap.RING
    CHUNK: gl.constexpr = swap.CHUNK
    gl.static_assert((BLOCK_W == 1) & (BLOCK_H == swap.HEADS) & (MASK == 0))   # decode, 16-head blocks
    gl.static_assert((LATENT % CHUNK == 0) & (ROPE == CHUNK) & (PAGE_SIZE % swap.BLOCK_N == 0))
    gl.static_assert(LATENT // CHUNK + 1 == RING)
    # q in the loader's 64-row layout (rows past the 16 heads zero-filled, unread)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_lat = gl.allocate_shared_memory(dtype, [1, BLOCK_M, LATENT], SH)   # indexed at run time:
    q_pe = gl.allocate_shared_memory(dtype, [1, BLOCK_M, ROPE], SH)      # descriptors not hoisted
    lat = gl.allocate_shared_memory(dtype, [STAGES, swap.BLOCK_N, LATENT], SH)
    rope = gl.allocate_shared_memory(dtype, [STAGES, swap.BLOCK_N, ROPE], SH)
    p_t = gl.allocate_shared_memory(dtype, [swap.HEADS, swap.BLOCK_N], SH)
    unused = gl.allocate_shared_memory(gl.float32, [1], ROW_SH)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES * RING, 1], BAR)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BAR)
    unused_bar = gl.allocate_shared_memory(gl.int64, [1], BAR)
    for c in gl.static_range(STAGES * RING):
        mbarrier.init(ready.index(c), count=LOADER_WARPS * 32)   # each loader thread's copies
    for k in gl.static_range(STAGES):
        mbarrier.init(empty.index(k), count=1)                   # the consumer frees a stage
    ptrs = (q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
            scale_log2, stride_qt, stride_qh, stride_kvs, stride_pb, stride_ot, stride_oh,
            stride_os, stride_lt, stride_lh, W, NUM_SPLITS)
    smem = (q_lat, q_pe, lat, rope, p_t, unused)
    bars = (ready, empty, unused_bar, unused_bar)
    gl.warp_specialize([
        (swap._consumer, (ptrs, smem, bars, NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE, PAGE_SIZE, WRITE_LSE, MASK,
                          CHUNK_BS, CHUNK_CAP)),
        (dbuf._loader, (ptrs, smem, bars, NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE, PAGE_SIZE, WRITE_LSE, MASK,
                        CHUNK_BS, CHUNK_CAP)),
    ], [LOADER_WARPS], [LOADER_REGS])


@gluon.jit
def _mla_wgmma_kernel(
    q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kvs,
    stride_pb,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    W, NUM_SPLITS,
    NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
    LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
    WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr = 0, CHUNK_CAP: gl.constexpr = 0,
):
    gl.static_assert(BLOCK_W * BLOCK_H == BLOCK_M)
    wgmma._body((q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
                 scale_log2, stride_qt, stride_qh, stride_kvs, stride_pb, stride_ot, stride_oh,
                 stride_os, stride_lt, stride_lh, W, NUM_SPLITS),
                NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE, PAGE_SIZE, WRITE_LSE, MASK, CHUNK_BS, CHUNK_CAP)
