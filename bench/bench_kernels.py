"""Kernel microbenchmarks (GPU only): GQA decode / verify and MLA decode / verify.

Each case reports the do_bench median in microseconds, GB/s from explicit bytes (KV read
once + q + out) and the fraction of a device-to-device copy measured in the same session;
pytest-benchmark records host-timed rounds as well. Launch configurations come from the
JSON written by ``bench/tune.py`` (env ``BENCH_TUNED``) or ``workloads.DEFAULTS``.
Results are appended as JSON lines to env ``BENCH_RESULTS`` for ``bench/report.py``.
Where ``import flashinfer`` works, its wrappers run on the same data as peers.
"""

import json
import os

import pytest
import torch
import workloads as W

FACTORIES = {
    "gqa_decode": lambda: W.gqa(),
    "gqa_verify4": lambda: W.gqa(W=4),
    "gqa_verify8": lambda: W.gqa(W=8),
    "mla_decode": lambda: W.mla(),
    "mla_verify4": lambda: W.mla(W=4),
}


@pytest.fixture(scope="session")
def copy_gbs():
    gbs = W.copy_bandwidth_gbs()
    record({"kernel": "device_copy", "impl": "torch", "gbs": gbs, "frac_copy": 1.0,
            "device": torch.cuda.get_device_name()})
    return gbs


@pytest.fixture(scope="session")
def tuned():
    path = os.environ.get("BENCH_TUNED")
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def record(row):
    path = os.environ.get("BENCH_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def report(benchmark, name, impl, fn, nbytes, copy_gbs, cfg=None):
    us = W.median_us(fn)
    gbs = nbytes / us / 1e3
    benchmark.extra_info.update(us=us, gbs=gbs, frac_copy=gbs / copy_gbs)
    benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), rounds=20, warmup_rounds=2)
    record({"kernel": name, "impl": impl, "us": us, "gbs": gbs, "frac_copy": gbs / copy_gbs,
            "cfg": cfg})


@pytest.mark.parametrize("name", list(FACTORIES))
def test_triton(benchmark, name, copy_gbs, tuned):
    wl = FACTORIES[name]()
    cfg = tuned.get(name, W.DEFAULTS[name])
    report(benchmark, name, "triton", wl.fn(**cfg), wl.nbytes, copy_gbs, cfg)


def _flashinfer_fn(name, wl):
    """A FlashInfer call on the workload's data (set 0 and 1 rotating)."""
    flashinfer = pytest.importorskip("flashinfer")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    d0 = wl.sets[0]
    pt = d0["pt"]
    bs, pages = pt.shape
    ps = 16 if name.startswith("gqa") else 64
    kv_len = int(d0["lens"][0])
    indptr = torch.arange(0, bs * pages + 1, pages, dtype=torch.int32, device="cuda")
    last = torch.full((bs,), kv_len - (pages - 1) * ps, dtype=torch.int32, device="cuda")
    it = iter(range(1 << 62))
    if name.startswith("gqa"):
        H, D = d0["q"].shape[1:]
        Hkv = d0["k"].shape[1]
        W_ = d0["q"].shape[0] // bs
        if W_ == 1:
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
            w.plan(indptr, pt.flatten(), last, H, Hkv, D, ps, q_data_type=d0["q"].dtype,
                   kv_data_type=d0["k"].dtype)
        else:
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            w.plan(d0["cu"], indptr, pt.flatten(), last, H, Hkv, D, ps, causal=True,
                   q_data_type=d0["q"].dtype, kv_data_type=d0["k"].dtype)
        caches = [(d["k"].view(-1, ps, Hkv, D), d["v"].view(-1, ps, Hkv, D)) for d in wl.sets]

        def fn():
            i = next(it) % len(wl.sets)
            return w.run(wl.sets[i]["q"], caches[i])
        return fn
    from flashinfer.mla import BatchMLAPagedAttentionWrapper
    H = d0["q"].shape[1]
    W_ = d0["q"].shape[0] // bs
    w = BatchMLAPagedAttentionWrapper(ws, backend="fa3")
    qo_indptr = torch.arange(0, bs * W_ + 1, W_, dtype=torch.int32, device="cuda")
    w.plan(qo_indptr, indptr, pt.flatten(), d0["lens"], H, 512, 64, ps, W_ > 1, 576 ** -0.5,
           d0["q"].dtype, d0["kv"].dtype)
    split = [(d["q"][..., :512].contiguous(), d["q"][..., 512:].contiguous(),
              d["kv"].view(-1, ps, 576)[..., :512], d["kv"].view(-1, ps, 576)[..., 512:])
             for d in wl.sets]

    def fn():
        return w.run(*split[next(it) % len(split)])
    return fn


@pytest.mark.parametrize("name", list(FACTORIES))
def test_flashinfer(benchmark, name, copy_gbs):
    wl = FACTORIES[name]()
    try:
        fn = _flashinfer_fn(name, wl)
        fn()
    except pytest.skip.Exception:
        raise
    except Exception as e:  # report, do not hide, a peer that cannot run here
        record({"kernel": name, "impl": "flashinfer", "error": f"{type(e).__name__}: {e}"[:200]})
        pytest.skip(f"flashinfer failed: {e}")
    report(benchmark, name, "flashinfer", fn, wl.nbytes, copy_gbs)
