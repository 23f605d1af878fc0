"""Absorbed MLA attention over the paged latent cache: decode (W = 1) and verify (W rows).

Cache ``kv_buffer [num_slots, 1, 576]`` holds latent 512 then rope 64 per token; query
``q [bs*W, H, 576]`` holds the absorbed q_nope 512 then q_pe 64. Scores use all 576
columns; the output is softmax . latent -> ``[bs*W, H, 512]`` (still in latent space).

One program handles BLOCK_W query rows times BLOCK_H heads of one request (rows
flattened into BLOCK_M = BLOCK_W * BLOCK_H); each latent tile it loads serves both as K
(scores) and as V (output). Programs that share a request's KV (its row blocks and head
blocks) are adjacent on the fastest grid axis, so that when BLOCK_W < W or BLOCK_H < H
the repeated tile reads of neighbours come from L2 while the tile state per program stays
small. A split-KV axis gives the parallelism, merged by ``merge_splits``; split boundaries
come from ``seq_lens_k`` on the device and the grid from host ints only, so the launch is
graph safe. Verify masks: causal, tree (``custom_mask [bs*W*W]``) or draft, as in
``extend_attention``.

This module's kernel is plain Triton and runs everywhere (the CPU interpreter included). On an sm_90 GPU,
16-bit 64-row tiles go to a Gluon kernel instead (same arguments, masks and split outputs): a warp-specialized
kernel, ``chunked``'s where pages hold whole 64-token tiles (``dbuf``'s there when one program reads
each request's KV), ``seesaw``'s where they hold whole 32-token tiles, ``wgmma``'s elsewhere; and
decode tiles of 16 heads go to ``swap``'s (scores and output transposed) where pages hold whole 64-token
tiles. Triton gives this kernel's 64-row tile a score layout in which both warp groups compute the whole score
tile.
"""

import torch
import triton
import triton.language as tl

from ..attention_core import LOG2E, check_paged_inputs, fit_block_n, merge_splits, split_targets
from ..extend_attention import MASK_KINDS
from ..launch_record import cdiv, launch, pow2
from .chunked import chunked_refusal
from .dbuf import dbuf_refusal
from .prologue import _mla_chunked_kernel, _mla_dbuf_kernel, _mla_seesaw_kernel, _mla_swap_kernel, _mla_wgmma_kernel
from .seesaw import seesaw_refusal
from .swap import HEADS as SWAP_ROWS
from .swap import swap_refusal
from .walk import _mla_rows, _mla_store, _mla_walk
from .warpspec import DEFAULT_WARPS, MAXNREG, partial_dtype
from .wgmma import WARPS, wgmma_refusal

KERNELS = (None, "triton", "wgmma", "seesaw", "chunked", "dbuf", "swap")
SPECIALIZED = dict(num_warps=DEFAULT_WARPS, maxnreg=MAXNREG)   # the warp-specialized launches
GLUON_LAUNCH = {"wgmma": (_mla_wgmma_kernel, dict(num_warps=WARPS)),
                "seesaw": (_mla_seesaw_kernel, SPECIALIZED),
                "chunked": (_mla_chunked_kernel, SPECIALIZED),
                "dbuf": (_mla_dbuf_kernel, SPECIALIZED),
                "swap": (_mla_swap_kernel, SPECIALIZED)}   # 8 warps: the consumer group and the loader
# the warp-specialized kernels: why each cannot serve a launch the wgmma kernel serves
REFUSALS = {"seesaw": seesaw_refusal, "chunked": chunked_refusal, "dbuf": dbuf_refusal}
# what kernel=None runs on sm_90, in order of preference, where it serves the launch (else wgmma);
# a streaming launch (one program reads each request's KV) has its own order
HOPPER_DEFAULTS = ("chunked", "seesaw")
STREAMING_DEFAULTS = ("dbuf", "seesaw")


@triton.jit
def _mla_split_kernel(
    q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, cu_q_ptr, mask_ptr,
    draft_prefix_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kvs,
    stride_pb,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    W, NUM_SPLITS,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
    LATENT: tl.constexpr, ROPE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_LSE: tl.constexpr,
    MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr, RAGGED: tl.constexpr, v_scale=1.0,
):
    # W (query rows per request, the ragged bound) and NUM_SPLITS are plain ints, not
    # constexprs: a compiled kernel serves the widths and split counts of one specialization
    # class (Triton specializes a value of 1 and multiples of 16), so a server's graph buckets
    # and a suite's random cases do not each compile the 576-wide kernel anew.
    NUM_HB: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    pid = tl.program_id(0)
    hb = pid % NUM_HB  # head blocks of one row block adjacent: the fastest axis
    wb = pid // NUM_HB
    b = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    row0, q_len, j, heads, row_ok, q_a, q_b, q_pe = _mla_rows(
        q_ptr, cu_q_ptr, b, wb, hb, stride_qt, stride_qh, W, NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE, RAGGED)
    if wb * BLOCK_W >= q_len:
        return  # a row block past this request's rows: nothing to compute or store
    prefix = seq_len - q_len
    draft_prefix = 0
    if MASK == 2:
        draft_prefix = tl.load(draft_prefix_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if MASK == 0:  # causal: nothing past the block's last row is visible (prefill chunks)
        end = tl.minimum(end, prefix + wb * BLOCK_W + BLOCK_W)
    m_i, l_i, acc_a, acc_b = _mla_walk(
        q_a, q_b, q_pe, kv_ptr, page_table_ptr + b * stride_pb, start, end, j, q_len, seq_len, prefix,
        draft_prefix, mask_ptr, b.to(tl.int64) * W * W, scale_log2, stride_kvs, BLOCK_W * BLOCK_H, LATENT, ROPE,
        PAGE_SIZE, BLOCK_N, MASK, INPUT_PRECISION)
    rows = row0 + j
    _mla_store(o_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + split * stride_os,
               lse_ptr + rows * stride_lt + heads * stride_lh + split, m_i, l_i, acc_a, acc_b, row_ok,
               v_scale, LATENT, WRITE_LSE)


def mla_attention_fwd(q, kv_buffer, page_table, seq_lens_k, page_size, sm_scale, num_kv_splits,
                      out, q_per_req=1, mask="causal", custom_mask=None, workspace=None,
                      block_h=None, block_w=None, block_n=None, num_warps=None,
                      num_stages=None, cu_seqlens_q=None, max_q_len=None, draft_prefix_lens=None,
                      kernel=None, kv_scale=1.0):
    """Absorbed MLA attention (decode when ``q_per_req == 1``, verify otherwise) into ``out``.

    Parameters
    ----------
    q : [bs*W, H, 576] (latent 512 + rope 64), float16/bfloat16/float32
    kv_buffer : [num_slots, 1, 576], q's dtype or FP8 (holding value / ``kv_scale``, the latent
        cache's one scale; the Triton kernel widens it on load, the Gluon kernels refuse it)
    page_table : [>=bs, max_pages] int32; seq_lens_k : [>=bs] int32 (>= W each)
    page_size, num_kv_splits, q_per_req (W) : host ints
    out : [bs*W, H, 512], q's dtype
    mask : "causal", "tree" (``custom_mask`` bool/uint8 [bs*W*W]) or "draft"
        (``draft_prefix_lens`` int32 [bs]: row j sees p < draft_prefix or (p - draft_prefix) % W == j)
    cu_seqlens_q, max_q_len : ragged EXTEND (causal only): rows of request i are
        ``cu[i]:cu[i+1]``; ``max_q_len`` (host int) bounds them and sizes the grid
    workspace : ``decode_workspace(bs*W, H, 512, num_kv_splits)`` when num_kv_splits > 1, its
        partials float32 or q's dtype; allocated here when None, its partials'
        ``warpspec.partial_dtype``
    block_w, block_h, block_n, num_warps, num_stages : tuning knobs
        (query rows, heads and KV tokens per tile); None picks the swept defaults
    kernel : None: a Gluon kernel where one serves (sm_90, 16-bit, 64-row tiles, uniform rows,
        16-byte aligned rows; by default verify W >= 3 at 16 heads, decode at >= 64 heads;
        or 16-row decode tiles),
        where no block_n / num_warps / num_stages is given ``chunked``'s where pages hold
        whole 64-token tiles (``dbuf``'s when one program reads each request's KV),
        else ``seesaw``'s where they hold whole 32-token tiles, else
        ``wgmma``'s; decode tiles of 16 heads on ``swap``'s where pages hold whole
        64-token tiles (``swap.decodes_transposed``); the Triton kernel elsewhere. "triton", "wgmma",
        "seesaw", "chunked", "dbuf" or "swap" asks for one (ValueError, with the reason, where
        it cannot serve)
    """
    name = "mla_attention_fwd"
    if kernel not in KERNELS:
        raise ValueError(f"{name}: kernel={kernel!r} not in {KERNELS}")
    ragged = cu_seqlens_q is not None
    W, bs, mask_arg, draft_arg = _check_inputs(name, q, kv_buffer, page_table, seq_lens_k,
                                               page_size, num_kv_splits, out, q_per_req, mask,
                                               custom_mask, cu_seqlens_q, max_q_len,
                                               draft_prefix_lens, kv_scale)
    T, H, D = q.shape
    Dv = out.shape[-1]
    block_w, block_h, block_n_, num_warps_, num_stages_ = _tile_config(
        q, W, H, D, block_w, block_h, block_n, num_warps, num_stages)
    per_request = cdiv(W, block_w) * cdiv(H, block_h)   # programs reading one request's KV
    use = _pick_kernel(name, kernel, q, kv_buffer, Dv, D - Dv, block_w * block_h, block_n,
                       num_warps, num_stages, ragged, page_size,
                       streaming=per_request == 1, width=W, mask=mask,
                       block_w=block_w)
    if bs == 0:
        return out
    part = (partial_dtype(kv_buffer.dtype, out.device, page_size, block_w * block_h, Dv, D - Dv)  # as the backend
            if workspace is None and num_kv_splits > 1 else torch.float32)   # else unused: not computed
    o, lse, _, o_strides, lse_strides = split_targets(name, out, workspace, num_kv_splits, part_dtype=part,
                                                      out_dtype_partials=True)
    grid = (per_request, bs, num_kv_splits)
    tail = (mask_arg, draft_arg, o, lse, sm_scale * LOG2E * kv_scale, q.stride(0), q.stride(1),
            kv_buffer.stride(0), page_table.stride(0), *o_strides, *lse_strides, W, num_kv_splits)
    tiles = dict(NUM_HEADS=H, BLOCK_H=block_h, BLOCK_W=block_w, LATENT=Dv, ROPE=D - Dv,
                 PAGE_SIZE=page_size, WRITE_LSE=num_kv_splits > 1, MASK=MASK_KINDS[mask])
    if use == "triton":
        launch(_mla_split_kernel, grid, q, kv_buffer, page_table, seq_lens_k,
               cu_seqlens_q if ragged else seq_lens_k, *tail, **tiles, BLOCK_N=block_n_,
               RAGGED=ragged, INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
               num_warps=num_warps_, num_stages=num_stages_, v_scale=kv_scale)
    else:
        gluon_kernel, warps = GLUON_LAUNCH[use]
        launch(gluon_kernel, grid, q, kv_buffer, page_table, seq_lens_k, *tail, **tiles, **warps)
    if num_kv_splits > 1:
        merge_splits(o, lse, out)
    return out


def _pick_kernel(name, kernel, q, kv_buffer, latent, rope, rows, block_n, num_warps, num_stages,
                 ragged, page_size, *, streaming=False, width, mask, block_w) -> str:
    """Which kernel runs the launch: the one asked for (ValueError, with the reason, where it
    cannot serve), or for None the Gluon kernels where they serve (``HOPPER_DEFAULTS`` first;
    explicit block_n / num_warps / num_stages knobs are the wgmma kernel's, the warp-specialized
    kernels take none) and the Triton kernel elsewhere. ``streaming``: one program reads each
    request's KV (MLA16 verify with W <= 4, or decode with 64 heads: the same work a program);
    ``STREAMING_DEFAULTS`` order the kernels there, ``dbuf`` in ``chunked``'s place (faster where
    a program has few tiles; figures: bench/RESULTS.md, 'MLA kernels'). 16-row tiles (decode of
    16 heads; ``width`` and ``mask`` say decode) take ``swap`` where it serves."""
    if kernel == "triton":
        return "triton"
    if kv_buffer.dtype != q.dtype:              # FP8: widened by the Triton kernel only
        if kernel is not None:
            raise ValueError(f"{name}: the {kernel} kernel does not read an FP8 cache ({kv_buffer.dtype})")
        return "triton"
    knobs = (block_n, num_warps, num_stages)
    if kernel == "swap" or (kernel is None and rows == SWAP_ROWS.value):
        # 16-row decode tiles: the wgmma kernel's input checks, the swap kernel's own shape
        refusal = (wgmma_refusal(q, kv_buffer, latent, rope, 64, None, None, None, ragged)
                   or swap_refusal(page_size, block_w, rows // block_w, width, mask, *knobs))
        if refusal is None:
            return "swap"
        if kernel == "swap":
            raise ValueError(f"{name}: the swap kernel {refusal}")
        return "triton"             # no other Gluon kernel takes a 16-row tile
    refusal = wgmma_refusal(q, kv_buffer, latent, rope, rows,
                            *((None,) * 3 if kernel in REFUSALS else knobs), ragged)
    if kernel in REFUSALS and refusal is None:
        refusal = REFUSALS[kernel](page_size, *knobs)
    if kernel is not None:
        if refusal:
            raise ValueError(f"{name}: the {kernel} kernel {refusal}")
        return kernel
    if refusal:
        return "triton"
    order = STREAMING_DEFAULTS if streaming else HOPPER_DEFAULTS
    return next((k for k in order if REFUSALS[k](page_size, *knobs) is None), "wgmma")


def _check_inputs(name, q, kv_buffer, page_table, seq_lens_k, page_size, num_kv_splits, out,
                  q_per_req, mask, custom_mask, cu_seqlens_q, max_q_len, draft_prefix_lens, kv_scale=1.0):
    """Every check of ``mla_attention_fwd``'s arguments; returns (W, bs, the mask argument,
    the draft-prefix argument), the last two placeholders where the mask reads none."""
    T, H, D = q.shape
    Dv = out.shape[-1]
    if cu_seqlens_q is not None:
        if (max_q_len is None or max_q_len < 1 or cu_seqlens_q.dtype != torch.int32
                or cu_seqlens_q.device != q.device or mask != "causal"):
            raise ValueError(f"{name}: ragged rows need cu_seqlens_q int32 on {q.device}, "
                             f"max_q_len >= 1 and mask='causal' (got max_q_len={max_q_len}, "
                             f"mask={mask!r})")
        W, bs = max_q_len, cu_seqlens_q.shape[0] - 1
    else:
        W = q_per_req
        if W < 1 or T % W != 0:
            raise ValueError(f"{name}: q has {T} rows, not a multiple of q_per_req={W}")
        bs = T // W
    check_paged_inputs(name, q, (kv_buffer,), page_table, seq_lens_k, page_size, bs, fp8_ok=True,
                       scales=(kv_scale, kv_scale))
    rope = D - Dv
    if (kv_buffer.shape[1] != 1 or kv_buffer.shape[2] != D or rope <= 0
            or pow2(Dv) != Dv or pow2(rope) != rope):
        raise ValueError(f"{name}: q {tuple(q.shape)}, out {tuple(out.shape)} and kv_buffer "
                         f"{tuple(kv_buffer.shape)} need kv [slots, 1, latent+rope] with "
                         f"power-of-two latent and rope dims (512 + 64)")
    if tuple(out.shape) != (T, H, Dv) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"{name}: out {tuple(out.shape)} {out.dtype}, expected "
                         f"({T}, {H}, {Dv}) {q.dtype} with contiguous last dim")
    if mask not in MASK_KINDS:
        raise ValueError(f"{name}: mask={mask!r} not in {sorted(MASK_KINDS)}")
    if num_kv_splits < 1:
        raise ValueError(f"{name}: num_kv_splits={num_kv_splits} must be >= 1")
    mask_arg = draft_arg = seq_lens_k  # placeholders, never read unless the mask needs them
    if mask == "draft":
        if (draft_prefix_lens is None or draft_prefix_lens.dtype != torch.int32
                or draft_prefix_lens.shape[0] < bs or draft_prefix_lens.device != q.device):
            raise ValueError(f"{name}: draft mask needs draft_prefix_lens int32 [>= {bs}] on {q.device}")
        draft_arg = draft_prefix_lens
    if mask == "tree":
        if (custom_mask is None or custom_mask.numel() < bs * W * W
                or custom_mask.dtype not in (torch.bool, torch.uint8)
                or custom_mask.device != q.device):
            raise ValueError(f"{name}: tree mask needs custom_mask bool/uint8 with >= "
                             f"bs*W*W = {bs * W * W} elements on {q.device}")
        mask_arg = custom_mask.view(torch.uint8) if custom_mask.dtype == torch.bool else custom_mask
    return W, bs, mask_arg, draft_arg


def tile_shape(W: int, H: int, block_w=None, block_h=None) -> tuple:
    """(block_w, block_h): query rows and heads of a tile, the caller's or the defaults; a request
    launches ``cdiv(W, block_w) * cdiv(H, block_h)`` programs a split (the backend's split rule
    counts them here)."""
    if block_w is None:
        block_w = min(pow2(W), 4)
    if block_h is None:  # decode with >= 64 heads: one 64-head tile reads each latent tile for
        # 64 heads, a quarter of the tile reads of 16-head tiles (figures: bench/RESULTS.md,
        # 'MLA kernels')
        block_h = 64 if W == 1 and H >= 64 else max(16 // block_w, min(pow2(H), 16))
    return block_w, block_h


def _tile_config(q, W, H, D, block_w, block_h, block_n, num_warps, num_stages) -> tuple:
    """(block_w, block_h, block_n, num_warps, num_stages): the caller's, None filled with the
    defaults. The launch knobs are the Triton kernel's; the Gluon kernels have their own."""
    # Up to 4 query rows x 16 heads per tile (the sweeps of bench/tune.py); a 64-row tile needs
    # 8 warps for its [64, 512] float32 accumulator. (Splitting the two output halves over two
    # programs and TMA tile loads were slower, and were removed.)
    block_w, block_h = tile_shape(W, H, block_w, block_h)
    rows = block_w * block_h
    if rows < 16:  # tl.dot needs M >= 16
        raise ValueError(f"mla_attention_fwd: block_w={block_w} x block_h={block_h} rows < 16")
    # The Triton kernel's 64-row tiles (off sm_90, at float32, or asked for): 64 KV tokens per
    # tile halve the q re-reads from shared memory per token. Decode tiles of fewer rows (16
    # heads) take 64 KV tokens, 8 warps and 3 stages: faster than 32 / 4 / 2 at 13 of 15 points
    # (figures: bench/RESULTS.md, 'MLA kernels'). Triton 3.6 gives that config 116,736 bytes of
    # shared memory at bf16 on sm_90: taken where fit_block_n keeps 64 tokens, so not at float32
    # (which `check` runs).
    decode_tile = (W == 1 and rows < 64 and block_n in (None, 64)
                   and fit_block_n(q, 64, D * q.element_size()) == 64)
    if num_stages is None:
        num_stages = 3 if decode_tile else 2
    if block_n is None:  # as many tokens as the card's shared memory stages (float32 64-row tiles: 32)
        block_n = fit_block_n(q, 64 if rows >= 64 or decode_tile else 32, D * q.element_size())
    if num_warps is None:
        num_warps = 8 if rows >= 64 or decode_tile else 4
    return block_w, block_h, block_n, num_warps, num_stages


def mla_decode_fwd(q, kv_buffer, page_table, seq_lens_k, page_size, sm_scale, num_kv_splits,
                   out, workspace=None, **tuning):
    """MLA decode: one query row per request (``q [bs, H, 576]`` -> ``out [bs, H, 512]``)."""
    return mla_attention_fwd(q, kv_buffer, page_table, seq_lens_k, page_size, sm_scale,
                             num_kv_splits, out, q_per_req=1, workspace=workspace, **tuning)
