"""What FP8 tensor-core MMAs would cost in accuracy (issue #41.3: "dequantize in registers before the MMA, or
FP8 MMAs where the accuracy holds: measure both"), on the CPU, before any kernel is written.

One layer's attention over an e4m3 KV cache (scale from the cache's largest value), three ways, each against the
float64 reference over the *dequantized* cache (the contract's reference, #41.4):

* ``16-bit MMA``: what the kernels do today: q in the model's dtype, K and V widened to it, P rounded to it before
  P.V (the softmax's denominator sums the float32 P, as ``kernels/kv_walk.py``), float32 accumulation, online
  softmax over 64-token tiles;
* ``FP8 MMA``: q quantized to e4m3 (a scale a query row and head: amax / 448), Q.K^T on the e4m3 values, P of each
  tile (relative to the running max, <= 1) rounded to e4m3 before P.V on the e4m3 V; float32 accumulation
  (an emulation: Hopper's FP8 MMA accumulates with fewer bits, so this is its best case);
* ``FP8 MMA, P 16-bit``: the same with P kept in the model's dtype (an FP8 Q.K^T, a 16-bit P.V on V widened);
* ``FP8 P.V only``: q and K in the model's dtype, P rounded to e4m3 for an FP8 P.V on the e4m3 V (V never widened);
  ``x 256``: P scaled by 2^8 before the rounding (out of e4m3's subnormals) and back after the MMA.

Error = max |out - ref| / max |ref|, the bf16 tests' tolerance being 2e-2; the reference takes q unrounded, so
every column includes q's rounding. Scores are N(0, sharp^2) (``sharp`` 1: flat attention, 4: peaked); the head
dims and groups of the sweep's rows, one request of ``kv`` keys; verify rows unmasked (W query rows over all keys).

    python bench/probes/fp8_mma_accuracy.py [--kv 256,4096,16384] [--sharp 1,4] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max          # 448
TILE = 64
# (name, query heads, KV heads, qk dim, v dim, query rows a request): the sweep's shapes
SHAPES = (("GQA 28/4 d128", 28, 4, 128, 128, 1), ("GQA 32/8 d64 verify4", 32, 8, 64, 64, 4),
          ("GQA 8/1 d128", 8, 1, 128, 128, 1), ("MLA 16", 16, 1, 576, 512, 1), ("MLA 128 verify4", 128, 1, 576, 512, 4))


# (name, q in e4m3, P in e4m3 at this scale (None: P in the 16-bit dtype))
MODES = (("16-bit MMA", False, None), ("FP8 MMA", True, 1.0), ("FP8 MMA, P 16-bit", True, None),
         ("FP8 P.V only", False, 1.0), ("FP8 P.V, P x 256", False, 256.0))


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to e4m3 (nearest even, saturated to the finite range), as float32."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float()


def quantize(x: torch.Tensor, dim) -> tuple:
    """``x`` as e4m3 values and the scale (amax / 448 over ``dim``) that dequantizes them."""
    scale = (x.abs().amax(dim=dim, keepdim=True) / E4M3_MAX).clamp_min(1e-12)
    return e4m3(x / scale), scale


def attend(q, k, v, sm_scale, lo16, q_fp8: bool, p_scale) -> torch.Tensor:
    """Online softmax over ``TILE``-token tiles, float32 accumulation. ``q [W, H, D]``, ``k [S, H, D]`` and
    ``v [S, H, Dv]`` (KV heads repeated to the query heads), float32 holding the operands' values; P.V's P in
    e4m3 at ``p_scale`` (None: in ``lo16``), the denominator over the float32 P."""
    qs = torch.ones(1)
    if q_fp8:
        q, qs = quantize(q, dim=-1)               # a scale a row and head
    else:
        q = q.to(lo16).float()
    W, H, _ = q.shape
    m = torch.full((W, H, 1), -float("inf"))
    acc, den = torch.zeros(W, H, v.shape[-1]), torch.zeros(W, H, 1)
    for t in range(0, k.shape[0], TILE):
        s = torch.einsum("whd,shd->whs", q, k[t:t + TILE]) * qs * sm_scale
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        pv = p.to(lo16).float() if p_scale is None else e4m3(p * p_scale) / p_scale
        alpha = torch.exp(m - m_new)
        acc = acc * alpha + torch.einsum("whs,shd->whd", pv, v[t:t + TILE])
        den = den * alpha + p.sum(-1, keepdim=True)
        m = m_new
    return acc / den


def row(shape, kv: int, sharp: float, lo16, gen) -> dict:
    _, H, Hkv, D, Dv, W = shape
    sm_scale = sharp / D ** 0.5
    q = torch.randn(W, H, D, generator=gen, dtype=torch.float64)
    kc = torch.randn(kv, Hkv, D, generator=gen, dtype=torch.float64)
    k8, ks = quantize(kc.float(), dim=(0, 1, 2))          # the cache: e4m3 with a per-tensor scale
    k = (k8 * ks).repeat_interleave(H // Hkv, dim=1)       # the dequantized cache, the query heads'
    if Dv == D - 64:                                       # MLA: V is the latent part of the same cache
        v = k[..., :Dv]
    else:
        v8, vs = quantize(torch.randn(kv, Hkv, Dv, generator=gen).float(), dim=(0, 1, 2))
        v = (v8 * vs).repeat_interleave(H // Hkv, dim=1)
    s = torch.einsum("whd,shd->whs", q, k.double()) * sm_scale
    ref = torch.einsum("whs,shd->whd", torch.softmax(s, -1), v.double())
    amax = float(ref.abs().max())
    out = {}
    for name, qf, pf in MODES:
        got = attend(q.float(), k, v, sm_scale, lo16, qf, pf)
        out[name] = float((got.double() - ref).abs().max()) / amax
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv", default="256,4096,16384")
    p.add_argument("--sharp", default="1,4")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    args = p.parse_args(argv)
    lo16 = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    names = [m[0] for m in MODES]
    print(f"torch {torch.__version__}; error = max|out - ref| / max|ref| against float64 over the dequantized e4m3 "
          f"cache; 16-bit = {args.dtype}; tolerance of the {args.dtype} tests 2e-2")
    print("| shape | kv | sharp | " + " | ".join(names) + " |")
    print("|---|---:|---:|" + "---:|" * len(names))
    for shape in SHAPES:
        for kv in (int(x) for x in args.kv.split(",")):
            for sharp in (float(x) for x in args.sharp.split(",")):
                r = row(shape, kv, sharp, lo16, gen)
                print(f"| {shape[0]} | {kv} | {sharp:g} | " + " | ".join(f"{r[n]:.2e}" for n in names) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
