"""Where a sweep row's time goes between the backend and its kernel: the sweep's own row (its pool, pages
and q, ``bench/sweep/sweep_rows.py``), timed as the sweep times it (``sweep_timing.Clock``, L2 flushed)
and as ``triton.testing.do_bench`` does, for the backend's captured graph and for ``decode_attention_fwd``
called directly with the backend's graph metadata (its split count, schedule, merge, workspace) at
register bounds none / 64 / the kernel's rule (the wave fit: the kernel's rule, ``chunk_fit``, in every column).
A tuning probe for GQA decode rows.

    PYTHONPATH=$PWD:bench/sweep python bench/probes/backend_vs_kernel.py --rows gqa28_4_d128_decode:64:uniform \
        [--load-s 1]
"""
from __future__ import annotations

import argparse
import time

import torch
import triton
from sweep_ours import Ours
from sweep_rows import BY_NAME, build_group, build_row, lengths
from sweep_timing import Clock, capture

import attn_backends_kernels.decode_attention as decode


def kernel_call(be, row, maxnreg):
    """The backend's decode launch with its graph metadata, at register bound ``maxnreg``."""
    meta, layer = be.forward_metadata, row.layer
    lay = meta.layout
    pool = row.mem.pool
    out = torch.empty(row.q.shape[0], row.wl.heads, row.wl.v_dim, dtype=row.q.dtype, device=row.q.device)
    chunked = be._chunked(lay)
    return lambda: decode.decode_attention_fwd(
        row.q, pool.k[0], pool.v[0], lay.page_table, lay.seq_lens_k, lay.page_size, layer.scaling,
        meta.num_kv_splits, out, workspace=meta.workspace, merge=be.chunk_merge if chunked else "last",
        schedule=be.schedule if chunked else "split", maxnreg=maxnreg)


def load(fn, seconds: float) -> None:
    """``fn`` back to back for ``seconds`` (the device drained every 100 calls)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            fn()
        torch.cuda.synchronize()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="gqa28_4_d128_decode:32:uniform,gqa28_4_d128_decode:64:uniform",
                   help="workload:bs:dist, comma-separated (GQA decode workloads of bench/sweep/sweep_rows.py)")
    p.add_argument("--kv", type=int, default=16384, help="the uniform rows' KV length")
    p.add_argument("--load-s", type=float, default=0.0,
                   help="seconds of the backend graph's replays before each timing (the card under load, as in the "
                        "sweep's rounds; 0: from where it is)")
    args = p.parse_args(argv)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    clock = Clock("cuda")
    for spec in args.rows.split(","):
        name, bs, dist = spec.split(":")
        wl, bs = BY_NAME[name], int(bs)
        lens = lengths(dist, bs, kv=args.kv)
        row = build_row(build_group(wl, bs, args.kv, "cuda", lens=lens, dist=dist), wl)
        ours = Ours(row)
        g, out = ours.graph()
        be = ours._graph_backend
        g.replay()                      # the captured output holds nothing until a replay
        torch.cuda.synchronize()
        meta = be.forward_metadata
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        per_sm = bs * wl.kv_heads * meta.num_kv_splits / sms
        kv_dtype, dim = row.mem.pool.k[0].dtype, max(wl.qk_dim, wl.v_dim)
        rule = (kv_dtype, dim, decode.decode_block_n(kv_dtype, dim, "chunks"), bs, wl.heads // wl.kv_heads, per_sm)
        few = decode.few_last(meta.num_kv_splits, be.schedule, be.chunk_merge)
        print(f"{spec}: splits {meta.num_kv_splits} chunked {be._chunked(meta.layout)} per_sm {per_sm:.1f} "
              f"rule maxnreg {decode.chunk_maxnreg(*rule, few=few)} fit {decode.chunk_fit(*rule, few=few)} "
              f"page_table {tuple(meta.layout.page_table.shape)}")
        times = {"backend graph": g.replay}
        for nr in (..., None, 64):
            kg, kout = capture(kernel_call(be, row, nr))
            kg.replay()
            torch.cuda.synchronize()
            assert (kout.float() - out.float()).abs().max() < 2e-2, f"kernel maxnreg={nr} differs from the backend"
            times[f"kernel {'rule' if nr is ... else nr}"] = kg.replay
        for label, fn in times.items():
            load(g.replay, args.load_s)
            print(f"  {label:<16} clock {clock.gpu_us(fn):8.1f}  do_bench "
                  f"{triton.testing.do_bench(fn, warmup=20, rep=200, return_mode='median') * 1e3:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
