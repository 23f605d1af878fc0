"""Write new K/V rows into the paged KV pool at ``out_cache_loc`` slots.

MHA/GQA: ``k [T, Hkv, D]`` -> ``k_buffer[out_cache_loc]`` and likewise v.
MLA: ``latent [T, 1, 512]`` and ``rope [T, 1, 64]`` -> columns [0:512) and [512:576) of
``kv_buffer [num_slots, 1, 576]``. One kernel copies a [T, H, D] source into a column
range of a [num_slots, H, C] pool; sources may be strided views (e.g. slices of a fused
qkv projection) as long as the last dim is contiguous; ``out_cache_loc`` may be strided too
(a column of a [bs, steps] slot table). Padding tokens carry
``out_cache_loc = 0`` and write into the reserved slot 0, which nobody reads as data.
"""

import math

import torch
import triton
import triton.language as tl

from .attention_core import FP8_KV_DTYPES
from .launch_record import cdiv, pow2


@triton.jit
def _round_to_grid(x, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """float32 ``x`` rounded to nearest even on the grid of a float of MANT mantissa bits whose
    least normal exponent is MIN_EXP (subnormals below it): the cast to FP8 that follows is then
    exact. Rounded here, not by the cast: the interpreter's float-to-FP8 cast rounds half up and
    drops the carry of a mantissa that rounds up into the exponent."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127                                     # x's binade, from its bits
    k = tl.maximum(e, MIN_EXP) - MANT
    ulp = ((k + 127) << 23).to(tl.float32, bitcast=True)
    y = tl.abs(x) * ((127 - k) << 23).to(tl.float32, bitcast=True)    # times 1 / ulp: exact
    r = ((y + 12582912.0) - 12582912.0) * ulp                           # 1.5 * 2**23: y's nearest even
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # x's sign, -0 too


@triton.jit
def _store_rows_kernel(
    src_ptr, dst_ptr, loc_ptr,
    col_offset, scale,
    stride_loc,
    stride_st, stride_sh,
    stride_ds, stride_dh,
    HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MANT: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < HEADS)[:, None] & (offs_d < DIM)[None, :]
    slot = tl.load(loc_ptr + t * stride_loc).to(tl.int64)  # int64: slot * stride can pass 2^31
    val = tl.load(src_ptr + t.to(tl.int64) * stride_st + offs_h[:, None] * stride_sh
                  + offs_d[None, :], mask=mask)
    if FP8_MAX > 0:     # an FP8 cache: value / scale, saturated (past the range: inf or NaN), nearest even
        val = _round_to_grid(tl.clamp(tl.div_rn(val.to(tl.float32), scale), -FP8_MAX, FP8_MAX,
                                      propagate_nan=tl.PropagateNan.ALL), FP8_MANT, FP8_MIN_EXP)
    tl.store(dst_ptr + slot * stride_ds + offs_h[:, None] * stride_dh + col_offset
             + offs_d[None, :], val.to(dst_ptr.dtype.element_ty), mask=mask)


def _store(name, src, dst, loc, col_offset, scale=1.0):
    if src.dim() != 3 or dst.dim() != 3:
        raise ValueError(f"{name}: src {tuple(src.shape)} and buffer {tuple(dst.shape)} must be 3-D")
    T, H, D = src.shape
    if dst.shape[1] != H or col_offset + D > dst.shape[2]:
        raise ValueError(f"{name}: src {tuple(src.shape)} does not fit buffer "
                         f"{tuple(dst.shape)} at column {col_offset}")
    if (src.dtype != dst.dtype and dst.dtype not in FP8_KV_DTYPES) or src.device != dst.device:
        raise ValueError(f"{name}: src is {src.dtype} on {src.device}, buffer is {dst.dtype} "
                         f"on {dst.device} (a buffer of src's dtype or FP8)")
    if not (math.isfinite(scale) and scale > 0) or (scale != 1.0 and dst.dtype not in FP8_KV_DTYPES):
        raise ValueError(f"{name}: scale={scale}: a finite value > 0, other than 1 only for an FP8 buffer")
    if src.stride(-1) != 1 or dst.stride(-1) != 1:
        raise ValueError(f"{name}: src and buffer need a contiguous last dim")
    if loc.shape != (T,) or loc.dtype not in (torch.int32, torch.int64) or loc.device != src.device:
        raise ValueError(f"{name}: out_cache_loc {tuple(loc.shape)} {loc.dtype} on {loc.device}, "
                         f"expected ({T},) int32/int64 on {src.device}")
    if T == 0:
        return
    block_d = pow2(D)
    block_h = min(pow2(H), max(1, 4096 // block_d))
    _store_rows_kernel[(T, cdiv(H, block_h))](
        src, dst, loc, col_offset, float(scale), loc.stride(0),
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        HEADS=H, DIM=D, BLOCK_H=block_h, BLOCK_D=block_d,
        FP8_MAX=torch.finfo(dst.dtype).max if dst.dtype in FP8_KV_DTYPES else 0.0,
        FP8_MANT=3 if dst.dtype == torch.float8_e4m3fn else 2,
        FP8_MIN_EXP=-6 if dst.dtype == torch.float8_e4m3fn else -14,
    )


def store_kv(k, v, k_buffer, v_buffer, out_cache_loc, k_scale=1.0, v_scale=1.0):
    """``k_buffer[out_cache_loc] = k`` and ``v_buffer[out_cache_loc] = v``.

    k : [T, Hkv, D], v : [T, Hkv, Dv]; buffers [num_slots, Hkv, D/Dv] of the same dtype, or FP8
    (``attention_core.FP8_KV_DTYPES``: ``k / k_scale`` and ``v / v_scale`` saturated to the
    format's finite range, rounded to nearest even); out_cache_loc : [T] int32/int64 slot ids.
    """
    _store("store_kv", k, k_buffer, out_cache_loc, 0, k_scale)
    _store("store_kv", v, v_buffer, out_cache_loc, 0, v_scale)


def store_mla_kv(latent, rope, kv_buffer, out_cache_loc, scale=1.0):
    """``kv_buffer[out_cache_loc] = cat(latent, rope, -1)`` without materialising the cat.

    latent : [T, 1, 512], rope : [T, 1, 64], kv_buffer : [num_slots, 1, 576], latent's dtype or
    FP8 (both parts ``/ scale``, the one scale of the latent cache, as ``store_kv``).
    """
    if latent.shape[-1] + rope.shape[-1] != kv_buffer.shape[-1]:
        raise ValueError(f"store_mla_kv: latent {tuple(latent.shape)} + rope "
                         f"{tuple(rope.shape)} != buffer width {kv_buffer.shape[-1]}")
    _store("store_mla_kv", latent, kv_buffer, out_cache_loc, 0, scale)
    _store("store_mla_kv", rope, kv_buffer, out_cache_loc, latent.shape[-1], scale)
