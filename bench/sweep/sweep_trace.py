"""Where a graph replay's time goes (``sweep.py --trace N``): each implementation's graph replayed ``N`` times
under the profiler, the L2 flushed before each replay as in the timed rounds, and per replay its kernels' device
times, ``busy`` (the union of its kernels' intervals), ``span`` (first kernel's start to last kernel's end) and
``gaps`` (span - busy: the device idle between the graph's kernels); medians over the replays. The timed
``graph_us`` minus ``span`` is what the graph costs outside its kernels (its head and tail latency)."""
from __future__ import annotations

import json
import os
import statistics
import tempfile


def _device_events(prof) -> list:
    """``[(start us, end us, name)]`` of every kernel and memset the profiler saw, by start."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    out = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
           if e.get("cat") in ("kernel", "gpu_memset") and "dur" in e]
    return sorted(out)


def _profiled(calls) -> list:
    import torch  # here: sweep_report imports this module without torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()        # nothing of the work before in the trace (its kernels could pass for the flush)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for call in calls:
            call()
        torch.cuda.synchronize()
    return _device_events(prof)


def _busy(events: list) -> float:
    total, end = 0.0, float("-inf")
    for s, e, _ in events:
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _short(name: str) -> str:
    """A kernel's name without its return type, namespaces, template and parameters."""
    words = name.replace("(anonymous namespace)", "").split("(")[0].split("<")[0].split()
    return (words[-1].split("::")[-1] if words else "")[:48] or "?"


def trace(replay, flush, n: int) -> dict:
    """``{"kernels": {name: median us a replay}, "busy_us", "span_us", "gaps_us", "replays"}`` of ``replay``
    (a graph's ``replay``), each of ``n`` replays after ``flush()`` (the L2 flush: its events, learnt from one
    call profiled alone, mark where each replay starts and are left out)."""
    flush_names = {name for _, _, name in _profiled([flush])}
    if not flush_names:
        raise RuntimeError("trace: the L2 flush launched nothing the profiler saw (no replay boundary)")
    events = _profiled([lambda: (flush(), replay()) for _ in range(n)])
    replays, cur = [], None
    for ev in events:
        if ev[2] in flush_names:
            cur = []
            replays.append(cur)
        elif cur is not None:
            cur.append(ev)
    replays = [r for r in replays if r]
    if len(replays) != n:
        raise RuntimeError(f"trace: {len(replays)} replays with kernels seen, {n} made")
    per_name: dict = {}
    for r in replays:
        sums: dict = {}
        for s, e, name in r:
            sums[_short(name)] = sums.get(_short(name), 0.0) + (e - s)
        for name, us in sums.items():
            per_name.setdefault(name, []).append(us)
    busy = [_busy(r) for r in replays]
    span = [max(e for _, e, _ in r) - r[0][0] for r in replays]      # the last to start may not end last
    med = statistics.median
    return {"kernels": {k: round(med(v), 2) for k, v in per_name.items()}, "busy_us": round(med(busy), 2),
            "span_us": round(med(span), 2), "gaps_us": round(med(s - b for s, b in zip(span, busy)), 2),
            "replays": n}


def line(impl: str, rec: dict, t: dict) -> str:
    """One printed line: the implementation, its timed graph us, span, busy, gaps, outside and kernels."""
    g = rec.get("graph_us")
    outside = f"{g - t['span_us']:.1f}" if g else "-"
    return (f"trace {impl}: graph {g if g is None else round(g, 1)} us = span {t['span_us']:.1f} (busy "
            f"{t['busy_us']:.1f} + gaps {t['gaps_us']:.1f}) + outside {outside}; {_kernels(t)}")


def _kernels(t: dict) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in t["kernels"].items())


def table(grouped: dict, best) -> list:
    """SWEEP.md's table of the traced rows (``sweep_report.group``'s ``grouped``): ours and FlashInfer's fastest
    graph (``best(recs, "graph_us")``), each with its timed graph, span, busy time, gaps, the rest (outside its
    kernels) and its kernels."""
    lines = ["| dist | workload | bs | kv | impl | graph | span | busy | gaps | outside | kernels |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for (dist, wl, bs, kv), recs in grouped.items():
        fastest = best(recs, "graph_us")
        for rec in (recs.get("ours"), fastest):
            if not rec or "trace" not in rec:
                continue
            t, g = rec["trace"], rec.get("graph_us")
            graph, outside = (f"{g:.1f}", f"{g - t['span_us']:.1f}") if g else ("-", "-")
            lines.append(f"| {dist} | {wl} | {bs} | {kv} | {rec['impl']} | {graph} | {t['span_us']:.1f} | "
                         f"{t['busy_us']:.1f} | {t['gaps_us']:.1f} | {outside} | {_kernels(t)} |")
    return lines
