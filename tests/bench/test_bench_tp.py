"""bench/bench_tp.py's plumbing on the CPU: TP 1 and TP 2 (two gloo processes) on a tiny model, plain and
EAGLE, every rank's graph counts, TP 2's tokens equal to TP 1's (float32: the bench fails otherwise)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_tp_smoke(tmp_path):
    out = tmp_path / "tp.jsonl"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_tp.py"), "--tp", "2", "--device", "cpu",
                          "--smoke", "--models", "tiny-gqa", "--out", str(out)],
                         env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["spec"], r["tp"]) for r in rows] == [("plain", 1), ("plain", 2), ("eagle", 1), ("eagle", 2)]
    assert all(r["tok_s"] > 0 for r in rows)
    assert [r["requests_as_tp1"] for r in rows] == [None, 2, None, 2], "TP 2's tokens differ from TP 1's"
    two = [r for r in rows if r["tp"] == 2]
    assert all(len(r["counts"]) == 2 and r["counts"][0] == r["counts"][1] for r in two), "a rank's graphs differ"
    assert all(sum(g for g, _ in c.values()) > 0 for r in rows for c in r["counts"]), "no graph replayed"
