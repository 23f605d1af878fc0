"""The host cost of one kernel-wrapper call, its launches stubbed: the Python a wrapper runs before its kernels (the
argument checks, the rules, the grid), which an eager step pays every call (replays do not: their launches are
recorded). GQA 28/4 d128, bs 32 of 16384 tokens, bf16: decode on chunks and on splits, verify N=4.

    python bench/probes/host_cost.py [--device cpu|cuda] [--calls 3000]
"""
from __future__ import annotations

import argparse
import timeit

import torch

import attn_backends_kernels.attention_core as core
import attn_backends_kernels.chunk_kernels as chunk_kernels
import attn_backends_kernels.decode_attention as decode
import attn_backends_kernels.extend_attention as extend
import attn_backends_kernels.schedule as schedule
from attn_backends_kernels.schedule import chunk_workspace, slots_per_request


def calls(device: str) -> dict:
    """``{name: call}`` of the three wrappers on one batch (buffers allocated once, as a runner's)."""
    bs, H, Hkv, D, pages = 32, 28, 4, 128, 1024
    z = dict(dtype=torch.bfloat16, device=device)
    q, out = torch.zeros(bs, H, D, **z), torch.zeros(bs, H, D, **z)
    k = torch.zeros(bs * pages * 16 + 16, Hkv, D, **z)
    table = torch.zeros(bs, pages, dtype=torch.int32, device=device)
    lens = torch.full((bs,), pages * 16, dtype=torch.int32, device=device)
    ws = chunk_workspace(bs, slots_per_request("chunks", 6, pages * 16), 1, H, Hkv, D, device)
    cu = torch.arange(bs + 1, dtype=torch.int32, device=device) * 4
    qv, ov = torch.zeros(bs * 4, H, D, **z), torch.zeros(bs * 4, H, D, **z)
    return {"decode chunks": lambda: decode.decode_attention_fwd(q, k, k, table, lens, 16, 0.1, 6, out, ws,
                                                                 schedule="chunks", merge="pass"),
            "decode split": lambda: decode.decode_attention_fwd(q, k, k, table, lens, 16, 0.1, 6, out, None),
            "verify4 extend": lambda: extend.extend_attention_fwd(qv, k, k, table, lens, cu, 16, 0.1, 4, ov)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=3000)
    args = p.parse_args(argv)
    for m in (core, chunk_kernels, decode, extend, schedule):
        m.launch = lambda *a, **k: None
    for name, fn in calls(args.device).items():
        fn()
        best = min(timeit.repeat(fn, number=args.calls, repeat=5)) / args.calls * 1e6
        print(f"{name}: {best:.1f} us a call (host, launches stubbed, {args.device})")


if __name__ == "__main__":
    main()
