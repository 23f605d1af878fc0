"""bench/runtime_ab.py on the CPU: each flag refused past its limit before any worker starts; the
prep part times every point with the tree's own ``host_times`` and keeps each point's least rep (a
failing point or model reported, the others timed); the eagle part measures the bench's graphs
engine per (model, method); the tables (least round for prep, median round for eagle, an error
counted only against its own metric); the round budget; and the driver end to end on fake trees
(no CUDA: an error per worker; three files out) and on this checkout with ``--cpu-smoke`` (its real bench_eagle)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_step_ab import fake_tree, rows_of

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))     # runtime_ab imports step_ab as its script would; only for these two
try:
    import runtime_ab as R
    import step_ab as S
finally:
    sys.path.remove(str(ROOT / "bench"))


def args(*extra):
    return R.parse_args(["--tree", "a=/x", *extra])


@pytest.mark.parametrize("extra, message", [
    (["--rounds", "0"], "--rounds 0: at least 1"),
    (["--prep-reps", "0"], "--prep-reps 0: at least 1"),
    (["--budget-s", "0"], "--budget-s 0: more than 0 s"),
    (["--metrics", "prep,speed"], "--metrics 'prep,speed': each of prep, eagle"),
    (["--models", ""], "--models '': each of gqa, mla, at least one"),
    (["--runners", "breakable"], "--runners 'breakable': each of full_graph, full_graph_per_layer"),
    (["--methods", "eagle-top"], "--methods 'eagle-top': each of plain, eagle-high"),
    (["--prep-bs", "1,128"], "--prep-bs '1,128': batch sizes from 1 to 64"),
    (["--eagle-bs", "x"], "--eagle-bs 'x': batch sizes from 1 to 64"),
    (["--cpu-smoke", "--metrics", "eagle", "--eagle-bs", "16"], "--eagle-bs '16': batch sizes from 1 to 8"),
    (["--cpu-smoke"], "--cpu-smoke with --metrics prep: the prep timing needs CUDA"),
])
def test_each_flag_refused_past_its_limit(extra, message):
    with pytest.raises(SystemExit) as e:
        R.check_args(args(*extra))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_defaults_pass_and_reach_the_worker():
    a = args()
    R.check_args(a)
    cmd = R.worker_cmd(a, "a", "/x", 3)
    assert cmd[2:9] == ["--worker", "--tree-path", "/x", "--label", "a", "--round", "3"]
    worker = R.parse_args(cmd[2:])
    assert all(getattr(worker, f) == getattr(a, f) for f in R.WORKER_FLAGS) and not worker.cpu_smoke
    assert R.parse_args(R.worker_cmd(args("--cpu-smoke"), "a", "/x", 1)[2:]).cpu_smoke


class FakeRunner:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def prepare(self, b):
        self.log.append((self.name, b))


def fake_bench_runtime(log, times, broken_model=None, broken_point=None):
    def setup(model):
        if model == broken_model:
            raise RuntimeError("no memory")
        return SimpleNamespace(runners={r: FakeRunner(log, (model, r)) for r in R.RUNNERS},
                               batch=lambda bs: ("batch", bs))

    def host_times(fn, n, rounds):
        assert rounds == 1
        for _ in range(n):
            fn()
        point = log[-1][0] + (log[-1][1][1],)
        if point == broken_point:
            raise ValueError("sync in prepare")
        return times.pop(0)
    return SimpleNamespace(setup=setup, host_times=host_times)


def test_prep_times_every_point_per_rep_and_keeps_the_least(monkeypatch):
    monkeypatch.setattr(R, "PAUSE_S", 0)
    log, out = [], []
    a = args("--models", "gqa,mla", "--runners", "full_graph,full_graph_per_layer", "--prep-bs", "1,8",
             "--prep-calls", "2", "--prep-reps", "3")
    times = [float(x) for x in range(100, 124)]      # 8 points x 3 reps, in the order timed
    times[8] = 50.0                                  # the second rep of the first point is its least
    R.time_prep(fake_bench_runtime(log, times), a, out.append)
    assert len(log) == 8 * 3 * 2 and log[:2] == [(("gqa", "full_graph"), ("batch", 1))] * 2
    assert [(r["model"], r["runner"], r["bs"]) for r in out] == [
        (m, r, b) for m in ("gqa", "mla") for r in R.RUNNERS for b in (1, 8)]
    assert out[0] == {"kind": "prep", "model": "gqa", "runner": "full_graph", "bs": 1, "host_us": 50.0,
                      "reps": [100.0, 50.0, 116.0], "n": 2}
    assert out[7]["host_us"] == 107.0 and out[7]["reps"] == [107.0, 115.0, 123.0]


def test_prep_reports_a_failing_model_or_point_and_times_the_rest(monkeypatch):
    monkeypatch.setattr(R, "PAUSE_S", 0)
    log, out = [], []
    a = args("--runners", "full_graph", "--prep-bs", "1,8", "--prep-calls", "1", "--prep-reps", "2")
    R.time_prep(fake_bench_runtime(log, [1.0, 2.0, 3.0], broken_model="gqa", broken_point=("mla", "full_graph", 1)),
                a, out.append)
    assert out == [
        {"kind": "error", "of": "prep", "model": "gqa", "error": "setup: RuntimeError: no memory"},
        {"kind": "error", "of": "prep", "model": "mla", "runner": "full_graph", "bs": 1,
         "error": "ValueError: sync in prepare"},
        {"kind": "prep", "model": "mla", "runner": "full_graph", "bs": 8, "host_us": 1.0, "reps": [1.0, 2.0], "n": 1}]


def test_eagle_measures_the_benchs_graphs_engine():
    seen, out = [], []

    def engine(model, method, impl):
        if method == "eagle-high" and model == "mla":
            raise RuntimeError("capture failed")
        return (model, method, impl)

    def measure(e, bs, rounds):
        seen.append((e, bs, rounds))
        return {"tok_s": 1000.04 * bs, "mean_accept": 7.7123}
    a = args("--eagle-bs", "1,8", "--eagle-runs", "2")
    R.time_eagle(SimpleNamespace(engine=engine, measure=measure), a, out.append)
    assert seen == [((m, t, "graphs"), bs, 2) for m, t in (("gqa", "plain"), ("gqa", "eagle-high"), ("mla", "plain"))
                    for bs in (1, 8)]
    assert out[0] == {"kind": "eagle", "model": "gqa", "method": "plain", "bs": 1, "tok_s": 1000.0,
                      "mean_accept": 7.712, "runs": 2}
    assert out[-1] == {"kind": "error", "of": "eagle", "model": "mla", "method": "eagle-high",
                       "error": "engine: RuntimeError: capture failed"}


def rec(kind, label, rnd, **kw):
    return {"kind": kind, "label": label, "round": rnd, **kw}


def test_tables_least_prep_median_eagle_and_errors_by_metric():
    a = args("--models", "gqa", "--runners", "full_graph", "--prep-bs", "1", "--methods", "plain", "--eagle-bs", "1",
             "--rounds", "3")
    p = dict(model="gqa", runner="full_graph", bs=1)
    e = dict(model="gqa", method="plain", bs=1)
    recs = [rec("prep", "before", r, **p, host_us=v) for r, v in ((1, 22.0), (2, 30.0), (3, 21.0))]
    recs += [rec("prep", "after", r, **p, host_us=v) for r, v in ((1, 23.1), (2, 22.0))]
    recs += [rec("eagle", "before", r, **e, tok_s=v, mean_accept=1.0) for r, v in ((1, 900.0), (2, 1000.0), (3, 980.0))]
    recs += [rec("eagle", "after", r, **e, tok_s=v, mean_accept=1.0) for r, v in ((1, 990.0), (2, 700.0))]
    recs += [rec("error", "after", 3, of="eagle", model="gqa", error="engine: boom")]
    text = R.report(recs, {"before": "/b", "after": "/a"}, a, 3)
    prep, eagle = text.split("## EAGLE")
    assert rows_of([ln for ln in prep.splitlines() if ln.startswith("|")])["gqa", "full_graph", "1"] == [
        "gqa", "full_graph", "1", "22.0", "30.0", "21.0", "21.0", "23.1", "22.0", "-", "22.0", "1.048"]
    tok = rows_of([ln for ln in eagle.split("Mean accept")[0].splitlines() if ln.startswith("|")])
    assert tok["gqa", "plain", "1"] == ["gqa", "plain", "1", "900.0", "1000.0", "980.0", "980.0",
                                        "990.0", "700.0", "error", "845.0", "0.862"]
    assert "- after round 3 model=gqa: engine: boom" in text


def test_budget_stops_rounds_the_slowest_would_overrun():
    def run_one(label, tree, rnd, links):
        time.sleep(0.3)
        return [{"kind": "prep", "label": label, "round": rnd}]
    trees = {"a": str(ROOT), "b": str(ROOT)}
    recs, done = S.run_rounds(trees, 3, os.devnull, run_one, budget_s=0.9)
    assert done == 1 and [(r["label"], r["round"]) for r in recs] == [("a", 1), ("b", 1)]
    recs, done = S.run_rounds(trees, 3, os.devnull, run_one, budget_s=30)
    assert done == 3 and len(recs) == 6


def run_driver(tmp_path, *extra, env=None):
    return subprocess.run([sys.executable, str(ROOT / "bench" / "runtime_ab.py"), "--out", str(tmp_path / "out"),
                           "--rounds", "1", *extra], env=env or dict(os.environ), capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_driver_on_fake_trees_without_cuda(tmp_path):
    a, b = fake_tree(tmp_path, "a"), fake_tree(tmp_path, "b")
    run = run_driver(tmp_path, "--tree", f"before={a}", "--tree", f"after={b}", "--metrics", "prep",
                     env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert run.returncode == 0, run.stderr[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "out" / "runtime_ab.jsonl").read_text().splitlines()]
    assert [(r["label"], r["kind"]) for r in recs] == [("before", "env"), ("before", "error"), ("before", "error"),
                                                       ("after", "env"), ("after", "error"), ("after", "error")]
    assert "no CUDA device" in recs[1]["error"] and "status 2" in recs[2]["error"]
    # three files (a lent machine hands back at most 8), the workers' stderr in one log, each headed
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["RUNTIME_AB.md", "runtime_ab.jsonl", "runtime_ab_workers.log"]
    log = (out / "runtime_ab_workers.log").read_text()
    assert log.startswith("== before round 1\n") and log.index("== after round 1\n") > 0
    assert recs[2]["error"].endswith(f"(see {out / 'runtime_ab_workers.log'})")
    assert all(f.startswith(str(a) + os.sep) for f in recs[0]["modules"].values())
    table = (tmp_path / "out" / "RUNTIME_AB.md").read_text()
    assert "| gqa | full_graph | 1 | error | error | error | error | - |" in table and table in run.stdout


def test_driver_cpu_smoke_on_this_checkout(tmp_path):
    run = run_driver(tmp_path, "--tree", f"here={ROOT}", "--cpu-smoke", "--metrics", "eagle", "--models", "gqa",
                     "--methods", "plain,eagle-high", "--eagle-bs", "1", "--eagle-runs", "1")
    assert run.returncode == 0, run.stderr[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "out" / "runtime_ab.jsonl").read_text().splitlines()]
    assert recs[0]["kind"] == "env" and recs[0]["modules"]["bench_eagle"] == str(ROOT / "bench" / "bench_eagle.py")
    eagle = {r["method"]: r for r in recs if r["kind"] == "eagle"}
    assert set(eagle) == {"plain", "eagle-high"} and len(recs) == 3, recs
    assert eagle["plain"]["mean_accept"] == 1.0 and eagle["eagle-high"]["mean_accept"] > 4
    assert all(r["tok_s"] > 0 for r in eagle.values())


@pytest.mark.cuda
def test_driver_times_both_metrics_on_the_gpu(tmp_path):
    run = run_driver(tmp_path, "--tree", f"here={ROOT}", "--models", "gqa", "--runners", "full_graph",
                     "--prep-bs", "1", "--prep-calls", "20", "--prep-reps", "1", "--methods", "plain",
                     "--eagle-bs", "1", "--eagle-runs", "1")
    assert run.returncode == 0, run.stderr[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "out" / "runtime_ab.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in recs] == ["env", "prep", "eagle"], recs
    assert 0 < recs[1]["host_us"] < 10_000 and recs[2]["tok_s"] > 0 and recs[2]["mean_accept"] == 1.0
