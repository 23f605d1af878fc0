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
    err = None
    with open(log_path, "w") as log:
        try:
            p = subprocess.run(cmd, env=worker_env(tree, links, os.environ), cwd=tree, stdout=subprocess.PIPE,
                               stderr=log, timeout=a.timeout)
            out = p.stdout
            if p.returncode != 0:
                err = f"worker exited with status {p.returncode}"
        except subprocess.TimeoutExpired as e:
            out, err = e.stdout, f"worker timed out after {a.timeout:g} s"
    recs = parse_records(out.decode(errors="replace") if isinstance(out, bytes) else out)
    if err:
        recs.append({"kind": "error", "label": label, "round": rnd, "error": f"{err} (see {log_path})"})
    return recs


def cell(records, label, rnd, model, impl, bs):
    """A round's median for one row, or "error" where that row's worker failed before timing it."""
    for r in records:
        if (r["kind"] == "step" and r["label"] == label and r["round"] == rnd and r["model"] == model
                and r["impl"] == impl and r["bs"] == bs):
            return r["median_us"]
    for r in records:
        if (r["kind"] == "error" and r["label"] == label and r["round"] == rnd
                and all(r.get(k) in (None, v) for k, v in (("model", model), ("impl", impl), ("bs", bs)))):
            return "error"
    return None


def build_table(records, labels, rounds, models, impls, bss):
    """Markdown rows: every round's median per tree, the best round, and each later tree's best
    over the first tree's (after/before)."""
    head = ["model", "impl", "bs"]
    for label in labels:
        head += [f"{label} r{r}" for r in range(1, rounds + 1)] + [f"{label} best"]
    head += [f"{label}/{labels[0]}" for label in labels[1:]]
    fmt = lambda v: f"{v:.1f}" if isinstance(v, (int, float)) else (v or "-")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in models:
        for impl in impls:
            for bs in bss:
                row, best = [model, impl, str(bs)], {}
                for label in labels:
                    got = [cell(records, label, r, model, impl, bs) for r in range(1, rounds + 1)]
                    nums = [v for v in got if isinstance(v, (int, float))]
                    best[label] = min(nums) if nums else None
                    row += [fmt(v) for v in got] + [fmt(best[label]) if nums else ("error" if "error" in got else "-")]
                base = best[labels[0]]
                for label in labels[1:]:
                    b = best[label]
                    row.append(f"{b / base:.3f}" if b is not None and base else "-")
                lines.append("| " + " | ".join(row) + " |")
    return lines


def header(records, trees, a):
    envs = [r for r in records if r["kind"] == "env"]
    seen = lambda key: ", ".join(sorted({str(r.get(key)) for r in envs})) or "no worker got that far"
    commits = {r["label"]: r.get("commit") for r in records if r.get("commit")}
    tree_desc = "; ".join(f"{lb} = {p} @ {commits.get(lb) or tree_commit(p)}" for lb, p in trees.items())
    return [
        "# Tiny-model decode-step latency, before vs after (bench/step_ab.py)", "",
        f"card: {seen('device')}; torch {seen('torch')}; triton {seen('triton')}", "",
        f"trees: {tree_desc}", "",
        f"method: host-synced step latency (each step `fn(); torch.cuda.synchronize()` timed with perf_counter, "
        f"after {WARMUP} warm-up steps), median of {a.steps} steps per round, in us; {a.rounds} rounds interleaved "
        "across trees (A,B then B,A, ...), each tree and round a separate process importing only that tree; "
        "'best' is the least median over the rounds, kept because the lent VMs have slow spells; "
        "the ratio compares best rounds. 'error': that worker failed (listed below).", ""]


def report(records, trees, a):
    labels = list(trees)
    lines = header(records, trees, a) + build_table(records, labels, a.rounds, csv(a.models), csv(a.impls),
                                                    [int(b) for b in csv(a.bs)])
    errors = [r for r in records if r["kind"] == "error"]
    if errors:
        lines += ["", "Errors:"] + [
            f"- {r['label']} round {r['round']}"
            + "".join(f" {k}={r[k]}" for k in ("model", "impl", "bs") if r.get(k) is not None)
            + f": {r['error']}" for r in errors]
    return "\n".join(lines) + "\n"


def driver(a):
    trees = parse_trees(a.tree)
    if not trees:
        raise SystemExit("step_ab: give at least one --tree LABEL=PATH (two for a ratio)")
    out = os.path.realpath(a.out)
    os.makedirs(out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="step_ab_links_")
    records = []
    try:
        links = {lb: make_links(p, os.path.join(tmp, lb)) for lb, p in trees.items()}
        with open(os.path.join(out, "step_ab.jsonl"), "w") as jl:
            for rnd in range(1, a.rounds + 1):
                for label in round_order(list(trees), rnd):
                    t0 = time.perf_counter()
                    got = run_worker(a, label, trees[label], rnd, links[label],
                                     os.path.join(out, f"worker_{label}_r{rnd}.log"))
                    for rec in got:
                        jl.write(json.dumps(rec) + "\n")
                    jl.flush()
                    records += got
                    n_err = sum(r["kind"] == "error" for r in got)
                    print(f"step_ab: round {rnd} {label}: {sum(r['kind'] == 'step' for r in got)} rows, "
                          f"{n_err} errors, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = report(records, trees, a)
    with open(os.path.join(out, "STEP_AB.md"), "w") as f:
        f.write(text)
    print(text, end="")
    return 0


def import_tree(tree):
    """Import ``bench_runtime`` and the packages from ``tree`` (PYTHONPATH set by the driver) and
    check where each came from. The folder of this script (``sys.path[0]``, which Python puts ahead
    of PYTHONPATH) is dropped first unless it is the tree's own bench/."""
    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    if here != os.path.join(tree, "bench"):
        sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
    br = importlib.import_module("bench_runtime")
    for name in TREE_MODULES[:3]:
        importlib.import_module(name)
    files = {n: os.path.realpath(sys.modules[n].__file__) for n in TREE_MODULES if n in sys.modules}
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
