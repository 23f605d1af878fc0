"""Absorbed MLA decode with few heads on Hopper in Gluon: scores and output computed transposed
("swap AB"), KV tokens on the wgmma M axis and a program's 16 heads on N.

Why: a decode row of 16 heads fills a quarter of the 64-row wgmma tile the other Gluon kernels
use, so padded to 64 rows it pays four times the tensor work of its 16 rows, and the Triton
kernel runs it on mma.sync. Here S^T = K . q^T (M = 64 tokens, N = 16 heads, K = 576) and
O^T = V^T . P^T (M = 512 latent columns, N = 16, K = 64 tokens): the tensor work of the 16 rows
alone, so the consumer frees a stage sooner and more of the ring is in flight.

- The consumer warp group (the default partition) waits for each tile chunk by chunk, computes
  S^T, the softmax over the tile's tokens (a column max and sum across its four warps), stores
  P^T (as P, heads by tokens) and runs O^T += V^T . P^T from shared memory, the tile transposed
  as the A operand; the stage is freed after it.
- The loader is ``dbuf``'s: q, then tile t into stage t % 2 by masked cp.async (tokens past
  the split's end zero-filled: NaN in unused slots stays out), page indices a tile ahead.

Decode only (one query row a request, causal), 16-head blocks (``BLOCK_H`` 16, heads past H
masked), pages of whole 64-token tiles; same split outputs as the other kernels.

It runs one program an SM (the split rule of ``TritonMLABackend``): a program holds a whole SM's
shared memory, so a second program an SM waits for the first. There it is faster than the
Triton kernel and FlashInfer's fa3 at every decode point measured (figures: bench/RESULTS.md,
'MLA kernels').
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .chunked import BLOCK_N, CHUNK, RING
from .dbuf import NUM_STAGES
from .wgmma import _program, hopper_device

HEADS = gl.constexpr(16)   # wgmma N: the heads of a program
# S^T [64 tokens, 16 heads] and O^T [512, 16] on wgmma (4 warps, 16 rows of M each)
ST = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                            instr_shape=[16, HEADS.value, 16]))
COL = gl.constexpr(gl.SliceLayout(0, ST.value))   # a value a head
TOK = gl.constexpr(gl.SliceLayout(1, ST.value))   # a value a token (or latent column)


@gluon.jit
def _scores_t(q_lat, q_pe, lat, rope, ready, stage, ph, zero, LATENT: gl.constexpr):
    """S^T = K . q^T of the tile in ``stage`` (q's first 16 rows), each chunk's wgmma issued as
    soon as it has landed; ``zero`` is a run-time 0 indexing q (``chunked._score_part``)."""
    s = gl.zeros([BLOCK_N, HEADS], gl.float32, layout=ST)
    q16 = q_lat.index(zero).slice(0, HEADS, dim=0)
    for c in gl.static_range(LATENT // CHUNK):
        mbarrier.wait(ready.index(RING * stage + c), ph)
        fence_async_shared()
        s = warpgroup_mma(lat.index(stage).slice(c * CHUNK, CHUNK, dim=1),
                          q16.slice(c * CHUNK, CHUNK, dim=1).permute((1, 0)), s,
                          use_acc=c > 0, is_async=True)
    mbarrier.wait(ready.index(RING * stage + RING - 1), ph)
    fence_async_shared()
    s = warpgroup_mma(rope.index(stage), q_pe.index(zero).slice(0, HEADS, dim=0).permute((1, 0)), s,
                      is_async=True)
    return warpgroup_mma_wait(0, deps=(s,))


@gluon.jit
def _consumer(ptrs, smem, bars, NUM_HEADS: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr,
              LATENT: gl.constexpr, ROPE: gl.constexpr, PAGE_SIZE: gl.constexpr,
              WRITE_LSE: gl.constexpr, MASK: gl.constexpr, CHUNK_BS: gl.constexpr, CHUNK_CAP: gl.constexpr = 0):
    """Each tile's S^T, softmax over its tokens, P^T to shared memory and O^T += V^T . P^T; the
    stage freed after it; at the end O^T normalized and stored transposed (and the log-sum-exp)."""
    (q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, o_ptr, lse_ptr,
     scale_log2, stride_qt, stride_qh, stride_kvs, stride_pb, stride_ot, stride_oh, stride_os,
     stride_lt, stride_lh, W, NUM_SPLITS) = ptrs
    q_lat, q_pe, lat, rope, p_t, unused = smem
    ready, empty, unused_p, unused_l = bars
    hb, wb, b, split, prefix, draft_prefix, start, end, num_tiles = _program(
        seq_lens_ptr, draft_prefix_ptr, lse_ptr, W, NUM_SPLITS, MASK, NUM_HEADS, BLOCK_H, BLOCK_W, BLOCK_N, CHUNK_BS,
        CHUNK_CAP)
    m = gl.full([HEADS], float("-inf"), gl.float32, layout=COL)
    l_i = gl.zeros([HEADS], gl.float32, layout=COL)
    acc = gl.zeros([LATENT, HEADS], gl.float32, layout=ST)
    tok = gl.arange(0, BLOCK_N, layout=TOK)
    for t in range(num_tiles):
        stage = t % NUM_STAGES
        s = _scores_t(q_lat, q_pe, lat, rope, ready, stage, (t // NUM_STAGES) & 1,
                      t // (num_tiles + 2), LATENT)
        s = gl.where((start + t * BLOCK_N + tok < end)[:, None], s * scale_log2, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)   # a head with nothing visible yet
        p = gl.exp2(s - m_safe[None, :])
        alpha = gl.exp2(m - m_safe)
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m = m_new
        p_t.store(gl.permute(p.to(q_ptr.dtype.element_ty), (1, 0)))   # P [heads, tokens]
        fence_async_shared()
        gl.thread_barrier()                                          # every warp's P stored
        acc = acc * alpha[None, :]
        acc = warpgroup_mma(lat.index(stage).permute((1, 0)), p_t.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(stage))
    heads = hb * HEADS + gl.arange(0, HEADS, layout=COL)
    ok = heads < NUM_HEADS
    nonempty = l_i > 0
    row = b.to(gl.int64) * W
    if WRITE_LSE:
        lse = gl.where(nonempty, m + gl.log2(gl.where(nonempty, l_i, 1.0)), float("-inf"))
        gl.store(lse_ptr + row * stride_lt + heads * stride_lh + split, lse, mask=ok)
    out = gl.where(nonempty[None, :], acc * (1.0 / gl.where(nonempty, l_i, 1.0))[None, :], 0.0)
    cols = gl.arange(0, LATENT, layout=TOK)
    gl.store(o_ptr + row * stride_ot + heads[None, :] * stride_oh + split * stride_os + cols[:, None],
             out.to(o_ptr.dtype.element_ty), mask=ok[None, :])


def swap_refusal(page_size: int, block_w: int, block_h: int, W: int, mask: str, block_n=None,
                 num_warps=None, num_stages=None):
    """Why ``_mla_swap_kernel`` cannot serve a launch whose inputs ``wgmma`` would take
    (16-bit, 512 + 64, aligned, sm_90, uniform rows; None where it can)."""
    if W != 1 or mask != "causal":
        return f"runs decode only (one query row a request, causal; got W={W}, mask={mask!r})"
    if (block_w, block_h) != (1, HEADS.value):
        return f"needs 16-head tiles of one row (block_w={block_w}, block_h={block_h})"
    if page_size % BLOCK_N.value:
        return f"needs pages of a multiple of {BLOCK_N.value} tokens (page_size={page_size})"
    if (block_n, num_warps, num_stages) != (None, None, None):
        return (f"runs {BLOCK_N.value}-token tiles in 2 stages on 8 warps, no knobs (got block_n="
                f"{block_n}, num_warps={num_warps}, num_stages={num_stages})")
    return None


def decodes_transposed(device: torch.device, dtype: torch.dtype, page_size: int) -> bool:
    """Whether ``mla_attention_fwd``'s default runs uniform causal decode tiles of 16 heads (MLA
    with fewer than 64 heads) on this kernel here, for a q and cache its copies can read (16-byte
    aligned rows, 512 + 64 dims: a contiguous q and the cache pool): an sm_90 GPU, 16-bit, pages
    this kernel takes. The ``triton_mla`` backend asks before it sizes a decode batch's splits
    (one program an SM)."""
    return (dtype in (torch.float16, torch.bfloat16) and hopper_device(device)
            and swap_refusal(page_size, 1, HEADS.value, 1, "causal") is None)
