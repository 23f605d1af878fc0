"""GQA decode's launch parameters at the kernel level, split schedule: split count (the backend's
``S`` for 6 programs an SM, 1.5x and 2x; the 28/4 bs 2 row's backend now takes 256 splits, its decode of
8 programs, where ``S`` here stays the rule's 64) x KV tile x pipeline stages x warps, one cache dtype, CUDA
graph replays. A tuning probe for 'FP8 KV' in bench/RESULTS.md; the kernels are those of the
``attn_backends_kernels`` that Python imports (put another tree first on PYTHONPATH to compare forms).

    python bench/probes/decode_tiles.py LABEL [--kv-dtype fp8|bf16] [--compile-only]
"""
from __future__ import annotations

import argparse

import torch
from ragged_decode import graph_us, kv_pair, lengths, paged

import attn_backends_kernels
from attn_backends.backends.triton_common import choose_num_kv_splits
from attn_backends_kernels.attention_core import decode_workspace
from attn_backends_kernels.decode_attention import decode_attention_fwd

CONFIGS = [(32, 2, 4), (64, 2, 4), (64, 3, 4), (128, 2, 8)]    # (tile tokens, stages, warps)
ROWS = [(28, 4, 128, 24, "uniform"), (28, 4, 128, 24, "ragged"), (32, 8, 64, 24, "uniform"),
        (32, 8, 64, 24, "ragged"), (8, 1, 128, 16, "uniform"), (32, 8, 128, 64, "longtail"), (28, 4, 128, 2, "uniform")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("label")
    p.add_argument("--kv-dtype", default="fp8", choices=("fp8", "bf16"))
    p.add_argument("--compile-only", action="store_true", help="run each launch once (fills Triton's cache)")
    args = p.parse_args(argv)
    kvd = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    print(args.label, attn_backends_kernels.__file__, flush=True)
    for H, Hkv, D, bs, dist in ROWS:
        lens = lengths(dist, bs)
        pg = paged(lens, Hkv, D, torch.Generator().manual_seed(bs))
        q = torch.randn(bs, H, D, device="cuda", dtype=torch.bfloat16)
        S0 = choose_num_kv_splits(bs * Hkv, torch.device("cuda"), max(lens) // 16 + 1, 6, 1, 2, None, 1, 8)
        kb, vb, sc = kv_pair(pg["num_pages"] * 16, Hkv, D, kvd)
        nbytes = sum(lens) * Hkv * D * 2 * kb.element_size()
        res, ref = [], None
        for S in sorted({S0, S0 * 3 // 2, S0 * 2}):
            ws = decode_workspace(bs, H, D, S, "cuda") if S > 1 else None
            for bn, st, nw in CONFIGS:
                out = torch.empty_like(q)
                fn = lambda: decode_attention_fwd(q, kb, vb, pg["table"], pg["lens"], 16, D ** -0.5, S, out, ws,  # noqa: E731
                                                  block_n=bn, num_warps=nw, num_stages=st, k_scale=sc[0], v_scale=sc[1])
                if args.compile_only:
                    fn()
                    continue
                t = graph_us(fn)
                ref = out.float().clone() if ref is None else ref
                res.append((t, S, bn, st, nw, (out.float() - ref).abs().max().item()))
        if res:
            res.sort()
            first = [r for r in res if r[1:5] == (S0, 32, 2, 4)][0][0]
            row = f"{args.label} {H}/{Hkv} d{D} bs{bs} {dist} {args.kv_dtype}"
            print(f"{row}: S{S0} n32 {first:.1f}; best " + "; ".join(
                f"S{S} n{bn} st{st} w{nw} {t:.1f} ({nbytes / t / 1e6:.2f} TB/s) err {e:.0e}"
                for t, S, bn, st, nw, e in res[:4]), flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
