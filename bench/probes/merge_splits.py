"""``merge_splits`` alone at the shapes of few-program merges: float32 partials' column blocks from a head's
splits x columns of ``attention_core.MERGE_TILE_VALUES`` (none: whole rows), with live and half-empty splits (an
empty split's partial is not read). A tuning probe, graph replays (``triton.testing.do_bench``). (Before 3bbdd38
the knob was a tile bound, columns cut until splits x columns fit it: bench/RESULTS.md's table was taken so.)

    python bench/probes/merge_splits.py [--shapes 1x8x256x128:f32,1x16x64x512:bf16] [--tiles none,8192,4096]
"""
from __future__ import annotations

import argparse

import torch
import triton
from ragged_decode import graph_us  # this folder's: a CUDA graph's replay, median us

import attn_backends_kernels.attention_core as core

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
SHAPES = ("1x8x256x128:f32,2x8x256x128:f32,3x8x128x128:f32,4x8x128x128:f32,1x32x64x128:f32,"
          "1x16x64x512:f32,1x16x64x512:bf16,2x16x64x512:f32,1x128x32x512:f32")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="T x H x S x Dv : partials' dtype (f32, bf16), comma-separated")
    p.add_argument("--tiles", default="none,8192,4096,2048", help="MERGE_TILE_VALUES to try (none: no column cut)")
    p.add_argument("--empty", default="0,0.5", help="fractions of empty splits (the last ones, as a short request's)")
    args = p.parse_args(argv)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    saved = core.MERGE_TILE_VALUES
    for spec in args.shapes.split(","):
        dims, dt = spec.split(":")
        T, H, S, Dv = map(int, dims.split("x"))
        part = torch.randn(T, H, S, Dv, device="cuda").to(DTYPES[dt])
        out = torch.empty(T, H, Dv, device="cuda", dtype=torch.bfloat16)
        for frac in (float(f) for f in args.empty.split(",")):
            lse = torch.randn(T, H, S, device="cuda") * 4
            lse[..., S - int(S * frac):] = float("-inf") if frac else lse[..., S - int(S * frac):]
            times, ref = [], None
            for tile in args.tiles.split(","):
                core.MERGE_TILE_VALUES = None if tile == "none" else int(tile)
                times.append(f"t{tile} {graph_us(lambda: core.merge_splits(part, lse, out)):.2f}")
                ref = out.clone() if ref is None else ref
                assert (out.float() - ref.float()).abs().max() < 1e-2, f"{spec} tile {tile} differs"
            core.MERGE_TILE_VALUES = saved
            print(f"{spec:<18} empty {frac:<4} " + " ".join(times), flush=True)


if __name__ == "__main__":
    main()
