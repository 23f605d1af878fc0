"""What the warp-specialized Gluon MLA kernels share (``seesaw``: 32-token tiles in 4
stages; ``chunked``: 64-token tiles in 2 stages, loaded and freed in 64-column chunks;
``dbuf``: 64-token tiles double-buffered, both groups on one tile): the
partitions and their registers, a warp group's output columns, the q copy of the loader, the
softmax step against the running max, and the end (row sums of both groups added, normalized,
stored). One program: a 64-row tile (query rows x heads); a left warp group (the default
partition) owning output columns 0..255, a right one owning 256..511 (``dbuf``: 0..127 and
128..511), a loader warp group.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from .wgmma import _program, _rows_of, _tile_rows, _visible, hopper_device

BLOCK_M = gl.constexpr(64)      # tile rows (queries x heads): one wgmma M per warp group
HALF = gl.constexpr(256)        # output columns of one warp group (by default)
DEFAULT_WARPS = 4               # the launch's num_warps: the left group, the default partition
GROUP_WARPS = gl.constexpr(4)   # the right group
LOADER_WARPS = gl.constexpr(4)  # the loader (one warp group: registers are handed out by groups)
GROUP_REGS = gl.constexpr(232)
LOADER_REGS = gl.constexpr(40)
MAXNREG = 168                   # at launch: 12 warps x 168 registers, then handed out by group
# A warp group's output half [64, 256] on wgmma (4 warps): the default accumulator layout.
O_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                             instr_shape=[16, HALF.value, 16]))


def _store_layout(cols: int) -> gl.DistributedLinearLayout:
    """A [64, cols] 16-bit output's layout for its store: each thread's rows those of the wgmma
    accumulator (lanes 4r..4r+3 hold rows r and r + 8 of their warp's 16), its values 8
    consecutive columns (16 bytes) in each 32-column block (lane % 4 picks the block's quarter),
    where the accumulator's hold 2 (4 bytes: a half sector a row of a warp's store). From the
    accumulator it moves values between the 4 lanes of a quad only; Triton 3.6 still converts
    through shared memory, 3,840 bytes more a program (sm_90: dbuf 222,656 -> 226,496 of 232,448;
    ``bench/probes/offline_sm90.py``)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]] + [[0, c] for c in (32, 64, 128, 256) if c < cols],
        lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
        shape=[64, cols])


STORE_L128 = gl.constexpr(_store_layout(128))     # the output column counts of a warp group
STORE_L256 = gl.constexpr(_store_layout(256))


@gluon.jit
def _q_slab(q_ptr, offs_m, wb, hb, row0, W, stride_qt, stride_qh, NUM_HEADS: gl.constexpr,
            BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr):
    """Row pointers of q and their validity for tile rows ``offs_m``."""
    j, heads, rows, ok = _rows_of(offs_m, wb, hb, row0, W, NUM_HEADS, BLOCK_H, BLOCK_W)
    return q_ptr + rows * stride_qt + heads * stride_qh, ok


@gluon.jit
def _slabs(LATENT: gl.constexpr, ROPE: gl.constexpr):
    """Row and column offsets of the loader's cp.async slabs, 16 bytes a thread: [8, LATENT]
    latent slabs (a warp copies 256 columns of a row) and [16, ROPE] rope slabs (a warp copies 64
    columns of 4 rows): (latent rows, rope rows, latent columns, rope columns)."""
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    LR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    return (gl.arange(0, 8, layout=gl.SliceLayout(1, LD)), gl.arange(0, 16, layout=gl.SliceLayout(1, LR)),
            gl.arange(0, LATENT, layout=gl.SliceLayout(0, LD)), gl.arange(0, ROPE, layout=gl.SliceLayout(0, LR)))


@gluon.jit
def _copy_q(q_src, q_lat, q_pe, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
            LATENT: gl.constexpr, ROPE: gl.constexpr):
    """Issue the cp.async copies of the tile's q rows (rows past W or H zero-filled) by the
    loader warp group, in ``_slabs``; ``q_src`` from ``_loader_start``."""
    q_ptr, wb, hb, row0, W, stride_qt, stride_qh = q_src
    r_d, r_r, c_d, c_r = _slabs(LATENT, ROPE)
    for r in gl.static_range(0, BLOCK_M, 8):
        q_row, q_ok = _q_slab(q_ptr, r + r_d, wb, hb, row0, W, stride_qt, stride_qh, NUM_HEADS,
                              BLOCK_H, BLOCK_W)
        async_copy.async_copy_global_to_shared(q_lat.slice(r, 8, dim=0),
                                               q_row[:, None] + c_d[None, :], q_ok[:, None])
    for r in gl.static_range(0, BLOCK_M, 16):
        q_row, q_ok = _q_slab(q_ptr, r + r_r, wb, hb, row0, W, stride_qt, stride_qh, NUM_HEADS,
                              BLOCK_H, BLOCK_W)
        async_copy.async_copy_global_to_shared(q_pe.slice(r, 16, dim=0),
                                               q_row[:, None] + LATENT + c_r[None, :], q_ok[:, None])


@gluon.jit
def _softmax(s, m_prev, n0, end, j, row_ok, prefix, draft_prefix, q_len, mask_ptr, mask_base,
             scale_log2, MASK: gl.constexpr, SL: gl.constexpr, N: gl.constexpr):
    """P of one N-token tile (scores in layout SL) against the running max: (P, the new max,
    the rescale of earlier sums, P's row sums)."""
    vis = _visible(SL, n0, end, j, row_ok, prefix, draft_prefix, q_len, mask_ptr, mask_base,
                   MASK, N)
    s = gl.where(vis, s * scale_log2, float("-inf"))
    m_new = gl.maximum(m_prev, gl.max(s, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)   # a row with nothing visible yet
    p = gl.exp2(s - m_safe[:, None])
    return p, m_new, gl.exp2(m_prev - m_safe), gl.sum(p, axis=1)


@gluon.jit
def _rescale(m_old, m_new):
    """exp2(m_old - m_new), 0 while m_new is -inf (nothing visible yet: all sums are 0)."""
    return gl.exp2(m_old - gl.where(m_new == float("-inf"), 0.0, m_new))


@gluon.jit
def _scale(acc, f, OL: gl.constexpr = O_L):
    """The output columns' rows (``acc`` in layout ``OL``) times ``f`` (a per-row factor in the
    scores' row layout)."""
    return acc * gl.convert_layout(f, gl.SliceLayout(1, OL))[:, None]


@gluon.jit
def _dot_a(p16, OL: gl.constexpr = O_L):
    """P in registers as the A operand of the P . V wgmma into an accumulator of layout ``OL``."""
    return gl.convert_layout(p16, gl.DotOperandLayout(operand_index=0, parent=OL, k_width=2))


@gluon.jit
def _group_start(ptrs, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
                 MASK: gl.constexpr, N: gl.constexpr, CHUNK_BS: gl.constexpr, CHUNK_CAP: gl.constexpr,
                 ROW_L: gl.constexpr,
                 COLS: gl.constexpr = HALF, OL: gl.constexpr = O_L):
    """A warp group's start: its program (``_program`` on N-token tiles), its tile's rows (in
    ``ROW_L``), and the running max, row sums and output columns it carries (``COLS`` of them,
    in ``OL``; half by default): (hb, wb, split, prefix, draft_prefix, start, end, num_tiles,
    row0, j, heads, rows, row_ok, mask_base, m, l_i, acc)."""
    (q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
     scale_log2, stride_qt, stride_qh, stride_kvs, stride_pb, stride_ot, stride_oh, stride_os,
     stride_lt, stride_lh, W, NUM_SPLITS) = ptrs
    hb, wb, b, split, prefix, draft_prefix, start, end, num_tiles = _program(
        seq_lens_ptr, draft_prefix_ptr, lse_ptr, W, NUM_SPLITS, MASK, NUM_HEADS, BLOCK_H, BLOCK_W, N, CHUNK_BS,
        CHUNK_CAP)
    row0 = b.to(gl.int64) * W
    j, heads, rows, row_ok = _tile_rows(wb, hb, row0, W, NUM_HEADS, BLOCK_H, BLOCK_W, ROW_L)
    return (hb, wb, split, prefix, draft_prefix, start, end, num_tiles, row0, j, heads, rows, row_ok,
            b.to(gl.int64) * W * W, gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW_L),
            gl.zeros([BLOCK_M], gl.float32, layout=ROW_L), gl.zeros([BLOCK_M, COLS], gl.float32, layout=OL))


@gluon.jit
def _softmax_args(ptrs):
    """The launch arguments a warp group's softmax and P read: (q_ptr, for q's element type,
    mask_ptr, scale_log2, W)."""
    (q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
     scale_log2, stride_qt, stride_qh, stride_kvs, stride_pb, stride_ot, stride_oh, stride_os,
     stride_lt, stride_lh, W, NUM_SPLITS) = ptrs
    return q_ptr, mask_ptr, scale_log2, W


@gluon.jit
def _loader_start(ptrs, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
                  MASK: gl.constexpr, N: gl.constexpr, CHUNK_BS: gl.constexpr, CHUNK_CAP: gl.constexpr = 0):
    """The loader's program (``_program`` on N-token tiles): (start, end, num_tiles, the request's
    page-table row, kv_ptr, stride_kvs, and where the tile's q rows are: ``_copy_q``'s ``q_src``)."""
    (q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
     scale_log2, stride_qt, stride_qh, stride_kvs, stride_pb, stride_ot, stride_oh, stride_os,
     stride_lt, stride_lh, W, NUM_SPLITS) = ptrs
    hb, wb, b, split, prefix, draft_prefix, start, end, num_tiles = _program(
        seq_lens_ptr, draft_prefix_ptr, lse_ptr, W, NUM_SPLITS, MASK, NUM_HEADS, BLOCK_H, BLOCK_W, N, CHUNK_BS,
        CHUNK_CAP)
    pt_row = page_table_ptr + b * stride_pb
    row0 = b.to(gl.int64) * W
    return start, end, num_tiles, pt_row, kv_ptr, stride_kvs, (q_ptr, wb, hb, row0, W, stride_qt, stride_qh)


@gluon.jit
def _tile_at(kv_ptr, stride_kvs, pt_row, page, start, t, num_tiles, PAGE_SIZE: gl.constexpr, N: gl.constexpr):
    """Tile t's first token and KV address (``page``: its page) and tile t + 1's page (0 past the
    last tile), loaded a tile ahead: loaded where it is used, its latency stalls every tile."""
    n0 = start + t * N
    base = kv_ptr + (page.to(gl.int64) * PAGE_SIZE + n0 % PAGE_SIZE) * stride_kvs
    page = gl.load(pt_row + (n0 + N) // PAGE_SIZE, mask=t + 1 < num_tiles, other=0)
    return n0, base, page


@gluon.jit
def _finish(acc, l_own, m, l_x, bar_l, GROUP: gl.constexpr, ptrs, rows, heads, row_ok, split, wb,
            hb, row0, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
            WRITE_LSE: gl.constexpr, ROW_L: gl.constexpr):
    """Add the two groups' row sums (through shared memory; ``ROW_L`` their layout), normalize
    and store this group's 256 columns; the left group also stores the log-sum-exp."""
    l_i = _row_sums(l_own, m, l_x, bar_l, GROUP, ptrs, rows, heads, row_ok, split, WRITE_LSE, ROW_L)
    _store_out(acc, l_i, ptrs, split, wb, hb, row0, GROUP * HALF, NUM_HEADS, BLOCK_H, BLOCK_W, HALF, O_L)


@gluon.jit
def _row_sums(l_own, m, l_x, bar_l, GROUP: gl.constexpr, ptrs, rows, heads, row_ok, split,
              WRITE_LSE: gl.constexpr, ROW_L: gl.constexpr):
    """The tile's row sums, this group's and the other's added through shared memory (``ROW_L``
    their layout); the left group (0) stores the log-sum-exp."""
    (q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
     scale_log2, stride_qt, stride_qh, stride_kvs, stride_pb, stride_ot, stride_oh, stride_os,
     stride_lt, stride_lh, W, NUM_SPLITS) = ptrs
    l_x.slice(GROUP * BLOCK_M, BLOCK_M).store(l_own)
    mbarrier.arrive(bar_l)
    mbarrier.wait(bar_l, 0)
    l_i = l_own + l_x.slice((1 - GROUP) * BLOCK_M, BLOCK_M).load(ROW_L)
    if GROUP == 0:
        if WRITE_LSE:
            nonempty = l_i > 0
            lse = gl.where(nonempty, m + gl.log2(gl.where(nonempty, l_i, 1.0)), float("-inf"))
            gl.store(lse_ptr + rows * stride_lt + heads * stride_lh + split, lse, mask=row_ok)
    return l_i


@gluon.jit
def _store_out(acc, l_i, ptrs, split, wb, hb, row0, COL0: gl.constexpr, NUM_HEADS: gl.constexpr,
               BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr, COLS: gl.constexpr, OL: gl.constexpr):
    """Output columns COL0 .. COL0 + COLS (``acc`` in ``OL``) normalized by the row sums ``l_i``
    (empty rows: zeros) and stored."""
    (q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
     scale_log2, stride_qt, stride_qh, stride_kvs, stride_pb, stride_ot, stride_oh, stride_os,
     stride_lt, stride_lh, W, NUM_SPLITS) = ptrs
    nonempty = l_i > 0
    inv = gl.convert_layout(1.0 / gl.where(nonempty, l_i, 1.0), gl.SliceLayout(1, OL))
    keep = gl.convert_layout(nonempty, gl.SliceLayout(1, OL))
    out = gl.where(keep[:, None], acc * inv[:, None], 0.0).to(o_ptr.dtype.element_ty)   # empty rows: zeros
    if o_ptr.dtype.element_ty.primitive_bitwidth == 16 and (COLS == 128 or COLS == 256):
        SL: gl.constexpr = STORE_L256 if COLS == 256 else STORE_L128
        _store_rows(gl.convert_layout(out, SL), ptrs, split, wb, hb, row0, COL0, NUM_HEADS, BLOCK_H, BLOCK_W,
                    COLS, SL)
    else:
        _store_rows(out, ptrs, split, wb, hb, row0, COL0, NUM_HEADS, BLOCK_H, BLOCK_W, COLS, OL)


@gluon.jit
def _store_rows(out, ptrs, split, wb, hb, row0, COL0: gl.constexpr, NUM_HEADS: gl.constexpr,
                BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr, COLS: gl.constexpr, L: gl.constexpr):
    """``out`` (in ``L``) stored at its tile rows' output columns COL0 .. COL0 + COLS."""
    (q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
     scale_log2, stride_qt, stride_qh, stride_kvs, stride_pb, stride_ot, stride_oh, stride_os,
     stride_lt, stride_lh, W, NUM_SPLITS) = ptrs
    j_o, heads_o, rows_o, ok_o = _tile_rows(wb, hb, row0, W, NUM_HEADS, BLOCK_H, BLOCK_W, gl.SliceLayout(1, L))
    _ = j_o
    cols = COL0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, L))
    gl.store(o_ptr + rows_o[:, None] * stride_ot + heads_o[:, None] * stride_oh + split * stride_os
             + cols[None, :], out, mask=ok_o[:, None])


def warp_specialized_refusal(tile_tokens: int, stages: int, page_size: int, block_n=None,
                             num_warps=None, num_stages=None):
    """Why a warp-specialized kernel on ``tile_tokens``-token tiles in ``stages`` stages cannot
    serve a launch that ``wgmma`` serves (None where it can): its loader reads each tile's
    tokens from one page, and its launch is its own."""
    if page_size % tile_tokens:
        return f"needs pages of a multiple of {tile_tokens} tokens (page_size={page_size})"
    if (block_n, num_warps, num_stages) != (None, None, None):
        return (f"runs {tile_tokens}-token tiles in {stages} stages on 12 warps, no knobs "
                f"(got block_n={block_n}, num_warps={num_warps}, num_stages={num_stages})")
    return None


def partial_dtype(dtype: torch.dtype, device: torch.device, page_size: int, rows: int, latent: int,
                  rope: int) -> torch.dtype:
    """The dtype of the split partials of ``mla_attention_fwd``'s launches of ``rows``-row tiles
    (block_w x block_h) of ``dtype`` on ``device``, ``latent`` + ``rope`` dims: ``dtype`` where
    the default launch takes a warp-specialized kernel (16-bit, 64-row tiles, 512 + 64 dims,
    sm_90, pages of whole 32-token tiles; q and cache rows 16-byte aligned, which is not asked
    here), whose 16-bit stores are 16 bytes a thread (``STORE_L128``, ``STORE_L256``); float32 elsewhere. The
    backend sizes its graph workspaces by it and the wrapper its own, so that graph and eager
    launches round alike. As FlashInfer's MLA plan (partial_o at 2 bytes a value); the merge sums
    in float32. 16-bit partials are faster on the warp-specialized kernels and slower on the
    transposed kernel (4-byte 16-bit stores), so float32 there (figures: bench/RESULTS.md, 'MLA
    kernels'). Off sm_90 the Triton kernel keeps float32 (not measured with 16-bit partials); on sm_90 a
    launch the Gluon kernels refuse (a q's strides, or the chunk pass's Triton tile) stores into the
    16-bit workspace sized by this rule (its stores convert to the workspace's dtype)."""
    warp_specialized = (dtype in (torch.float16, torch.bfloat16) and rows == BLOCK_M.value
                        and (latent, rope) == (512, 64) and hopper_device(device)
                        and warp_specialized_refusal(32, 4, page_size) is None)
    return dtype if warp_specialized else torch.float32
