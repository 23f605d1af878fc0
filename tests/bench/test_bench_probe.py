"""bench/probes/probe_launch.py on the CPU: the injector hands its keywords to the backends' kernel
wrappers and overrides their split count only while active, and the probe runs end to end on a
smoke row (the interpreter), each variant's output checked against the backend's own."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "probes"


def test_injector_reaches_the_wrappers_and_restores_them(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import probe_launch as P

    from attn_backends.backends import triton_backend, triton_common
    seen = []
    monkeypatch.setattr(triton_backend, "extend_attention_fwd", lambda *a, **k: seen.append((a, k)))
    monkeypatch.setattr(triton_common, "choose_num_kv_splits", lambda *a, **k: 16)
    spy, choose = triton_backend.extend_attention_fwd, triton_common.choose_num_kv_splits
    inj = P.Injector()
    with inj.active():
        inj.kwargs, inj.splits = {"block_n": 32, "num_warps": 2}, "x0.25"
        triton_backend.extend_attention_fwd(1, block_n=64, mask="tree")
        assert triton_common.choose_num_kv_splits(8) == 4 and inj.last == 4
        inj.splits = 3
        assert triton_common.choose_num_kv_splits(8) == 3
        inj.splits = "x0.01"
        assert triton_common.choose_num_kv_splits(8) == 1          # at least one split
    assert seen == [((1,), {"block_n": 32, "mask": "tree", "num_warps": 2})]
    assert triton_backend.extend_attention_fwd is spy and triton_common.choose_num_kv_splits is choose


def test_probe_smoke(tmp_path):
    env = dict(os.environ, BENCH_DEVICE="cpu", TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = tmp_path / "probe.md"
    run = subprocess.run([sys.executable, str(BENCH / "probe_launch.py"), "gqa64_verify4", "--points", "2x40",
                          "--variant", "block_n=32,num_warps=2", "--variant", "no_such_keyword=1", "--splits", "1",
                          "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines()[2:]]
    assert [(r[3], r[4]) for r in rows] == [("(as is)", "2"), ("(as is)", "1 (1)"),
                                            ("{'block_n': 32, 'num_warps': 2}", "2"),
                                            ("{'block_n': 32, 'num_warps': 2}", "1 (1)")]
    assert all(float(r[10]) < 1e-2 for r in rows)                   # each output against variant 0's
    assert run.stdout.count("!! ") == 2 and "no_such_keyword" in run.stdout   # refused (both splits): left out
