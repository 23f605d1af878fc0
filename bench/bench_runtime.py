"""Decode-step latency of the tiny models (GPU only): eager vs full graph vs piecewise vs
breakable, bs 1, 8 and 64, with the ``triton`` / ``triton_mla`` backends, at
``TinyConfig.gpu_gqa()`` / ``gpu_mla()`` sizes; and the host time of one replay preparation
(``runner.prepare``: the batch's real rows into the step, one step update, every layer's
backend refreshed; one backend instance for all layers and one per layer) under
``torch.cuda.set_sync_debug_mode("error")``.

One step = ``runner.run(batch)`` (inputs copied in, metadata, replay, outputs sliced and
cloned) or, for eager, ``run_eager`` (eager metadata + the model forward). "piecewise" runs
the decode step as an EXTEND of one token per request on the piecewise runner (dense pieces
as graphs, attention eager). Times are do_bench medians; GB/s counts the weights and the KV
read once. Rows go to ``$BENCH_RESULTS`` in bench_kernels' format; ``python
bench/bench_runtime.py $BENCH_RESULTS`` prints the table and the targets.
"""
import json
import random
import statistics
import sys
import time

import pytest
import torch

from attn_backends import ForwardBatch, ForwardMode, get_backend
from attn_backends.check.scenarios import make_memory
from attn_backends_runtime.breakable import BreakableGraphRunner
from attn_backends_runtime.full_graph import UniformGraphRunner
from attn_backends_runtime.models import TinyConfig, TinyModel
from attn_backends_runtime.piecewise import PiecewiseRunner
from attn_backends_runtime.runner_base import run_eager

BATCH_SIZES = (1, 8, 64)
IMPLS = ("eager", "full_graph", "piecewise", "breakable")
PREP_ROUNDS = 8           # rounds of the replay-preparation timing (see its test)
PREP_PAUSE_S = 1.0        # and the pause after each round
CONTEXT = 1024             # KV tokens per request before the step
MAX_CTX = 2048


class Setup:
    """One model on the GPU, a KV memory with shuffled pages, one backend instance for all
    layers, every runner captured for buckets 1, 8, 64, and one decode batch per bs."""

    def __init__(self, which: str) -> None:
        self.tc = TinyConfig.gpu_mla() if which == "mla" else TinyConfig.gpu_gqa()
        self.model = TinyModel(self.tc, "cuda")
        cfg = self.tc.attention()
        ps = self.tc.page_size
        self.mem = make_memory(cfg, num_pages=(max(BATCH_SIZES) + 2) * MAX_CTX // ps + 2, max_reqs=max(BATCH_SIZES) + 2,
                               max_context_len=MAX_CTX, seed=0, device="cuda", fill=False)
        self.backend = get_backend("triton_mla" if self.tc.is_mla else "triton", cfg, self.mem)
        self.eager_backend = get_backend("triton_mla" if self.tc.is_mla else "triton", cfg, self.mem)
        rng = random.Random(0)
        rows = [self.mem.new_request() for _ in range(max(BATCH_SIZES))]
        self.prefix = [CONTEXT - rng.randint(0, 64) for _ in rows]
        for r, p in zip(rows, self.prefix):
            self.mem.extend(r, p)
        self.loc = torch.stack([self.mem.extend(r, 1) for r in rows]).view(-1)
        self.rows = rows
        self.runners = {
            "full_graph": UniformGraphRunner(self.model, self.backend, self.mem, ForwardMode.DECODE, BATCH_SIZES),
            "breakable": BreakableGraphRunner(self.model, self.backend, self.mem, ForwardMode.DECODE, BATCH_SIZES),
            "piecewise": PiecewiseRunner(self.model, self.backend, self.mem, BATCH_SIZES),
            # one backend instance per layer: the step still builds the layout once
            "full_graph_per_layer": UniformGraphRunner(
                self.model, [get_backend(self.backend.name, cfg, self.mem) for _ in range(self.tc.num_layers)],
                self.mem, ForwardMode.DECODE, BATCH_SIZES),
        }
        for r in self.runners.values():
            r.capture()

    def batch(self, bs: int, extend: bool = False) -> ForwardBatch:
        d = "cuda"
        seq = torch.tensor([p + 1 for p in self.prefix[:bs]], dtype=torch.int32)
        ids = torch.randint(0, self.tc.vocab_size, (bs,), generator=torch.Generator().manual_seed(bs)).to(d)
        ones = torch.ones(bs, dtype=torch.int32)
        return ForwardBatch(ForwardMode.EXTEND if extend else ForwardMode.DECODE, bs,
                            torch.tensor(self.rows[:bs], dtype=torch.int32, device=d), seq.to(d), seq,
                            self.loc[:bs].clone(), torch.tensor(self.prefix[:bs], device=d),
                            extend_seq_lens=ones.to(d) if extend else None,
                            extend_seq_lens_cpu=ones if extend else None,
                            input_ids=ids)

    def step(self, impl: str, bs: int):
        if impl == "eager":
            b = self.batch(bs)
            return lambda: run_eager(self.model, self.eager_backend, b, 1)
        b = self.batch(bs, extend=impl == "piecewise")
        r = self.runners[impl]
        return lambda: r.run(b)

    def bytes_per_step(self, bs: int) -> int:
        w = sum(p.numel() * p.element_size() for p in self.model.parameters())
        c = self.tc
        row = (c.kv_lora_rank + c.qk_rope_head_dim) if c.is_mla else 2 * c.num_kv_heads * c.head_dim
        kv = sum(p + 1 for p in self.prefix[:bs]) * row * c.num_layers * torch.finfo(c.dtype).bits // 8
        return w + kv


_SETUPS: dict = {}


def setup(which: str) -> Setup:
    if which not in _SETUPS:
        _SETUPS[which] = Setup(which)
    return _SETUPS[which]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bs", BATCH_SIZES)
@pytest.mark.parametrize("which", ["gqa", "mla"])
def test_decode_step(benchmark, copy_gbs, which, bs, impl):
    import workloads as W
    s = setup(which)
    fn = s.step(impl, bs)
    fn()
    torch.cuda.synchronize()
    us = W.median_us(fn)
    gbs = s.bytes_per_step(bs) / us / 1e3
    benchmark.extra_info.update(us=us)
    benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), rounds=10, warmup_rounds=2)
    record({"kernel": f"step_{which}_bs{bs}", "impl": impl, "us": us, "gbs": gbs, "frac_copy": gbs / copy_gbs,
            "cfg": f"{which} {s.tc.num_layers} layers, ctx ~{CONTEXT}, page {s.tc.page_size}"})


def host_times(fn, n=500, prologue=None, rounds=3) -> float:
    """Host microseconds of ``fn`` under CUDA's sync debug mode (a host sync raises): the least
    of ``rounds`` medians of ``n`` calls each, so that a round slowed as a whole by the machine's
    other work (seen on the lent VMs: a whole 500-call median 30-100% above its neighbours)
    does not count. The GPU is drained every 20 calls, outside the timed span, so that a full
    launch queue never throttles the host (host time, not GPU time, is what this measures)."""
    return min(_host_median(fn, n, prologue) for _ in range(rounds))


def _host_median(fn, n, prologue) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    host = []
    for i in range(n):
        if prologue is not None:
            prologue()
        if i % 20 == 0:
            torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.set_sync_debug_mode("default")
    return statistics.median(host)


def test_replay_preparation_host_time(benchmark):
    """``runner.prepare(batch)``: the whole step's replay preparation (the batch's real rows
    into the step, one step update, every backend's replay update): median host time, no sync;
    and the metadata part alone (step update + backends). The points (model x runner x bs)
    are timed in turn, ``PREP_ROUNDS`` rounds of a 300-call median each with a pause between
    rounds, and a point keeps its least round: a slow spell of the lent machine (seen lasting
    seconds, the Python part 1.5-1.8x slower while a bare launch kept its time) then falls on
    some rounds of every point instead of on every round of one point. Every round is recorded;
    the note of a run gives the rounds, not the least alone."""
    import triton
    points = [(which, runner, bs) for which in ("gqa", "mla") for bs in BATCH_SIZES
              for runner in ("full_graph", "full_graph_per_layer")]
    calls = {}
    for which, runner, bs in points:
        r, b = setup(which).runners[runner], setup(which).batch(bs)
        key, _, raw = r._load(b)
        calls[which, runner, bs] = (lambda r=r, b=b: r.prepare(b), lambda r=r, k=key, n=raw: r._prepare_replay(k, n))
    rounds = {p: ([], []) for p in points}
    for _ in range(PREP_ROUNDS):
        for p in points:
            for fn, got in zip(calls[p], rounds[p]):
                got.append(host_times(fn, 300, rounds=1))
        time.sleep(PREP_PAUSE_S)
    for which, runner, bs in points:
        prep, meta = rounds[which, runner, bs]
        dev_us = triton.testing.do_bench(calls[which, runner, bs][0], warmup=10, rep=40, return_mode="median") * 1e3
        record({"kernel": f"runner_prep_{which}_bs{bs}", "impl": runner, "host_us": min(prep), "device_us": dev_us,
                "metadata_host_us": min(meta), "host_us_rounds": [round(x, 1) for x in prep],
                "layers": setup(which).tc.num_layers})
    fn = calls["gqa", "full_graph", 1][0]
    benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), rounds=10, warmup_rounds=2)


@pytest.mark.parametrize("runner", ["full_graph", "full_graph_per_layer"])
@pytest.mark.parametrize("which", ["gqa", "mla"])
def test_replay_preparation_breakdown(benchmark, which, runner):
    """Where the host time of ``runner.prepare`` goes (bs 8)."""
    s = setup(which)
    r = s.runners[runner]
    b = s.batch(8)
    key, _, raw = r._load(b)
    p = r.step
    gi = p.graph_inputs(key, p.update(key, raw))
    x32, y32 = torch.zeros(64, dtype=torch.int32, device="cuda"), torch.ones(64, dtype=torch.int32, device="cuda")
    parts = {
        "prepare": lambda: r.prepare(b),
        "refusal": lambda: r.refusal(b),
        "load_rows": lambda: r._load(b),
        # with the prep in the step's graph (no backend does replay work) the update only checks
        "step_update": lambda: p.update(key, 8),
        "step_graph_replay": lambda: r.graphs[key][0].replay(),
        "backends_refresh": lambda: [be.init_forward_metadata_replay_cuda_graph(gi) for be in r.backends],
        "one_copy": lambda: x32.copy_(y32),
        "one_fill": lambda: x32.fill_(3),
        "foreach_copy_4": lambda: torch._foreach_copy_([x32, x32, x32, x32], [y32, y32, y32, y32]),
    }
    out = {}
    for name, fn in parts.items():
        pro = (lambda: r._load(b)) if name == "step_update" else None
        out[name] = host_times(fn, 300, prologue=pro)
        record({"kernel": f"prep_part_{name}", "impl": f"{which}_bs8_{runner}", "host_us": out[name]})
    benchmark.extra_info.update(out)
    benchmark.pedantic(lambda: None, rounds=1)


def summarize(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    steps = {(r["kernel"], r["impl"]): r["us"] for r in rows if r["kernel"].startswith("step_") and "us" in r}
    print(f"{'decode step (us)':18s}" + "".join(f"{i:>12s}" for i in IMPLS) + f"{'eager/graph':>13s}")
    for which in ("gqa", "mla"):
        for bs in BATCH_SIZES:
            k = f"step_{which}_bs{bs}"
            cells = [steps.get((k, i)) for i in IMPLS]
            ratio = cells[0] / cells[1] if cells[0] and cells[1] else None
            print(f"{which + ' bs ' + str(bs):18s}" + "".join(f"{c:12.1f}" if c else f"{'-':>12s}" for c in cells)
                  + (f"{ratio:12.2f}x" if ratio else ""))
    parts = [r for r in rows if r["kernel"].startswith("prep_part_")]
    for impl in dict.fromkeys(r["impl"] for r in parts):
        print(f"host time of the parts of one replay preparation ({impl}): " + ", ".join(
            f"{r['kernel'][10:]} {r['host_us']:.1f} us" for r in parts if r["impl"] == impl))
    for r in rows:
        if r["kernel"].startswith("runner_prep_"):
            ok = "PASS" if r["host_us"] < 30 else "MISS"
            meta = r.get("metadata_host_us")
            mok = "" if meta is None else f"; metadata alone {meta:.1f} us ({'PASS' if meta < 30 else 'MISS'})"
            spread = "" if "host_us_rounds" not in r else f" (rounds {'/'.join(map(str, r['host_us_rounds']))})"
            print(f"{r['kernel']:22s} {r['impl']:21s} host {r['host_us']:6.1f} us{spread} (target < 30: {ok}){mok}, "
                  f"device {r['device_us']:.1f} us, no sync")
    e, g = steps.get(("step_gqa_bs1", "eager")), steps.get(("step_gqa_bs1", "full_graph"))
    if e and g:
        verdict = "PASS" if e / g >= 3 else "MISS"
        print(f"full-graph GQA decode bs 1: {e / g:.2f}x faster than eager (target >= 3x: {verdict})")


def record(row):
    from bench_kernels import record as _record
    _record(row)


try:  # the session fixture measuring copy bandwidth, shared with bench_kernels
    from bench_kernels import copy_gbs  # noqa: F401,E402
except Exception:  # noqa: BLE001 - without CUDA the module is only collected (and skipped)
    pass


if __name__ == "__main__":
    summarize(sys.argv[1])
