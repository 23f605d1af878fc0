"""The sweep (issues #10, #40): ours against every FlashInfer configuration that can run each row.

Usage (repository root)::

    python bench/sweep/sweep.py [--out DIR] [--grid issue40|issue10] [--quick] [--only gqa|mla]
        [--dist ragged,longtail,bimodal,uniform] [--workloads NAME|PATTERN,...] [--bs 8,24,48]
        [--kv 16384] [--seed N] [--budget-s S] [--no-invariant] [--trace N]
    python bench/sweep/sweep.py --grid issue10          # issue #10's uniform grid, as it was
    STAGES="sweep" bash bench/run_gpu.sh DIR            # the same, from the GPU script
    BENCH_DEVICE=cpu TRITON_INTERPRET=1 python bench/sweep/sweep.py --smoke --out DIR
    python bench/sweep/sweep_report.py DIR/sweep.jsonl  # bench/sweep/SWEEP.md + bench/sweep/sweep.png

``--out`` defaults to bench/sweep/ (``--smoke``: /tmp/attn-sweep-smoke). On a GPU machine without
matplotlib (the lent ones) run with ``--out $OUT`` and redraw the table and plot with ``sweep_report.py``.

Matrix (``sweep_matrix``, workloads and lengths in ``sweep_rows``): GQA (page 16) decode, verify N=4
(chain) and N=8 tree (topk 4); MLA 16 and 128 heads (512 + 64, page 64) decode and verify N=4; each
row's KV lengths from a distribution (uniform: every request ``kv``; ragged; longtail; bimodal).
``--grid issue40`` (the default): GQA 8/1, 28/4, 32/8, 64/8 at d64 and d128, bs 1, 3, 8, 24, 48, 64,
100, 128, every distribution; ``--grid issue10``: issue #10's uniform grid. ``--dist``, ``--workloads``,
``--bs`` and ``--kv`` (the uniform rows' kv) pick a subset. bf16, shuffled pages, the pool holding
exactly the pages the lengths need, the same data for ours and FlashInfer. A group whose memory
estimate exceeds 90% of the free device memory is skipped, with the reason.

Per row, ours (``sweep_ours``), on GQA rows our batch-invariant mode too (``ours_invariant``, issue #40.5:
``BatchInvariantTritonBackend``; not with ``--no-invariant``; never counted as a FlashInfer
configuration), and every FlashInfer configuration (``sweep_flashinfer``):
``graph_us`` (replay of a captured graph, GPU time), ``eager_us`` (one eager call from an idle GPU, host
launch included), ``eager_gpu_us`` (eager calls back to back, GPU time) and ``host_us`` (host time of one
eager call), all medians with L2 flushed (``sweep_timing``); ``graph_us``, ``host_us`` and ``eager_us`` the
least of interleaved rounds over ours, ours_invariant and every configuration (``interleaved_times``; the
graph rounds of a power-capped row start after ``graph_settle_s`` seconds of replays of each in turn,
``sweep_timing.settle``); output checked against ours (``max|out - ours| / max|ours| < 2e-2``). Before
timing, every JIT module and Triton kernel is built in parallel processes (``sweep_prewarm``).
``--trace N``: each graph's kernels, busy time, span and gaps over N profiled replays (``sweep_trace``),
printed and kept in the record (``trace``).
``--smoke`` (CPU, interpreter): a tiny shape of each workload (uniform) and of a few workloads for every
other distribution (lengths / 128), ours (and ours_invariant) eager only, and each FlashInfer configuration's arguments
checked by ``sweep_fi_emulate`` instead of run.

Output: ``DIR/sweep.jsonl``, JSON lines:

* ``{"type": "header", "device", "sm", "num_sms", "memory_gb", "torch", "triton",
  "flashinfer", "flashinfer_error", "cuda", "flashinfer_cuda_arch_list", "git",
  "date", "copy_gbs", "matmul_tflops", "ridge_flop_per_byte", "args", "smoke",
  "prewarm": {job: {"rc", "s", "tail"?}}, "not_swept": {config: reason}, "host_timing", "timing"}``
* one ``{"type": "result", "workload", "family", "mode", "heads", "kv_heads", "qk_dim",
  "v_dim", "page_size", "width", "topk", "bs", "kv" (non-uniform: the lengths' mean), "dist", "kv_min",
  "kv_max", "kv_sum", "lens" (non-uniform), "impl" ("ours" | "ours_invariant" | a FlashInfer config
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

import collections  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import sweep_prewarm  # noqa: E402
import sweep_report  # noqa: E402
import sweep_trace  # noqa: E402
import torch  # noqa: E402
from sweep_args import environment, import_flashinfer, parse_args  # noqa: E402
from sweep_fi_emulate import emulate  # noqa: E402
from sweep_flashinfer import Peer, call_spec, candidates, fi_inputs, new_workspace, refusal  # noqa: E402
from sweep_matrix import points  # noqa: E402
from sweep_ours import INVARIANT, Ours, has_invariant  # noqa: E402
from sweep_records import base_record, calibrate, label, rel_err, skip_rows, write  # noqa: E402
from sweep_rows import build_group, build_row, estimate_bytes, roofline  # noqa: E402
from sweep_timing import Clock, capture, settle_seconds  # noqa: E402

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
    invariant: bool = True               # GQA rows: our batch-invariant mode too (--no-invariant: not)
    trace: int = 0                       # --trace N: each graph's kernels over N replays (sweep_trace)
    broken: dict = field(default_factory=dict)
    failures: collections.Counter = field(default_factory=collections.Counter)
    mismatches: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    results: int = 0


def finish(ctx: Ctx, row, rec: dict) -> dict:
    """Bytes, flops, intensity and bound (rates too where the record has a time: the CPU smoke's
    eager call; on a GPU the rounds' times come later, and their rates with them), the check,
    loud mismatches (``measure_row`` writes the record, once the row's rounds are in)."""
    rec.update(roofline(row.wl, row.bs, row.kv, rec.get("graph_us") or rec.get("eager_us"), ctx.env, row.lens))
    errs = [e for e in (rec.get("err"), rec.get("err_graph")) if e is not None]
    if errs:
        rec["check"] = "pass" if max(errs) < TOLERANCE else "FAIL"
        if rec["check"] == "FAIL":
            msg = f"{label(row)} {rec['impl']}: err {max(errs):.3g} vs ours"
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


def time_invariant(ctx: Ctx, row, ref, graphs: dict) -> tuple:
    """``(record, eager call)`` of our batch-invariant mode (impl ``INVARIANT``, the call None where it
    failed), as ``time_ours``: its eager and graph outputs checked against ours (``err``,
    ``err_graph``), its graph left in ``graphs`` for the rounds. A failure is recorded in the row and
    the footer; the row goes on."""
    rec, stage = base_record(row, INVARIANT, status="ok"), "eager"
    try:
        inv = Ours(row, invariant=True)
        fn = inv.eager()
        t0 = time.perf_counter()
        rec["err"] = rel_err(fn(), ref)
        if ctx.device != "cuda":               # the interpreter: one call is the measurement
            rec["eager_us"] = (time.perf_counter() - t0) * 1e6
            return finish(ctx, row, rec), fn
        rec["eager_gpu_us"] = ctx.clock.gpu_us(fn)
        stage = "graph"
        g, out = inv.graph()
        g.replay()
        torch.cuda.synchronize()
        rec["err_graph"] = rel_err(out, ref)
        graphs[INVARIANT] = (g, inv)
        return finish(ctx, row, rec), fn
    except Exception as e:  # recorded in the row and the footer, never hidden
        _drain()
        rec.update(status="error", reason=f"{stage}: {type(e).__name__}: {e}"[:500])
        ctx.errors.append(f"{label(row)} {INVARIANT} {rec['reason'][:160]}")
        return finish(ctx, row, rec), None


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
        ctx.errors.append(f"{label(row)} {config} {rec['reason'][:160]}")
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
        ctx.errors.append(f"{label(row)} {reason[:160]}")
        print(f"!! ERROR {label(row)} {reason}", file=sys.stderr, flush=True)
        return [finish(ctx, row, base_record(row, "ours", status="error", reason=reason))]
    recs, mine = [ours], {}
    if ctx.invariant and has_invariant(row.wl):
        inv, inv_fn = time_invariant(ctx, row, ref, graphs)
        recs.append(inv)
        mine = {INVARIANT: inv_fn} if inv_fn else {}
    if ctx.fi is None and not ctx.env["smoke"]:
        return interleaved_times(ctx, row, recs, ours_fn, None, graphs, mine)
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
    return interleaved_times(ctx, row, recs, ours_fn, inp, graphs, mine)


def interleaved_times(ctx: Ctx, row, recs: list, ours_fn, inp, graphs: dict, mine=None) -> list:
    """``graph_us`` (replays of ``graphs``), ``host_us`` and ``eager_us`` of ours, of our other modes
    that ran (``mine``: ``{impl: eager call}``, the batch-invariant one) and of every FlashInfer
    configuration that ran: the least of interleaved rounds (``Clock.interleaved_us``, kept in
    ``*_rounds_us``); rates from that graph time. No time is taken one implementation after the
    other: in a machine's slow spells it would favour whichever was timed first (bench/RESULTS.md,
    'Timing noise'). A power-capped row settles first
    (``sweep_timing.settle``, ``graph_settle_s``). One that fails gets ``*_error`` (and no time of
    that kind if none of its rounds ran: a time is the rounds' or none); the others are still
    written."""
    if ctx.device != "cuda":
        return recs
    own = {"ours": ours_fn} | (mine or {})
    makers = {impl: lambda f=f: f for impl, f in own.items()} | {
        rec["impl"]: lambda c=rec["impl"]: Peer(ctx.fi, c, inp, ctx.ws).fn()
        for rec in recs[1:] if rec["status"] == "ok" and rec["impl"] not in ("ours", INVARIANT)}
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
                ctx.errors.append(f"{label(row)} {kind} time of {rec['impl']}: "
                                  f"{errors[rec['impl']][:160]}")
                _drain()
        if kind == "graph":
            trace_graphs(ctx, recs, graphs)
            graphs.clear()
    for rec in (r for r in recs if r["status"] == "ok"):      # rates of the times kept, or none
        for k in ("gbs", "tflops", "frac_copy", "frac_matmul"):
            rec.pop(k, None)
        rec.update(roofline(row.wl, row.bs, row.kv, rec.get("graph_us") or rec.get("eager_us"), ctx.env, row.lens))
    return recs


def trace_graphs(ctx: Ctx, recs: list, graphs: dict) -> None:
    """``--trace N``: each graph's kernels, span and gaps over N replays (``sweep_trace``) in its record
    (``trace``; a failure in ``trace_error``, the row goes on)."""
    for rec in (r for r in recs if ctx.trace and r["impl"] in graphs):
        try:
            rec["trace"] = sweep_trace.trace(graphs[rec["impl"]][0].replay, ctx.clock.flush, ctx.trace)
            print(sweep_trace.line(rec["impl"], rec, rec["trace"]), flush=True)
        except Exception as e:  # recorded in the row, never hidden
            _drain()
            rec["trace_error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"!! trace {rec['impl']}: {rec['trace_error']}", file=sys.stderr, flush=True)


def measure_group(ctx: Ctx, pt) -> None:
    """The rows of point ``pt`` (``sweep_matrix.Point``) over one memory and one set of requests."""
    wls = pt.wls
    if time.time() > ctx.deadline:
        return skip_rows(ctx, wls, pt, "time budget (--budget-s) spent")
    if ctx.device == "cuda":
        need, free = estimate_bytes(wls, pt.lens), torch.cuda.mem_get_info()[0]
        if need > 0.9 * free:
            return skip_rows(ctx, wls, pt, f"needs ~{need / 2 ** 30:.1f} GiB, {free / 2 ** 30:.1f} GiB free")
    try:
        group = build_group(wls[0], pt.bs, pt.kv, ctx.device, lens=list(pt.lens), dist=pt.dist)
    except Exception as e:  # e.g. out of memory: the group is skipped, the sweep goes on
        _drain()
        return skip_rows(ctx, wls, pt, f"build: {type(e).__name__}: {e}"[:400], status="error")
    for wl in wls:
        try:
            row = build_row(group, wl)
            print(sweep_report.row_summary(measure_row(ctx, row)), flush=True)
        except Exception as e:  # a failure outside the timed calls: recorded, never hidden
            _drain()
            skip_rows(ctx, [wl], pt, f"{type(e).__name__}: {e}"[:400], status="error")
        row = None
    del group
    gc.collect()
    if ctx.device == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cpu" if (args.smoke or os.environ.get("BENCH_DEVICE") == "cpu") else "cuda"
    if args.prewarm:
        sweep_prewarm.run_job(args.prewarm, [int(b) for b in args.prewarm_bs.split(",")], device)
        return 0
    try:                                   # a bad selection is refused before anything starts
        groups = points(args.grid, quick=args.quick, only=args.only, dists=args.dist, workloads=args.workloads,
                        batches=args.bs, kvs=args.kv, smoke=args.smoke, seed=args.seed)
    except ValueError as e:
        print(f"sweep.py: error: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    out_dir = Path(args.out or ("/tmp/attn-sweep-smoke" if args.smoke else Path(__file__).parent))
    out_dir.mkdir(parents=True, exist_ok=True)
    fi, fi_error = (None, "not used (--smoke / --no-flashinfer)")
    if device == "cuda" and not args.no_flashinfer:
        fi, fi_error = import_flashinfer()
    env = environment(args, device, fi, fi_error)
    if device == "cuda":
        jobs = sweep_prewarm.jobs(groups, fi is not None, env["sm"], invariant=not args.no_invariant)
        print(f"prewarm: {len(jobs)} jobs in parallel ...", flush=True)
        env["prewarm"] = sweep_prewarm.launch(jobs, out_dir, sorted({p.bs for p in groups}), args.prewarm_timeout_s)
        print(f"prewarm: {time.time() - t0:.0f} s {env['prewarm']}", flush=True)
    path = out_dir / "sweep.jsonl"
    with open(path, "w") as f:
        ctx = Ctx(device, Clock(device), env, f, fi, new_workspace(device) if fi else None,
                  deadline=t0 + args.budget_s, invariant=not args.no_invariant, trace=args.trace)
        for job, res in env.get("prewarm", {}).items():
            if res["rc"] not in (0, -9) and not job.startswith(("ours:", f"{INVARIANT}:")):
                ctx.failures[sweep_prewarm.config_of(job)] = MAX_FAILURES - 1   # its prewarm failed: one more try only
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
