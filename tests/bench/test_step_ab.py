"""bench/step_ab.py's driver on the CPU: the table and its after/before ratio from fake records (an
errored worker shows as an error, not a number), each worker's PYTHONPATH (its own tree's links,
none of another checkout's), the rounds' alternating order, and the driver end to end over two fake
trees whose workers import only their own tree and stop at "no CUDA" (the timing needs a GPU)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("step_ab", ROOT / "bench" / "step_ab.py")
step_ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_ab)


def fake_tree(root, name, bench_src="def setup(model):\n    raise RuntimeError('fake tree')\n"):
    t = root / name
    for pkg in ("attn_backends", "kernels", "runtime"):
        (t / pkg).mkdir(parents=True)
        (t / pkg / "__init__.py").write_text(f"TREE = {name!r}\n")
    (t / "bench").mkdir()
    (t / "bench" / "bench_runtime.py").write_text(bench_src)
    (t / ".commit").write_text(f"c-{name}\n")
    return t


def step(label, rnd, impl, bs, us):
    return {"kind": "step", "label": label, "round": rnd, "model": "gqa", "impl": impl, "bs": bs,
            "median_us": us, "min_us": us - 1, "n": 60}


def rows_of(lines):
    return {tuple(c.strip() for c in ln.strip("|").split("|"))[:3]: [c.strip() for c in ln.strip("|").split("|")]
            for ln in lines[2:]}


def test_table_best_round_ratio_and_errors():
    recs = [step("before", 1, "full_graph", 1, 100.0), step("before", 1, "full_graph", 8, 200.0),
            step("before", 1, "eager", 1, 300.0), step("before", 1, "eager", 8, 400.0),
            step("before", 2, "full_graph", 1, 90.0), step("before", 2, "full_graph", 8, 210.0),
            step("before", 2, "eager", 1, 310.0), step("before", 2, "eager", 8, 390.0),
            # after, round 1: the graph rows timed, then the worker timed out; round 2: nothing at all
            step("after", 1, "full_graph", 1, 45.0), step("after", 1, "full_graph", 8, 150.0),
            {"kind": "error", "label": "after", "round": 1, "error": "worker timed out after 240 s"},
            {"kind": "error", "label": "after", "round": 2, "error": "worker exited with status 1"}]
    lines = step_ab.build_table(recs, ["before", "after"], 2, ["gqa"], ["full_graph", "eager"], [1, 8])
    assert lines[0].split("|")[1:-1] == [f" {h} " for h in (
        "model", "impl", "bs", "before r1", "before r2", "before best", "after r1", "after r2", "after best",
        "after/before")]
    rows = rows_of(lines)
    assert rows["gqa", "full_graph", "1"] == ["gqa", "full_graph", "1", "100.0", "90.0", "90.0",
                                              "45.0", "error", "45.0", "0.500"]
    assert rows["gqa", "full_graph", "8"][3:] == ["200.0", "210.0", "200.0", "150.0", "error", "150.0", "0.750"]
    assert rows["gqa", "eager", "1"][3:] == ["300.0", "310.0", "300.0", "error", "error", "error", "-"]
    args = SimpleNamespace(steps=60, rounds=2, models="gqa", impls="full_graph,eager", bs="1,8")
    recs.append({"kind": "env", "label": "before", "round": 1, "device": "NVIDIA H200", "torch": "2.11",
                 "triton": "3.6.0", "commit": "abc"})
    text = step_ab.report(recs, {"before": "/x/before", "after": "/x/after"}, args)
    assert "card: NVIDIA H200; torch 2.11; triton 3.6.0" in text and "before = /x/before @ abc" in text
    assert "- after round 1: worker timed out after 240 s" in text
    assert "- after round 2: worker exited with status 1" in text


def test_worker_pythonpath_takes_only_its_own_tree(tmp_path):
    a, b = fake_tree(tmp_path, "a"), fake_tree(tmp_path, "b")
    site = tmp_path / "site"
    (site / "flashinfer").mkdir(parents=True)
    b_links = step_ab.make_links(str(b), str(tmp_path / "b_links"))
    existing = os.pathsep.join([b_links, str(b), str(b / "bench"), str(site), ""])
    a_links = step_ab.make_links(str(a), str(tmp_path / "a_links"))
    path = step_ab.worker_pythonpath(str(a), a_links, existing).split(os.pathsep)
    assert path == [str(a), a_links, str(a / "bench"), str(site)]
    assert os.path.realpath(os.path.join(a_links, "attn_backends_kernels")) == str(a / "kernels")
    assert os.path.realpath(os.path.join(a_links, "attn_backends_runtime")) == str(a / "runtime")
    env = step_ab.worker_env(str(a), a_links, {"PYTHONPATH": existing, "TRITON_INTERPRET": "1", "HOME": "/h"})
    assert env["PYTHONPATH"] == os.pathsep.join(path) and "TRITON_INTERPRET" not in env and env["HOME"] == "/h"


def test_round_order_alternates():
    assert [step_ab.round_order(["before", "after"], r) for r in (1, 2, 3, 4)] == [
        ["before", "after"], ["after", "before"], ["before", "after"], ["after", "before"]]


def test_time_step_counts_warmup_and_syncs():
    calls, syncs = [], []
    med, low = step_ab.time_step(lambda: calls.append(1), 7, lambda: syncs.append(1))
    assert len(calls) == 5 + 7 and len(syncs) == 1 + 7 and 0 <= low <= med


def test_worker_timeout_is_an_error_record(tmp_path):
    t = fake_tree(tmp_path, "slow", bench_src="import time\ntime.sleep(60)\n")
    links = step_ab.make_links(str(t), str(tmp_path / "links"))
    args = SimpleNamespace(steps=3, impls="eager", models="gqa", bs="1", timeout=2.0)
    recs = step_ab.run_worker(args, "slow", str(t), 1, links, str(tmp_path / "w.log"))
    assert recs == [{"kind": "error", "label": "slow", "round": 1,
                     "error": f"worker timed out after 2 s (see {tmp_path / 'w.log'})"}]


def test_driver_end_to_end_without_gpu(tmp_path):
    a, b = fake_tree(tmp_path, "a"), fake_tree(tmp_path, "b")
    # the caller's path leads to the real checkout (its links and root): workers must not import it
    main_links = step_ab.make_links(str(ROOT), str(tmp_path / "main_links"))
    # CUDA hidden: the workers must stop at "no CUDA device" on a GPU machine too
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), main_links]), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "step_ab.py"), "--tree", f"before={a}",
                          "--tree", f"after={b}", "--rounds", "2", "--steps", "3", "--models", "gqa",
                          "--impls", "eager", "--bs", "1", "--out", str(tmp_path / "out")],
                         env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "out" / "step_ab.jsonl").read_text().splitlines()]
    envs = [r for r in recs if r["kind"] == "env"]
    assert [(r["label"], r["round"]) for r in envs] == [("before", 1), ("after", 1), ("after", 2), ("before", 2)]
    for r in envs:
        tree = str(a if r["label"] == "before" else b)
        assert r["commit"] == f"c-{Path(tree).name}"
        assert set(r["modules"]) == {"attn_backends", "attn_backends_kernels", "attn_backends_runtime",
                                     "bench_runtime"}
        assert all(f.startswith(tree + os.sep) for f in r["modules"].values()), r["modules"]
    errors = [r for r in recs if r["kind"] == "error"]
    assert len(errors) == 8 and all("no CUDA device" in r["error"] or "status 2" in r["error"] for r in errors)
    table = (tmp_path / "out" / "STEP_AB.md").read_text()
    assert "| gqa | eager | 1 | error | error | error | error | error | error | - |" in table
    assert table in run.stdout
