"""Where the time of one decode step goes (GPU only): plain decode and one EAGLE step (high
acceptance, full graphs, bs 1) of ``bench_eagle``'s engines, phase by phase.

For each phase (EAGLE: the step's host setup, draft, verify, draft extend, the final sync and
bookkeeping) it prints the host time (perf_counter from the phase's start to its last launch
returning) and the GPU time between CUDA events recorded at the phase boundaries (which includes
any time the GPU waited for the host), medians over the steps of one generation; then a
torch.profiler summary of a few steps: kernels launched, their summed GPU time, host syncs and
the CUDA ops with the most GPU time. A step whose GPU time is close to its wall time is GPU
bound; one whose host time is, host bound.

    python bench/probes/profile_eagle.py [gqa|mla] [--bs N] [--cpu]
"""
import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # bench_eagle, in bench/
from bench_eagle import engine_config, generate_once  # noqa: E402

from attn_backends_runtime.eagle import EagleWorker  # noqa: E402
from attn_backends_runtime.engine import Engine  # noqa: E402
from attn_backends_runtime.models import TinyConfig  # noqa: E402

PHASES = {"eagle": ("_draft_tree", "_verify", "_draft_extend"), "plain": ()}


class _HostEvent:
    """A CUDA event's interface on the host clock (the ``--cpu`` smoke run)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1e3


class PhaseTimer:
    """Wraps methods of an object: at each call's start and end, a host time and a CUDA event."""

    def __init__(self) -> None:
        self.marks: list = []
        self.steps: list = []

    def mark(self, name: str) -> None:
        ev = torch.cuda.Event(enable_timing=True) if torch.cuda.is_available() else _HostEvent()
        ev.record()
        self.marks.append((name, time.perf_counter(), ev))

    def wrap(self, obj, name: str, step: bool = False) -> None:
        fn = getattr(obj, name)

        def wrapped(*a, **kw):
            if step:
                self.marks = []
            self.mark(f"{name}>")
            out = fn(*a, **kw)
            self.mark(f"{name}<")
            if step:
                self.steps.append(self.marks)
            return out
        setattr(obj, name, wrapped)

    def table(self) -> dict:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        host, gpu = defaultdict(list), defaultdict(list)
        for marks in self.steps:
            for (a, ta, ea), (b, tb, eb) in zip(marks, marks[1:]):
                host[f"{a}..{b}"].append((tb - ta) * 1e6)
                gpu[f"{a}..{b}"].append(ea.elapsed_time(eb) * 1e3)
            host["step"].append((marks[-1][1] - marks[0][1]) * 1e6)
            gpu["step"].append(marks[0][2].elapsed_time(marks[-1][2]) * 1e3)
        return {k: (statistics.median(host[k]), statistics.median(gpu[k])) for k in host}


def profile(which: str, method: str, bs: int, cpu: bool = False) -> None:
    kw = dict(device="cpu", tc=replace(TinyConfig(is_mla=which == "mla", page_size=16), num_layers=2),
              backend="torch_native", batch_sizes=(1, 4)) if cpu else {}
    e = Engine(engine_config(which, "plain" if method == "plain" else "eagle-high", "graphs", **kw))
    generate_once(e, bs, 64, 16, seed=0)
    t = PhaseTimer()
    if method == "plain":
        t.wrap(e, "_plain_decode", step=True)
    else:
        w: EagleWorker = e.worker
        t.wrap(w, "step", step=True)
        for name in PHASES["eagle"]:
            t.wrap(w, name)
    r = generate_once(e, bs, 64, 128, seed=1)
    print(f"\n{which} {method} bs {bs}: {r['tok_s']:.1f} tok/s, mean accept {r['mean_accept']:.2f}")
    print(f"{'phase':40s}{'host us':>10s}{'gpu us':>10s}")
    for k, (h, g) in t.table().items():
        print(f"{k:40s}{h:10.1f}{g:10.1f}")
    from torch.profiler import ProfilerActivity
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate_once(e, bs, 64, 24, seed=2)
    ev = prof.key_averages()
    kernels = [x for x in prof.events() if x.device_type == torch.autograd.DeviceType.CUDA]
    syncs = sum(x.count for x in ev if "Synchronize" in x.key or x.key in ("aten::item", "aten::_local_scalar_dense"))
    memcpy = sum(x.count for x in ev if x.key.startswith("cudaMemcpy"))
    print(f"profiled generation of 24 tokens ({bs} requests): {len(kernels)} GPU activities, summed GPU time "
          f"{sum(k.device_time for k in kernels) / 1e3:.2f} ms, host syncs {syncs}, cudaMemcpy calls {memcpy}")
    print(ev.table(sort_by="device_time_total", row_limit=12, max_name_column_width=50))
    print(ev.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    generate_once(e, bs, 64, 24, seed=3)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("which", nargs="?", default="gqa")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--cpu", action="store_true", help="the same code on the CPU at test sizes (smoke)")
    a = ap.parse_args()
    for m in ("plain", "eagle"):
        profile(a.which, m, a.bs, a.cpu)
