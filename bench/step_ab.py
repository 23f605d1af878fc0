"""Tiny-model decode-step latency, before and after a change (issue #10, deliverable 3), on a GPU.

For every source tree given (a checkout's root: ``attn_backends/``, ``kernels/``, ``runtime/``,
``bench/bench_runtime.py``) it times ``bench_runtime.setup(model).step(impl, bs)`` *of that tree*:
the tiny GQA / MLA models, impls piecewise, breakable, full_graph and eager, bs 1, 8 and 64.
What is measured is the host-synced step latency, what a serving loop waits for per step: after
5 warm-up steps and a synchronize, each of ``--steps`` steps is timed as
``t0 = perf_counter(); fn(); torch.cuda.synchronize(); perf_counter() - t0``; a round reports the
median and the least of them, in microseconds.

Each (round, tree) runs in its own worker process whose PYTHONPATH resolves the imports to that
tree alone: the tree root (``attn_backends``), a temporary folder of links
``attn_backends_kernels -> TREE/kernels`` and ``attn_backends_runtime -> TREE/runtime``, and
``TREE/bench`` (``bench_runtime``, ``workloads``); entries of the caller's PYTHONPATH that lead to
another checkout are dropped, others (a site-packages folder such as /tmp/site) kept. The worker
checks the files its modules came from and refuses to time another tree's code. Rounds interleave
the trees (A, B, then B, A, ...); the table gives every round's median and each tree's best round
(least median), since the lent VMs have slow spells that slow a whole process, and the ratio of
the best rounds. A worker that fails or outlasts ``--timeout`` is recorded as an error for that
round and tree, and the run goes on.

Make a "before" tree (repository root; nothing under scratch/ is committed), and likewise an
"after" tree from the commit after the change (or pass a checkout with a ``.commit`` file):

    mkdir -p scratch/before && git archive <commit> attn_backends kernels runtime bench \\
        | tar -x -C scratch/before && echo <commit> > scratch/before/.commit

then, on the GPU machine:

    python bench/step_ab.py --tree before=scratch/before --tree after=scratch/after --out OUT

A tree's commit is read from ``TREE/.commit``, else asked of git where the tree is a work tree's
top (``+dirty`` with uncommitted changes in it), else "unknown". Every record goes to
``OUT/step_ab.jsonl`` (a worker's stderr to ``OUT/worker_LABEL_rN.log``), the table to stdout and
``OUT/STEP_AB.md``.
"""
import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

IMPLS = "piecewise,breakable,full_graph,eager"
LINKS = {"attn_backends_kernels": "kernels", "attn_backends_runtime": "runtime"}
TREE_MODULES = ("attn_backends", "attn_backends_kernels", "attn_backends_runtime", "bench_runtime",
                "workloads", "bench_kernels")
WARMUP = 5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH", help="a source tree (repeat)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=60, help="timed steps per (model, impl, bs) and round")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "step_ab"))
    p.add_argument("--impls", default=IMPLS)
    p.add_argument("--models", default="gqa,mla")
    p.add_argument("--bs", default="1,8,64")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per worker")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree-path", help=argparse.SUPPRESS)
    p.add_argument("--label", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def csv(s):
    return [x for x in s.split(",") if x]


def parse_trees(specs):
    """``["before=PATH", ...]`` -> ``{label: absolute path}``, in the order given."""
    trees = {}
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"step_ab: --tree takes LABEL=PATH, not {spec!r}")
        if label in trees:
            raise SystemExit(f"step_ab: tree label {label!r} given twice")
        path = os.path.realpath(path)
        missing = [p for p in ("attn_backends", "kernels", "runtime", "bench/bench_runtime.py")
                   if not os.path.exists(os.path.join(path, p))]
        if missing:
            raise SystemExit(f"step_ab: {path} is no source tree (missing {', '.join(missing)})")
        trees[label] = path
    return trees


def tree_commit(tree):
    """The commit a tree was made from: ``TREE/.commit``, else git's HEAD where ``tree`` is the top
    of a work tree (``+dirty`` with uncommitted changes to the measured folders), else "unknown"."""
    f = os.path.join(tree, ".commit")
    if os.path.isfile(f):
        with open(f) as fh:
            return fh.read().strip() or "unknown"

    def git(*a):
        r = subprocess.run(["git", "-C", tree, *a], capture_output=True, text=True, timeout=30)
        return r.stdout.strip() if r.returncode == 0 else None
    try:
        top = git("rev-parse", "--show-toplevel")
        if top is None or os.path.realpath(top) != os.path.realpath(tree):
            return "unknown"
        dirty = git("status", "--porcelain", "--", "attn_backends", "kernels", "runtime", "bench")
        return (git("rev-parse", "--short=12", "HEAD") or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def round_order(labels, rnd):
    """The trees' order in round ``rnd`` (1-based): as given in odd rounds, reversed in even ones."""
    return list(labels) if rnd % 2 == 1 else list(reversed(labels))


def make_links(tree, folder):
    """Links ``attn_backends_kernels`` / ``attn_backends_runtime`` in ``folder`` to ``tree``'s
    kernels/ and runtime/ (the import names an editable install gives them)."""
    os.makedirs(folder, exist_ok=True)
    for name, sub in LINKS.items():
        link = os.path.join(folder, name)
        if os.path.islink(link):
            os.unlink(link)
        os.symlink(os.path.join(tree, sub), link)
    return folder


def leads_to_a_checkout(entry):
    """Whether a PYTHONPATH entry would import some checkout's code: a folder of links to a
    checkout's kernels/runtime, a checkout's root, or a checkout's bench/. Site-packages folders
    (real packages, no links) do not count."""
    j = lambda *p: os.path.join(entry, *p)
    return (any(os.path.islink(j(name)) for name in LINKS)
            or (os.path.isdir(j("attn_backends")) and os.path.isfile(j("bench", "bench_runtime.py")))
            or os.path.isfile(j("bench_runtime.py")))


def worker_pythonpath(tree, links, existing):
    """PYTHONPATH of a worker for ``tree``: its root, its links folder, its bench/, then the
    entries of ``existing`` that lead to no checkout."""
    keep = [e for e in (existing or "").split(os.pathsep) if e and not leads_to_a_checkout(e)]
    return os.pathsep.join([tree, links, os.path.join(tree, "bench"), *keep])


def worker_env(tree, links, base):
    env = dict(base)
    env["PYTHONPATH"] = worker_pythonpath(tree, links, base.get("PYTHONPATH"))
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TRITON_INTERPRET", None)    # a GPU timing, never the interpreter
    env.pop("BENCH_RESULTS", None)       # bench_runtime's own recorder stays off
    return env


def parse_records(text):
    out = []
    for line in (text or "").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "kind" in rec:
            out.append(rec)
    return out


def run_worker(a, label, tree, rnd, links, log_path):
    """One worker for (tree, round): its records, plus an error record if it failed or timed out."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--tree-path", tree, "--label", label,
           "--round", str(rnd), "--steps", str(a.steps), "--impls", a.impls, "--models", a.models, "--bs", a.bs]
    return run_cmd(cmd, label, tree, rnd, links, log_path, a.timeout)


def run_cmd(cmd, label, tree, rnd, links, log_path, timeout, log_mode="w"):
    """Run a worker command in ``tree``'s environment, its stderr to ``log_path``; its JSON records
    from stdout, plus an error record if it failed or outlasted ``timeout`` seconds (the records it
    printed before are kept)."""
    err = None
    with open(log_path, log_mode) as log:
        try:
            p = subprocess.run(cmd, env=worker_env(tree, links, os.environ), cwd=tree, stdout=subprocess.PIPE,
                               stderr=log, timeout=timeout)
            out = p.stdout
            if p.returncode != 0:
                err = f"worker exited with status {p.returncode}"
        except subprocess.TimeoutExpired as e:
            out, err = e.stdout, f"worker timed out after {timeout:g} s"
    recs = parse_records(out.decode(errors="replace") if isinstance(out, bytes) else out)
    if err:
        recs.append({"kind": "error", "label": label, "round": rnd, "error": f"{err} (see {log_path})"})
    return recs


def cell(records, label, rnd, key, kind="step", value="median_us"):
    """A round's ``value`` for the row ``key`` (a dict of fields), or "error" where that row's
    worker failed before measuring it (an error record's ``of``, where given, names its kind)."""
    for r in records:
        if (r["kind"] == kind and r["label"] == label and r["round"] == rnd
                and all(r.get(k) == v for k, v in key.items())):
            return r[value]
    for r in records:
        if (r["kind"] == "error" and r["label"] == label and r["round"] == rnd and r.get("of") in (None, kind)
                and all(r.get(k) in (None, v) for k, v in key.items())):
            return "error"
    return None


def build_table(records, labels, rounds, models, impls, bss):
    """Markdown rows: every round's median per tree, the best round, and each later tree's best
    over the first tree's (after/before)."""
    keys = [{"model": m, "impl": i, "bs": b} for m in models for i in impls for b in bss]
    return table(records, labels, rounds, keys)


def table(records, labels, rounds, keys, kind="step", value="median_us", agg=min, agg_name="best"):
    """Markdown rows, one per ``key``: every round's ``value`` per tree, their ``agg`` (named
    ``agg_name``) and each later tree's ``agg`` over the first tree's."""
    head = list(keys[0]) if keys else []
    for label in labels:
        head += [f"{label} r{r}" for r in range(1, rounds + 1)] + [f"{label} {agg_name}"]
    head += [f"{label}/{labels[0]}" for label in labels[1:]]
    fmt = lambda v: f"{v:.1f}" if isinstance(v, (int, float)) else (v or "-")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in keys:
        row, best = [str(v) for v in key.values()], {}
        for label in labels:
            got = [cell(records, label, r, key, kind, value) for r in range(1, rounds + 1)]
            nums = [v for v in got if isinstance(v, (int, float))]
            best[label] = agg(nums) if nums else None
            row += [fmt(v) for v in got] + [fmt(best[label]) if nums else ("error" if "error" in got else "-")]
        base = best[labels[0]]
        for label in labels[1:]:
            b = best[label]
            row.append(f"{b / base:.3f}" if b is not None and base else "-")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def context(records, trees):
    """The card and versions the workers saw, and each tree's path and commit."""
    envs = [r for r in records if r["kind"] == "env"]
    seen = lambda key: ", ".join(sorted({str(r.get(key)) for r in envs})) or "no worker got that far"
    commits = {r["label"]: r.get("commit") for r in records if r.get("commit")}
    tree_desc = "; ".join(f"{lb} = {p} @ {commits.get(lb) or tree_commit(p)}" for lb, p in trees.items())
    return [f"card: {seen('device')}; torch {seen('torch')}; triton {seen('triton')}", "", f"trees: {tree_desc}", ""]


def error_lines(records, keys=("model", "impl", "bs")):
    errors = [r for r in records if r["kind"] == "error"]
    return ["", "Errors:"] + [
        f"- {r['label']} round {r['round']}" + "".join(f" {k}={r[k]}" for k in keys if r.get(k) is not None)
        + f": {r['error']}" for r in errors] if errors else []


def header(records, trees, a):
    return [
        "# Tiny-model decode-step latency, before vs after (bench/step_ab.py)", "", *context(records, trees),
        f"method: host-synced step latency (each step `fn(); torch.cuda.synchronize()` timed with perf_counter, "
        f"after {WARMUP} warm-up steps), median of {a.steps} steps per round, in us; {a.rounds} rounds interleaved "
        "across trees (A,B then B,A, ...), each tree and round a separate process importing only that tree; "
        "'best' is the least median over the rounds, kept because the lent VMs have slow spells; "
        "the ratio compares best rounds. 'error': that worker failed (listed below).", ""]


def report(records, trees, a):
    labels = list(trees)
    lines = header(records, trees, a) + build_table(records, labels, a.rounds, csv(a.models), csv(a.impls),
                                                    [int(b) for b in csv(a.bs)])
    return "\n".join(lines + error_lines(records)) + "\n"


def driver(a):
    trees = parse_trees(a.tree)
    if not trees:
        raise SystemExit("step_ab: give at least one --tree LABEL=PATH (two for a ratio)")
    out = os.path.realpath(a.out)
    os.makedirs(out, exist_ok=True)
    run_one = lambda label, tree, rnd, links: run_worker(a, label, tree, rnd, links,
                                                          os.path.join(out, f"worker_{label}_r{rnd}.log"))
    records, _ = run_rounds(trees, a.rounds, os.path.join(out, "step_ab.jsonl"), run_one)
    text = report(records, trees, a)
    with open(os.path.join(out, "STEP_AB.md"), "w") as f:
        f.write(text)
    print(text, end="")
    return 0


def run_rounds(trees, rounds, jsonl_path, run_one, budget_s=None, name="step_ab"):
    """``run_one(label, tree, rnd, links)`` for every round and tree in ``round_order``, each record
    appended to ``jsonl_path`` as it comes: (all records, rounds run). With ``budget_s``, a round
    after the first starts only if the slowest round so far would still end within the budget."""
    tmp = tempfile.mkdtemp(prefix=f"{name}_links_")
    records, done, slowest, start = [], 0, 0.0, time.perf_counter()
    try:
        links = {lb: make_links(p, os.path.join(tmp, lb)) for lb, p in trees.items()}
        with open(jsonl_path, "w") as jl:
            for rnd in range(1, rounds + 1):
                if budget_s is not None and done and time.perf_counter() - start + slowest > budget_s:
                    print(f"{name}: rounds {rnd}-{rounds} not started: a round takes up to {slowest:.0f} s, "
                          f"{budget_s - (time.perf_counter() - start):.0f} s of --budget-s left", file=sys.stderr)
                    break
                t_round = time.perf_counter()
                for label in round_order(list(trees), rnd):
                    t0 = time.perf_counter()
                    got = run_one(label, trees[label], rnd, links[label])
                    for rec in got:
                        jl.write(json.dumps(rec) + "\n")
                    jl.flush()
                    records += got
                    n_err = sum(r["kind"] == "error" for r in got)
                    n_rows = sum(r["kind"] not in ("env", "error") for r in got)
                    print(f"{name}: round {rnd} {label}: {n_rows} rows, {n_err} errors, "
                          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
                slowest, done = max(slowest, time.perf_counter() - t_round), rnd
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return records, done


def import_tree(tree, extra=()):
    """Import ``bench_runtime``, the packages and the modules ``extra`` from ``tree`` (PYTHONPATH set
    by the driver) and check where each came from. The folder of this script (``sys.path[0]``, which
    Python puts ahead of PYTHONPATH) is dropped first unless it is the tree's own bench/."""
    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    if here != os.path.join(tree, "bench"):
        sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
    br = importlib.import_module("bench_runtime")
    for name in (*TREE_MODULES[:3], *extra):
        importlib.import_module(name)
    files = {n: os.path.realpath(sys.modules[n].__file__) for n in (*TREE_MODULES, *extra) if n in sys.modules}
    wrong = {n: f for n, f in files.items() if not f.startswith(tree + os.sep)}
    if wrong:
        raise RuntimeError(f"modules imported from outside {tree}: {wrong}")
    return br, files


def time_step(fn, steps, sync, warmup=WARMUP):
    """Median and least of ``steps`` host-synced calls, in us, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts), min(ts)


def worker_main(a):
    tree = os.path.realpath(a.tree_path)
    base = {"label": a.label, "round": a.round, "commit": tree_commit(tree)}
    emit = lambda rec: print(json.dumps({**base, **rec}), flush=True)
    try:
        br, files = import_tree(tree)
        import torch
        import triton
        cuda = torch.cuda.is_available()
        emit({"kind": "env", "device": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
              "triton": triton.__version__, "modules": files})
        if not cuda:
            raise RuntimeError("no CUDA device: the step timing needs a GPU")
    except Exception as e:  # noqa: BLE001 - reported as this worker's error
        emit({"kind": "error", "error": f"{type(e).__name__}: {e}"})
        return 2
    for model in csv(a.models):
        try:
            s = br.setup(model)
        except Exception as e:  # noqa: BLE001
            emit({"kind": "error", "model": model, "error": f"setup: {type(e).__name__}: {e}"})
            continue
        for impl in csv(a.impls):
            for bs in (int(b) for b in csv(a.bs)):
                try:
                    med, low = time_step(s.step(impl, bs), a.steps, torch.cuda.synchronize)
                    emit({"kind": "step", "model": model, "impl": impl, "bs": bs, "median_us": round(med, 2),
                          "min_us": round(low, 2), "n": a.steps})
                except Exception as e:  # noqa: BLE001
                    emit({"kind": "error", "model": model, "impl": impl, "bs": bs,
                          "error": f"{type(e).__name__}: {e}"})
    return 0


def main(argv=None):
    a = parse_args(argv)
    return worker_main(a) if a.worker else driver(a)


if __name__ == "__main__":
    sys.exit(main())
