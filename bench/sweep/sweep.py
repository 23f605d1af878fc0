"""Issue #10 sweep: ours against every FlashInfer configuration that can run each row.

Usage (repository root)::

    python bench/sweep/sweep.py [--out DIR] [--quick] [--only gqa|mla] [--budget-s S]
    STAGES="sweep" bash bench/run_gpu.sh DIR            # the same, from the GPU script
    BENCH_DEVICE=cpu TRITON_INTERPRET=1 python bench/sweep/sweep.py --smoke --out DIR
    python bench/sweep/sweep_report.py DIR/sweep.jsonl  # bench/sweep/SWEEP.md + bench/sweep/sweep.png

``--out`` defaults to bench/sweep/ (``--smoke``: /tmp/attn-sweep-smoke). On a GPU machine without
matplotlib (the lent ones) run with ``--out $OUT`` and redraw the table and plot with ``sweep_report.py``.

Matrix (``sweep_rows``): GQA 32/8 and 64/8 heads (d 128, page 16) decode, verify N=4 (chain) and N=8
tree (topk 4); MLA 16 and 128 heads (512 + 64, page 64) decode and verify N=4; bs 1, 4, 16, 64, 128 x
kv 2048, 8192, 32768 (``--quick``: bs 1, 16, 128 x kv 8192; those points run first in a full sweep
too). bf16, shuffled pages, every request at exactly ``kv`` tokens, the same data for ours and
FlashInfer. A group whose memory estimate exceeds 90% of the free device memory is skipped, with the reason.

Per row, ours (``sweep_ours``) and every FlashInfer configuration (``sweep_flashinfer``):
``graph_us`` (replay of a captured graph, GPU time), ``eager_us`` (one eager call from an idle GPU, host
launch included), ``eager_gpu_us`` (eager calls back to back, GPU time) and ``host_us`` (host time of one
eager call), all medians with L2 flushed (``sweep_timing``); ``graph_us``, ``host_us`` and ``eager_us`` the
least of interleaved rounds over ours and every configuration (``interleaved_times``; the graph rounds of a
power-capped row start after ``graph_settle_s`` seconds of replays of each in turn, ``sweep_timing.settle``);
output checked against ours (``max|out - ours| / max|ours| < 2e-2``). Before timing, every JIT module and
Triton kernel is built in parallel processes (``sweep_prewarm``).
``--smoke`` (CPU, interpreter): a tiny shape of each workload, ours eager only, and each
FlashInfer configuration's arguments checked by ``sweep_fi_emulate`` instead of run.

Output: ``DIR/sweep.jsonl``, JSON lines:

* ``{"type": "header", "device", "sm", "num_sms", "memory_gb", "torch", "triton",
  "flashinfer", "flashinfer_error", "cuda", "flashinfer_cuda_arch_list", "git",
  "date", "copy_gbs", "matmul_tflops", "ridge_flop_per_byte", "args", "smoke",
  "prewarm": {job: {"rc", "s", "tail"?}}, "not_swept": {config: reason}, "host_timing", "timing"}``
* one ``{"type": "result", "workload", "family", "mode", "heads", "kv_heads", "qk_dim",
  "v_dim", "page_size", "width", "topk", "bs", "kv", "impl" ("ours" | a FlashInfer config
  | "row" for a skipped group), "status" ("ok" | "skipped" | "error" | "emulated"),
  "reason", "graph_us", "eager_us", "eager_gpu_us", "host_us", "graph_rounds_us", "host_rounds_us",
  "eager_rounds_us", "graph_settle_s", "graph_error", "host_error", "eager_error", "err", "err_graph",
  "check" ("pass" | "FAIL"), "bytes", "flops", "intensity", "bound", "gbs", "frac_copy", "tflops",
  "frac_matmul"}`` per (row, impl) (rates from ``graph_us``, else ``eager_us``)
* ``{"type": "footer", "elapsed_s", "results", "mismatches", "errors"}``

and ``DIR/SWEEP.md`` (``sweep_report``; ``DIR/sweep.png`` too where matplotlib imports).
"""
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("BENCH_DEVICE", "cpu")
if os.environ.get("BENCH_DEVICE") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import sweep_prewarm  # noqa: E402
import sweep_report  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from sweep_fi_emulate import emulate  # noqa: E402
from sweep_flashinfer import NOT_SWEPT, Peer, call_spec, candidates, fi_inputs, new_workspace, refusal  # noqa: E402
from sweep_ours import Ours  # noqa: E402
from sweep_rows import BATCHES, QUICK_BATCHES, build_group, build_row, estimate_bytes, matrix, roofline  # noqa: E402
from sweep_timing import HOST_TIMING, ROUNDS_TIMING, Clock, capture, settle_seconds  # noqa: E402

TOLERANCE = 2e-2
MAX_FAILURES = 3            # a configuration failing on this many rows is not tried again


@dataclass
class Ctx:
    device: str
    clock: Clock
    env: dict
    out: object                          # the JSON-lines file
    fi: object = None                    # the flashinfer module (None: not importable / smoke)
    ws: object = None                    # FlashInfer's float workspace
    deadline: float = float("inf")
    broken: dict = field(default_factory=dict)
    failures: collections.Counter = field(default_factory=collections.Counter)
    mismatches: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    results: int = 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for sweep.jsonl, SWEEP.md, sweep.png and prewarm/ logs "
                                 "(default: bench/sweep/; --smoke: /tmp/attn-sweep-smoke)")
    p.add_argument("--quick", action="store_true", help="bs 1, 16, 128 x kv 8192 only")
    p.add_argument("--only", choices=("gqa", "mla"), help="one family only")
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check (tiny shapes, ours only)")
    p.add_argument("--no-flashinfer", action="store_true", help="ours only")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no new (family, bs, kv) group after this many seconds (default 420; "
                        "the groups left are recorded as skipped)")
    p.add_argument("--prewarm-timeout-s", type=float, default=300.0)
    p.add_argument("--prewarm", help=argparse.SUPPRESS)     # internal: one prewarm job
    p.add_argument("--bs", help=argparse.SUPPRESS)          # internal: batches of a prewarm job
    return p.parse_args(argv)


def import_flashinfer():
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", f"{major}.{minor}" + ("a" if major >= 9 else ""))
    try:
        import flashinfer
        return flashinfer, None
    except Exception as e:  # recorded in the header; the sweep runs ours alone
        return None, f"{type(e).__name__}: {e}"[:300]


def environment(args, device: str, fi, fi_error) -> dict:
    env = dict(type="header", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
               flashinfer=getattr(fi, "__version__", None), flashinfer_error=fi_error,
               flashinfer_cuda_arch_list=os.environ.get("FLASHINFER_CUDA_ARCH_LIST"),
               args=vars(args), smoke=bool(args.smoke), not_swept=NOT_SWEPT)
    try:   # SWEEP_COMMIT names the commit where the tree was copied without its git metadata
        env["git"] = os.environ.get("SWEEP_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except Exception:
        env["git"] = None
    if device == "cuda":
        prop = torch.cuda.get_device_properties(0)
        env.update(device=prop.name, sm=prop.major * 10 + prop.minor, num_sms=prop.multi_processor_count,
                   memory_gb=round(prop.total_memory / 2 ** 30, 1), host_timing=HOST_TIMING, timing=ROUNDS_TIMING)
    else:
        env.update(device="cpu (Triton interpreter)", sm=0)
    return env


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def write(ctx: Ctx, rec: dict) -> None:
    ctx.out.write(json.dumps(rec) + "\n")
    ctx.out.flush()
    ctx.results += 1


def base_record(row, impl: str, **kw) -> dict:
    return dict(type="result", **row.wl.describe(), bs=row.bs, kv=row.kv, impl=impl, **kw)


def finish(ctx: Ctx, row, rec: dict) -> dict:
    """Bytes, flops, intensity and bound (rates too where the record has a time: the CPU smoke's
    eager call; on a GPU the rounds' times come later, and their rates with them), the check,
    loud mismatches (``measure_row`` writes the record, once the row's rounds are in)."""
    rec.update(roofline(row.wl, row.bs, row.kv, rec.get("graph_us") or rec.get("eager_us"), ctx.env))
    errs = [e for e in (rec.get("err"), rec.get("err_graph")) if e is not None]
    if errs:
        rec["check"] = "pass" if max(errs) < TOLERANCE else "FAIL"
        if rec["check"] == "FAIL":
            msg = f"{row.wl.name} bs={row.bs} kv={row.kv} {rec['impl']}: err {max(errs):.3g} vs ours"
            ctx.mismatches.append(msg)
            print(f"!! MISMATCH {msg}", flush=True)
            print(f"!! MISMATCH {msg}", file=sys.stderr, flush=True)
    return rec


def time_ours(ctx: Ctx, row, graphs: dict) -> tuple:
    """``(record, reference output, layout, eager call)``; the graph (kept in ``graphs`` for its
    rounds), host and eager times' interleaved rounds come later (``interleaved_times``)."""
    ours = Ours(row)
    fn, c = ours.eager(), ctx.clock
    t0 = time.perf_counter()
    ref = fn().clone()
    rec = base_record(row, "ours", status="ok")
    if ctx.device != "cuda":                   # the interpreter: one call is the measurement
        rec["eager_us"] = (time.perf_counter() - t0) * 1e6
        return finish(ctx, row, rec), ref, ours.layout(), fn
    rec["eager_gpu_us"] = c.gpu_us(fn)
    g, out = ours.graph()
    g.replay()
    torch.cuda.synchronize()
    rec["err_graph"] = rel_err(out, ref)
    graphs["ours"] = (g, ours)
    return finish(ctx, row, rec), ref, ours.layout(), fn


def _drain() -> None:
    if not torch.cuda.is_available():
        return
    try:
        torch.cuda.synchronize()
    except Exception as e:  # a sticky CUDA error: every later launch fails too, say so
        print(f"!! CUDA error after a failure: {e}", file=sys.stderr, flush=True)


def time_peer(ctx: Ctx, row, config: str, inp, ref, graphs: dict) -> dict:
    rec = base_record(row, config, status="ok")
    c, stage = ctx.clock, "plan"
    try:
        peer = Peer(ctx.fi, config, inp, ctx.ws)
        stage, fn = "run", peer.fn()
        rec["err"] = rel_err(fn(), ref)
        rec["eager_gpu_us"] = c.gpu_us(fn)
        del peer, fn
        stage = "graph"
        gpeer = Peer(ctx.fi, config, inp, ctx.ws, graph=True)   # alive while its graph replays
        g, out = capture(gpeer.fn())
        g.replay()
        torch.cuda.synchronize()
        rec["err_graph"] = rel_err(out, ref)
        graphs[config] = (g, gpeer)                              # replayed in the rounds
    except Exception as e:  # recorded in the row and the footer, never hidden
        _drain()
        rec.update(status="error", reason=f"{stage}: {type(e).__name__}: {e}"[:500])
        ctx.errors.append(f"{row.wl.name} bs={row.bs} kv={row.kv} {config} {rec['reason'][:160]}")
        ctx.failures[config] += 1
        if ctx.failures[config] >= MAX_FAILURES:
            ctx.broken[config] = f"failed on {MAX_FAILURES} rows, last: {rec['reason'][:200]}"
    return finish(ctx, row, rec)


def emulated_peer(ctx: Ctx, row, config: str, inp, ref) -> dict:
    """--smoke: the FlashInfer call's arguments computed in PyTorch (no timings)."""
    rec = base_record(row, config, status="emulated")
    rec["err"] = rel_err(emulate(call_spec(config, inp)), ref)
    return finish(ctx, row, rec)


def measure_row(ctx: Ctx, row) -> list:
    recs = _measure_row(ctx, row)
    for rec in recs:
        write(ctx, rec)
    return recs


def _measure_row(ctx: Ctx, row) -> list:
    graphs: dict = {}                      # {impl: (graph, what it replays)}, alive for the rounds
    try:
        ours, ref, layout, ours_fn = time_ours(ctx, row, graphs)
    except Exception as e:  # no reference and no layout: the peers of this row are skipped
        _drain()
        reason = f"ours: {type(e).__name__}: {e}"[:500]
        ctx.errors.append(f"{row.wl.name} bs={row.bs} kv={row.kv} {reason[:160]}")
        print(f"!! ERROR {row.wl.name} bs={row.bs} kv={row.kv} {reason}", file=sys.stderr, flush=True)
        return [finish(ctx, row, base_record(row, "ours", status="error", reason=reason))]
    recs = [ours]
    if ctx.fi is None and not ctx.env["smoke"]:
        return interleaved_times(ctx, row, recs, ours_fn, None, graphs)
    inp = fi_inputs(row, layout)
    sm = ctx.env["sm"] if not ctx.env["smoke"] else 90      # smoke: check the SM90 set
    for config in candidates(row.wl):
        reason = refusal(config, row.wl, sm) or ctx.broken.get(config)
        if reason:
            recs.append(finish(ctx, row, base_record(row, config, status="skipped", reason=reason)))
        elif ctx.env["smoke"]:
            recs.append(emulated_peer(ctx, row, config, inp, ref))
        else:
            recs.append(time_peer(ctx, row, config, inp, ref, graphs))
    return interleaved_times(ctx, row, recs, ours_fn, inp, graphs)


def interleaved_times(ctx: Ctx, row, recs: list, ours_fn, inp, graphs: dict) -> list:
    """``graph_us`` (replays of ``graphs``), ``host_us`` and ``eager_us`` of ours and every
    configuration that ran: the least of interleaved rounds (``Clock.interleaved_us``, kept in
    ``*_rounds_us``); rates from that graph time. No time is taken one implementation after the
    other: in a machine's slow spells it would favour whichever was timed first (bench/RESULTS.md,
    'Timing noise'). A power-capped row settles first
    (``sweep_timing.settle``, ``graph_settle_s``). One that fails gets ``*_error`` (and no time of
    that kind if none of its rounds ran: a time is the rounds' or none); the others are still
    written."""
    if ctx.device != "cuda":
        return recs
    makers = {"ours": lambda: ours_fn} | {rec["impl"]: lambda c=rec["impl"]: Peer(ctx.fi, c, inp, ctx.ws).fn()
                                          for rec in recs[1:] if rec["status"] == "ok"}
    replays = {impl: lambda impl=impl: graphs[impl][0].replay for impl in graphs}   # no graph held
    settle = settle_seconds(recs[0].get("intensity"), ctx.env.get("ridge_flop_per_byte"))
    for kind, made, timer in (("graph", replays, ctx.clock.gpu_us), ("host", makers, ctx.clock.host_us),
                              ("eager", makers, ctx.clock.eager_us)):
        rounds, errors = ctx.clock.interleaved_us(made, timer, settle_s=settle if kind == "graph" else 0.0)
        for rec in recs:
            if kind == "graph" and ctx.clock.settled.get(rec["impl"]):       # seconds it took part
                rec["graph_settle_s"] = round(ctx.clock.settled[rec["impl"]], 3)
            got = rounds.get(rec["impl"])
            rec.pop(f"{kind}_us", None)
            if got:
                rec.update({f"{kind}_us": min(got), f"{kind}_rounds_us": [round(v, 2) for v in got]})
            if rec["impl"] in errors:
                rec[f"{kind}_error"] = errors[rec["impl"]]
                ctx.errors.append(f"{row.wl.name} bs={row.bs} kv={row.kv} {kind} time of {rec['impl']}: "
                                  f"{errors[rec['impl']][:160]}")
                _drain()
        if kind == "graph":
            graphs.clear()
    for rec in (r for r in recs if r["status"] == "ok"):      # rates of the times kept, or none
        for k in ("gbs", "tflops", "frac_copy", "frac_matmul"):
            rec.pop(k, None)
        rec.update(roofline(row.wl, row.bs, row.kv, rec.get("graph_us") or rec.get("eager_us"), ctx.env))
    return recs


def skip_rows(ctx: Ctx, wls, bs: int, kv: int, reason: str, status: str = "skipped") -> None:
    for wl in wls:
        write(ctx, dict(type="result", **wl.describe(), bs=bs, kv=kv, impl="row", status=status, reason=reason))
    print(f"{','.join(w.name for w in wls)} bs={bs} kv={kv}: {status} ({reason})", flush=True)
    if status == "error":
        ctx.errors.append(f"{wls[0].family} bs={bs} kv={kv}: {reason[:160]}")


def measure_group(ctx: Ctx, key) -> None:
    family, bs, kv, wls = key
    if time.time() > ctx.deadline:
        return skip_rows(ctx, wls, bs, kv, "time budget (--budget-s) spent")
    if ctx.device == "cuda":
        need, free = estimate_bytes(family, bs, kv), torch.cuda.mem_get_info()[0]
        if need > 0.9 * free:
            return skip_rows(ctx, wls, bs, kv, f"needs ~{need / 2 ** 30:.1f} GiB, {free / 2 ** 30:.1f} GiB free")
    try:
        group = build_group(wls[0], bs, kv, ctx.device)
    except Exception as e:  # e.g. out of memory: the group is skipped, the sweep goes on
        _drain()
        return skip_rows(ctx, wls, bs, kv, f"build: {type(e).__name__}: {e}"[:400], status="error")
    for wl in wls:
        try:
            row = build_row(group, wl)
            print(sweep_report.row_summary(measure_row(ctx, row)), flush=True)
        except Exception as e:  # a failure outside the timed calls: recorded, never hidden
            _drain()
            skip_rows(ctx, [wl], bs, kv, f"{type(e).__name__}: {e}"[:400], status="error")
        row = None
    del group
    gc.collect()
    if ctx.device == "cuda":
        torch.cuda.empty_cache()


def calibrate(ctx: Ctx) -> None:
    if ctx.device != "cuda":
        return
    copy, mm = ctx.clock.copy_gbs(), ctx.clock.matmul_tflops()
    ctx.env.update(copy_gbs=round(copy, 1), matmul_tflops=round(mm, 1),
                   ridge_flop_per_byte=round(mm * 1e12 / (copy * 1e9), 1))
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cpu" if (args.smoke or os.environ.get("BENCH_DEVICE") == "cpu") else "cuda"
    if args.prewarm:
        sweep_prewarm.run_job(args.prewarm, [int(b) for b in args.bs.split(",")], device)
        return 0
    t0 = time.time()
    out_dir = Path(args.out or ("/tmp/attn-sweep-smoke" if args.smoke else Path(__file__).parent))
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = matrix(quick=args.quick, only=args.only, smoke=args.smoke)
    fi, fi_error = (None, "not used (--smoke / --no-flashinfer)")
    if device == "cuda" and not args.no_flashinfer:
        fi, fi_error = import_flashinfer()
    env = environment(args, device, fi, fi_error)
    if device == "cuda":
        jobs = sweep_prewarm.jobs(groups, fi is not None, env["sm"])
        print(f"prewarm: {len(jobs)} jobs in parallel ...", flush=True)
        env["prewarm"] = sweep_prewarm.launch(jobs, out_dir, QUICK_BATCHES if args.quick else BATCHES,
                                              args.prewarm_timeout_s)
        print(f"prewarm: {time.time() - t0:.0f} s {env['prewarm']}", flush=True)
    path = out_dir / "sweep.jsonl"
    with open(path, "w") as f:
        ctx = Ctx(device, Clock(device), env, f, fi, new_workspace(device) if fi else None,
                  deadline=t0 + args.budget_s)
        for job, res in env.get("prewarm", {}).items():
            if res["rc"] not in (0, -9) and not job.startswith("ours:"):
                ctx.failures[job] = MAX_FAILURES - 1    # its prewarm failed: one more try only
        calibrate(ctx)
        write(ctx, env)
        print(json.dumps({k: env.get(k) for k in ("device", "torch", "triton", "flashinfer", "cuda",
                                                  "copy_gbs", "matmul_tflops", "ridge_flop_per_byte")}), flush=True)
        for key in groups:
            measure_group(ctx, key)
        write(ctx, dict(type="footer", elapsed_s=round(time.time() - t0, 1), results=ctx.results,
                        mismatches=ctx.mismatches, errors=ctx.errors))
    print(f"sweep: {ctx.results} records in {time.time() - t0:.0f} s -> {path}", flush=True)
    sweep_report.write_all(path, out_dir)
    return 1 if ctx.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
