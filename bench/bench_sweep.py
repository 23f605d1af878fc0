"""pytest-benchmark form of the sweep's quick subset (GPU only; bench/conftest.py skips it
without CUDA): one item per (workload, bs 1/16/128, kv 8192). pytest-benchmark times our
eager call (with a synchronize); ``extra_info`` holds the sweep's measurements of ours and of
every FlashInfer configuration (graph / eager / host, check). Records go to env
``BENCH_SWEEP_RESULTS`` when set. The main entry is ``python bench/sweep/sweep.py --out DIR``
(parallel JIT prewarm, the table and the plot); this form compiles inline.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "sweep"))   # the sweep's modules, bench/sweep/
from sweep import Ctx, calibrate, environment, import_flashinfer, measure_row, parse_args  # noqa: E402
from sweep_flashinfer import new_workspace  # noqa: E402
from sweep_ours import Ours  # noqa: E402
from sweep_rows import build_group, build_row, matrix  # noqa: E402
from sweep_timing import Clock  # noqa: E402

QUICK = [(wl.name, wl, bs, kv) for _, bs, kv, wls in matrix(quick=True) for wl in wls]


@pytest.fixture(scope="module")
def ctx():
    fi, fi_error = import_flashinfer()
    env = environment(parse_args([]), "cuda", fi, fi_error)
    path = os.environ.get("BENCH_SWEEP_RESULTS", os.devnull)
    with open(path, "a") as out:
        c = Ctx("cuda", Clock("cuda"), env, out, fi, new_workspace("cuda") if fi else None)
        calibrate(c)
        yield c


@pytest.mark.parametrize("name,wl,bs,kv", QUICK, ids=[f"{n}-bs{b}-kv{k}" for n, _, b, k in QUICK])
def test_sweep_row(benchmark, ctx, name, wl, bs, kv):
    row = build_row(build_group(wl, bs, kv, "cuda"), wl)
    recs = measure_row(ctx, row)
    keys = ("status", "graph_us", "eager_us", "eager_gpu_us", "host_us", "check", "reason")
    benchmark.extra_info.update({r["impl"]: {k: r.get(k) for k in keys if r.get(k) is not None} for r in recs})
    fn = Ours(row).eager()
    benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), rounds=20, warmup_rounds=2)
    assert not [r["impl"] for r in recs if r.get("check") == "FAIL"], "output differs from ours"
