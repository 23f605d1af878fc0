"""Our GQA decode's walk of the paged KV without its arithmetic, beside the decode itself: how
near ours reads to what a read-only kernel of the same walk reaches on the card (issue #10's
"limit that holds" a memory-bound row). A reference, not a bound: a different kernel over the
same pages, which can be slower than ours.

    python bench/probes/paged_read.py --points 128x8192,64x32768,4x32768 [--workloads gqa32_decode,gqa64_decode]

Three figures, one process, one card:

- **copy**: the sweep's device copy of 1 GiB (read + write bytes a second, ``Clock.copy_gbs``);
- **contiguous read**: a Triton kernel that reads 8 GiB once, in order, and writes one sum a program;
- **paged read** of each row: a Triton kernel that walks the row's KV as our decode kernel does
  (``_decode_split_kernel``: one program a KV head, request and split, its grid order and split
  bounds, ``block_n``-token tiles of K and V gathered through the page table, the sweep's shuffled
  pages) and only sums what it reads, at 32- and 64-token tiles (Triton's default 3 stages; a
  [block_n, D] float32 sum, where the decode holds [16, Dv]).

Ours is the backend's decode replayed in a CUDA graph (``sweep_ours.Ours``, its own split count);
every time is the least of ``--rounds`` interleaved rounds of graph replays, L2 flushed before each
(``Clock.gpu_us``). GB/s count the row's bytes as the sweep does (KV read once + q + out). ``x read``
is the faster read's time over ours (below 1.0: that read walked the pages faster than ours).

On the CPU (``BENCH_DEVICE=cpu``: the interpreter, the row's smoke shape) each paged read's sums are
checked against the tokens gathered by torch, and timed once: a check of the tool, not a measurement.
tests/bench/test_bench_paged_read.py also checks the walk's split bounds against the decode kernel's.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sweep"))   # the sweep's modules, bench/sweep/
if os.environ.get("BENCH_DEVICE") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from probe_launch import Injector  # noqa: E402
from sweep_ours import Ours  # noqa: E402
from sweep_rows import BY_NAME, build_group, build_row, smoke_workload  # noqa: E402
from sweep_timing import Clock, capture  # noqa: E402

from attn_backends_kernels.attention_core import heads_first_grid  # noqa: E402

CONTIGUOUS_ELEMS = 4 << 30     # bf16: 8 GiB, far past L2
READ_TILES = (32, 64)


@triton.jit
def _read_contiguous(x_ptr, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK * ITERS + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        acc += tl.load(x_ptr + offs + i * BLOCK).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


@triton.jit
def _read_paged(k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, out_ptr, stride_ks, stride_kh, stride_vs, stride_vh,
                stride_pb, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                NUM_SPLITS: tl.constexpr, HEADS_FIRST: tl.constexpr):
    """Our decode kernel's walk (``_decode_split_kernel``: its grid order, split bounds and slots, int64 as past 2^31)
    without its arithmetic: out[b, kvh, split] = the sum of the K and V values it read."""
    if HEADS_FIRST:
        kvh = tl.program_id(0)
        b = tl.program_id(1)
        num_kvh = tl.num_programs(0)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        num_kvh = tl.num_programs(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(page_table_ptr + b * stride_pb + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
        k = tl.load(k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=mask_n[:, None],
                    other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=mask_n[:, None],
                    other=0.0)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + (b * num_kvh + kvh) * NUM_SPLITS + split, tl.sum(acc))


def paged_read(k, v, page_table, seq_lens, page_size: int, splits: int, block_n: int, out=None):
    """``(call, out)``: the paged read of ``k``/``v`` [slots, Hkv, D] (D a power of two) through ``page_table`` for
    ``seq_lens`` requests, ``splits`` splits of ``block_n``-token tiles; ``out`` [bs, Hkv, splits]."""
    bs, hkv = seq_lens.shape[0], k.shape[1]
    if k.shape != v.shape or k.shape[2] & (k.shape[2] - 1):
        raise ValueError(f"paged_read: k {tuple(k.shape)} and v {tuple(v.shape)}: one shape, a power-of-two head dim")
    out = torch.empty(bs, hkv, splits, dtype=torch.float32, device=k.device) if out is None else out
    heads_first, grid = heads_first_grid("paged_read", None, bs, 1, (hkv, bs, splits), (bs, hkv, splits))

    def call():
        _read_paged[grid](k, v, page_table, seq_lens, out, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                          page_table.stride(0), HEAD_DIM=k.shape[2], PAGE_SIZE=page_size, BLOCK_N=block_n,
                          NUM_SPLITS=splits, HEADS_FIRST=heads_first, num_warps=4, num_stages=3)
    return call, out


def paged_reference(k, v, page_table, seq_lens, page_size: int, splits: int, block_n: int) -> torch.Tensor:
    """What ``paged_read`` sums, gathered by torch (float64): [bs, Hkv, splits]."""
    bs, hkv = seq_lens.shape[0], k.shape[1]
    ref = torch.zeros(bs, hkv, splits, dtype=torch.float64)
    for b, n in enumerate(seq_lens.tolist()):
        split_len = -(-(-(-n // splits)) // block_n) * block_n
        pos = torch.arange(n)
        slots = page_table[b, pos // page_size].long().cpu() * page_size + pos % page_size
        kv = (k.cpu()[slots].double() + v.cpu()[slots].double()).sum(-1)       # [n, Hkv]
        for s in range(splits):
            ref[b, :, s] = kv[s * split_len:min((s + 1) * split_len, n)].sum(0)
    return ref


def contiguous_gbs(clock: Clock, rounds: int) -> float:
    x = torch.empty(CONTIGUOUS_ELEMS, dtype=torch.bfloat16, device=clock.device).normal_()
    block, iters = 4096, 16
    out = torch.empty(CONTIGUOUS_ELEMS // (block * iters), device=clock.device)
    g, _ = capture(lambda: _read_contiguous[(out.numel(),)](x, out, BLOCK=block, ITERS=iters, num_warps=4))
    us = min(clock.gpu_us(g.replay) for _ in range(rounds))
    return x.numel() * x.element_size() / us / 1e3


def measure_point(wl, bs: int, kv: int, clock: Clock, inj: Injector, rounds: int) -> dict:
    row = build_row(build_group(wl, bs, kv, clock.device), wl)
    inj.last = None
    ours = Ours(row)
    lay = ours.layout()
    k, v = row.mem.pool.k[0], row.mem.pool.v[0]
    splits = inj.last if inj.last is not None else 1
    reads = {bn: paged_read(k, v, lay["page_table"], lay["seq_lens_k"], wl.page_size, splits, bn)
             for bn in READ_TILES}
    rec = dict(workload=wl.name, bs=bs, kv=kv, splits=splits, bytes=wl.nbytes(bs, kv))
    if not clock.cuda:                       # the tool's check: every read against torch's gather
        for bn, (call, out) in reads.items():
            call()
            ref = paged_reference(k, v, lay["page_table"], lay["seq_lens_k"], wl.page_size, splits, bn)
            err = (out.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
            rec[f"err{bn}"] = err
            if not err < 1e-5:
                raise AssertionError(f"paged read {bn}: sums off by {err:.2e} of the largest")
        rec["ours_us"] = clock.gpu_us(ours.eager())
        rec.update({f"read{bn}_us": clock.gpu_us(call) for bn, (call, _) in reads.items()})
        return rec
    g, _ = ours.graph()
    calls = {"ours_us": g.replay} | {f"read{bn}_us": capture(call)[0].replay for bn, (call, _) in reads.items()}
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(clock.gpu_us(call))
    rec.update({name: min(t) for name, t in times.items()})
    return rec


def table(recs: list, env: dict) -> str:
    head = (f"- {env['device']}; torch {torch.__version__}, triton {triton.__version__}\n"
            f"- copy {env['copy_gbs']:.0f} GB/s (read + write); contiguous read {env['read_gbs']:.0f} GB/s\n\n"
            "| workload | bs | kv | splits | ours us | ours GB/s | " +
            " | ".join(f"read {bn} us | read {bn} GB/s" for bn in READ_TILES) + " | x read |\n|---|" +
            "---:|" * (6 + 2 * len(READ_TILES)) + "\n")
    lines = []
    for r in recs:
        gbs = lambda us: r["bytes"] / us / 1e3  # noqa: E731
        best = min(r[f"read{bn}_us"] for bn in READ_TILES)
        reads = " | ".join(f"{r[f'read{bn}_us']:.1f} | {gbs(r[f'read{bn}_us']):.0f}" for bn in READ_TILES)
        lines.append(f"| {r['workload']} | {r['bs']} | {r['kv']} | {r['splits']} | {r['ours_us']:.1f} | "
                     f"{gbs(r['ours_us']):.0f} | {reads} | {best / r['ours_us']:.3f} |")
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", required=True, help="comma-separated BSxKV, e.g. 128x8192,4x32768")
    p.add_argument("--workloads", default="gqa32_decode,gqa64_decode")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", help="markdown file for the table")
    a = p.parse_args(argv)
    cpu = os.environ.get("BENCH_DEVICE") == "cpu"
    clock, inj = Clock("cpu" if cpu else "cuda"), Injector()
    env = dict(device="CPU (interpreter: a check of the tool)", copy_gbs=0.0, read_gbs=0.0)
    if not cpu:
        env = dict(device=torch.cuda.get_device_name(), copy_gbs=clock.copy_gbs(),
                   read_gbs=contiguous_gbs(clock, a.rounds))
        torch.cuda.empty_cache()
    recs = []
    with inj.active():
        for name in a.workloads.split(","):
            wl = BY_NAME[name]
            if wl.family != "gqa" or wl.mode != "decode":
                p.error(f"{name}: the paged read is our GQA decode's walk (gqa*_decode only)")
            wl = smoke_workload(wl) if cpu else wl
            for pt in a.points.split(","):
                bs, kv = (int(x) for x in pt.split("x"))
                recs.append(measure_point(wl, bs, kv, clock, inj, a.rounds))
                print(table(recs[-1:], env).splitlines()[-1], flush=True)
                if not cpu:
                    torch.cuda.empty_cache()
    text = table(recs, env)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
