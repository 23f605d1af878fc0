"""Replay-preparation host time and EAGLE tokens/s, before and after a change (issue #39's "nothing
slower"), on a GPU, for every source tree given, in interleaved rounds.

The trees, workers and rounds are ``bench/step_ab.py``'s (read its docstring): each (round, tree)
runs in its own process importing that tree alone, and every figure comes from that tree's own
bench code:

- ``prep``: ``bench_runtime.host_times(lambda: runner.prepare(batch), N, rounds=1)`` (the median
  host time of N calls under ``torch.cuda.set_sync_debug_mode("error")``, the GPU drained every 20
  calls outside the timed span) for ``bench_runtime.setup(model).runners[RUNNER]`` (``full_graph``:
  one backend for all layers; ``full_graph_per_layer``: a backend per layer; triton / triton_mla)
  and ``setup(model).batch(bs)``, what ``test_replay_preparation_host_time`` times. The points are
  timed in turn, ``--prep-reps`` times a round with a pause between (a slow spell of the lent
  machine falls on some reps of every point); a round's figure is its least rep; the table keeps
  the least round.
- ``eagle``: ``bench_eagle.measure(bench_eagle.engine(model, method, "graphs"), bs,
  rounds=--eagle-runs)`` (decode tokens/s, median of the runs after a warm-up run; the bench's
  engine: 4 layers, prompt 64, 128 new tokens, buckets 1/8/64, N = 8 chain); the table keeps the
  median round.

``--cpu-smoke`` runs the eagle part on the CPU at test sizes (torch_native, 2 layers, prompt 8, 8
new tokens, buckets 1/8, as ``bench_eagle.smoke``) to try the plumbing without a GPU; the prep
part needs CUDA (``bench_runtime.Setup`` is built on it). On the GPU machine, from the root:

    python bench/runtime_ab.py --tree before=scratch/before --tree after=. --rounds 4 --out OUT

Every record goes to ``OUT/runtime_ab.jsonl``, the workers' stderr to ``OUT/runtime_ab_workers.log``
(each headed ``== LABEL round N``), the tables to stdout and ``OUT/RUNTIME_AB.md``. ``--budget-s``
starts a round only if the slowest round so far would still end within it.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

import step_ab as S  # the trees, workers, rounds and tables (bench/ is sys.path[0] when run)

METRICS = ("prep", "eagle")
MODELS = ("gqa", "mla")
RUNNERS = ("full_graph", "full_graph_per_layer")
METHODS = ("plain", "eagle-high", "eagle-mid", "eagle-low")
MAX_BS = 64               # the largest bucket of both benches
SMOKE = {"prompt": 8, "max_tokens": 8}
SMOKE_BUCKETS = (1, 8)
PAUSE_S = 0.5             # between the prep reps of a round
WORKER_FLAGS = ("metrics", "models", "runners", "prep_bs", "prep_calls", "prep_reps", "eagle_bs", "methods",
                "eagle_runs")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH", help="a source tree (repeat)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "runtime_ab"))
    p.add_argument("--metrics", default=",".join(METRICS))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--runners", default=",".join(RUNNERS))
    p.add_argument("--prep-bs", default="1,8,64")
    p.add_argument("--prep-calls", type=int, default=300, help="calls per prep median")
    p.add_argument("--prep-reps", type=int, default=3, help="prep medians per point and round (least kept)")
    p.add_argument("--eagle-bs", default="1,8")
    p.add_argument("--methods", default="plain,eagle-high")
    p.add_argument("--eagle-runs", type=int, default=3, help="generate runs per measure (median kept)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per worker")
    p.add_argument("--budget-s", type=float, help="start no round that the slowest so far says would end later")
    p.add_argument("--cpu-smoke", action="store_true", help="eagle on the CPU at test sizes (plumbing only)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree-path", help=argparse.SUPPRESS)
    p.add_argument("--label", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def check_args(a):
    """Every flag against its limit, before any tree is read or worker started."""
    def subset(flag, value, allowed):
        got = S.csv(value)
        bad = [x for x in got if x not in allowed]
        if not got or bad:
            raise SystemExit(f"runtime_ab: --{flag} {value!r}: each of {', '.join(allowed)}, at least one")
        return got

    def sizes(flag, value, most):
        try:
            got = [int(x) for x in S.csv(value)]
        except ValueError:
            got = []
        if not got or not all(1 <= b <= most for b in got):
            raise SystemExit(f"runtime_ab: --{flag} {value!r}: batch sizes from 1 to {most}, at least one")

    for flag in ("rounds", "prep_calls", "prep_reps", "eagle_runs"):
        if getattr(a, flag) < 1:
            raise SystemExit(f"runtime_ab: --{flag.replace('_', '-')} {getattr(a, flag)}: at least 1")
    for flag in ("timeout", "budget_s"):
        if getattr(a, flag) is not None and getattr(a, flag) <= 0:
            raise SystemExit(f"runtime_ab: --{flag.replace('_', '-')} {getattr(a, flag):g}: more than 0 s")
    metrics = subset("metrics", a.metrics, METRICS)
    subset("models", a.models, MODELS)
    subset("runners", a.runners, RUNNERS)
    subset("methods", a.methods, METHODS)
    sizes("prep-bs", a.prep_bs, MAX_BS)
    sizes("eagle-bs", a.eagle_bs, max(SMOKE_BUCKETS) if a.cpu_smoke else MAX_BS)
    if a.cpu_smoke and "prep" in metrics:
        raise SystemExit("runtime_ab: --cpu-smoke with --metrics prep: the prep timing needs CUDA "
                         "(bench_runtime.Setup is built on it); give --metrics eagle")


def worker_cmd(a, label, tree, rnd):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--tree-path", tree, "--label", label,
           "--round", str(rnd)]
    for flag in WORKER_FLAGS:
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
    return cmd + (["--cpu-smoke"] if a.cpu_smoke else [])


def prep_keys(a):
    return [{"model": m, "runner": r, "bs": b} for m in S.csv(a.models) for r in S.csv(a.runners)
            for b in (int(x) for x in S.csv(a.prep_bs))]


def eagle_keys(a):
    return [{"model": m, "method": t, "bs": b} for m in S.csv(a.models) for t in S.csv(a.methods)
            for b in (int(x) for x in S.csv(a.eagle_bs))]


def report(records, trees, a, rounds):
    labels, metrics = list(trees), S.csv(a.metrics)
    lines = ["# Replay preparation and EAGLE, before vs after (bench/runtime_ab.py)", "",
             *S.context(records, trees),
             f"method: {rounds} rounds interleaved across trees (A,B then B,A, ...), each tree and round a "
             "separate process importing only that tree and timing with that tree's own bench code; "
             "'error': that worker or row failed (listed below)." + (
                 " CPU SMOKE (torch_native, test sizes): the figures say nothing of speed." if a.cpu_smoke else ""),
             ""]
    if "prep" in metrics:
        lines += ["## runner.prepare host time (us, lower is better)", "",
                  f"bench_runtime.host_times(runner.prepare, {a.prep_calls}, rounds=1): the median of "
                  f"{a.prep_calls} calls, sync debug mode 'error'; a round's figure is the least of its "
                  f"{a.prep_reps} reps; 'best' is the least round, the ratio compares best rounds.", "",
                  *S.table(records, labels, rounds, prep_keys(a), "prep", "host_us"), ""]
    if "eagle" in metrics:
        keys = eagle_keys(a)
        lines += ["## EAGLE decode tokens/s (higher is better)", "",
                  f"bench_eagle.measure(engine(model, method, 'graphs'), bs, rounds={a.eagle_runs}): the median "
                  f"of {a.eagle_runs} runs; 'median' is the median round, the ratio compares medians.", "",
                  *S.table(records, labels, rounds, keys, "eagle", "tok_s", statistics.median, "median"), "",
                  "Mean accept length (the same runs):", "",
                  *S.table(records, labels, rounds, keys, "eagle", "mean_accept", statistics.median, "median"), ""]
    return "\n".join(lines + S.error_lines(records, ("model", "runner", "method", "bs"))) + "\n"


def driver(a):
    check_args(a)
    trees = S.parse_trees(a.tree)
    if not trees:
        raise SystemExit("runtime_ab: --tree: give at least one LABEL=PATH (two for a ratio)")
    out = os.path.realpath(a.out)
    os.makedirs(out, exist_ok=True)
    log = os.path.join(out, "runtime_ab_workers.log")   # one file: a lent machine hands back at most 8
    open(log, "w").close()

    def run_one(label, tree, rnd, links):
        with open(log, "a") as f:
            f.write(f"== {label} round {rnd}\n")
        return S.run_cmd(worker_cmd(a, label, tree, rnd), label, tree, rnd, links, log, a.timeout, "a")
    records, rounds = S.run_rounds(trees, a.rounds, os.path.join(out, "runtime_ab.jsonl"), run_one, a.budget_s,
                                   "runtime_ab")
    text = report(records, trees, a, rounds)
    with open(os.path.join(out, "RUNTIME_AB.md"), "w") as f:
        f.write(text)
    print(text, end="")
    return 0


def time_prep(br, a, emit):
    """Every (model, runner, bs) point's prepare host time, the points timed in turn per rep."""
    calls = {}
    for model in S.csv(a.models):
        try:
            s = br.setup(model)
            for runner in S.csv(a.runners):
                for bs in (int(x) for x in S.csv(a.prep_bs)):
                    r, b = s.runners[runner], s.batch(bs)
                    calls[model, runner, bs] = lambda r=r, b=b: r.prepare(b)
        except Exception as e:  # noqa: BLE001 - reported as this model's error
            emit({"kind": "error", "of": "prep", "model": model, "error": f"setup: {type(e).__name__}: {e}"})
            for p in [p for p in calls if p[0] == model]:
                del calls[p]
    reps = {p: [] for p in calls}
    for _ in range(a.prep_reps):
        for p, fn in list(calls.items()):
            try:
                reps[p].append(br.host_times(fn, a.prep_calls, rounds=1))
            except Exception as e:  # noqa: BLE001 - this point's error; the others go on
                emit({"kind": "error", "of": "prep", **dict(zip(("model", "runner", "bs"), p)),
                      "error": f"{type(e).__name__}: {e}"})
                del calls[p]
        time.sleep(PAUSE_S)
    for p in calls:
        emit({"kind": "prep", **dict(zip(("model", "runner", "bs"), p)), "host_us": round(min(reps[p]), 2),
              "reps": [round(x, 2) for x in reps[p]], "n": a.prep_calls})


def smoke_engine(be, model, method):
    tc = replace(be.TinyConfig(is_mla=model == "mla", page_size=16), num_layers=2)
    return be.Engine(be.engine_config(model, method, "graphs", "cpu", tc, "torch_native", SMOKE_BUCKETS, **SMOKE))


def time_eagle(be, a, emit):
    """Decode tokens/s of every (model, method, bs), one engine per (model, method) as the bench."""
    for model in S.csv(a.models):
        for method in S.csv(a.methods):
            key = {"model": model, "method": method}
            try:
                e = smoke_engine(be, model, method) if a.cpu_smoke else be.engine(model, method, "graphs")
            except Exception as e:  # noqa: BLE001 - reported as this engine's error
                emit({"kind": "error", "of": "eagle", **key, "error": f"engine: {type(e).__name__}: {e}"})
                continue
            for bs in (int(x) for x in S.csv(a.eagle_bs)):
                try:
                    m = be.measure(e, bs, rounds=a.eagle_runs, **(SMOKE if a.cpu_smoke else {}))
                    emit({"kind": "eagle", **key, "bs": bs, "tok_s": round(m["tok_s"], 1),
                          "mean_accept": round(m["mean_accept"], 3), "runs": a.eagle_runs})
                except Exception as e:  # noqa: BLE001
                    emit({"kind": "error", "of": "eagle", **key, "bs": bs, "error": f"{type(e).__name__}: {e}"})


def worker_main(a):
    tree = os.path.realpath(a.tree_path)
    base = {"label": a.label, "round": a.round, "commit": S.tree_commit(tree)}
    emit = lambda rec: print(json.dumps({**base, **rec}), flush=True)
    metrics = S.csv(a.metrics)
    try:
        br, files = S.import_tree(tree, ("bench_eagle",) if "eagle" in metrics else ())
        import torch
        import triton
        cuda = torch.cuda.is_available()
        emit({"kind": "env", "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "triton": triton.__version__, "modules": files})
        if not cuda and not a.cpu_smoke:
            raise RuntimeError("no CUDA device: the timings need a GPU (--cpu-smoke tries the plumbing)")
    except Exception as e:  # noqa: BLE001 - reported as this worker's error
        emit({"kind": "error", "error": f"{type(e).__name__}: {e}"})
        return 2
    if "prep" in metrics:
        time_prep(br, a, emit)
    if "eagle" in metrics:
        time_eagle(sys.modules["bench_eagle"], a, emit)
    return 0


def main(argv=None):
    a = parse_args(argv)
    return worker_main(a) if a.worker else driver(a)


if __name__ == "__main__":
    sys.exit(main())
