"""The sweep's records (``sweep.py``): the row's fields, the error against ours, the JSON-lines
writer, the records of rows not measured, and the card's copy and matmul rates. Here so that
``sweep.py`` stays the measurement."""
from __future__ import annotations

import json

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def write(ctx, rec: dict) -> None:
    ctx.out.write(json.dumps(rec) + "\n")
    ctx.out.flush()
    ctx.results += 1


def label(row) -> str:
    """The row in messages: ``workload bs=.. kv=..``, then the distribution unless uniform."""
    return f"{row.wl.name} bs={row.bs} kv={row.kv}" + ("" if row.dist == "uniform" else f" {row.dist}")


def lens_record(dist: str, lens) -> dict:
    """A row's lengths in its records: the distribution, min, max and sum; the lengths themselves
    unless uniform."""
    out = dict(dist=dist, kv_min=min(lens), kv_max=max(lens), kv_sum=sum(lens))
    return out if dist == "uniform" else dict(out, lens=list(lens))


def base_record(row, impl: str, **kw) -> dict:
    return dict(type="result", **row.wl.describe(), bs=row.bs, kv=row.kv, **lens_record(row.dist, row.lens),
                impl=impl, **kw)


def skip_rows(ctx, wls, pt, reason: str, status: str = "skipped") -> None:
    """One record per workload of point ``pt`` that was not measured, with the reason."""
    for wl in wls:
        write(ctx, dict(type="result", **wl.describe(), bs=pt.bs, kv=pt.kv, **lens_record(pt.dist, pt.lens),
                        impl="row", status=status, reason=reason))
    where = f"bs={pt.bs} kv={pt.kv}" + ("" if pt.dist == "uniform" else f" {pt.dist}")
    print(f"{','.join(w.name for w in wls)} {where}: {status} ({reason})", flush=True)
    if status == "error":
        ctx.errors.append(f"{wls[0].family} {where}: {reason[:160]}")


def calibrate(ctx) -> None:
    if ctx.device != "cuda":
        return
    copy, mm = ctx.clock.copy_gbs(), ctx.clock.matmul_tflops()
    ctx.env.update(copy_gbs=round(copy, 1), matmul_tflops=round(mm, 1),
                   ridge_flop_per_byte=round(mm * 1e12 / (copy * 1e9), 1))
    torch.cuda.empty_cache()

