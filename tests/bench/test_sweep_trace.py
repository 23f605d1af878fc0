"""``sweep.py --trace`` (bench/sweep/sweep_trace.py) on the CPU with a fake profiler: replays split at the L2
flush's events, each replay's kernels, busy time (overlapping kernels counted once), span and gaps, medians
over the replays; a miscount raises; ``trace_graphs`` keeps the trace, or its error, in the record."""
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "sweep"


def _fake(monkeypatch, replays: list, flush=("fill_kernel",)):
    """``sweep_trace._profiled`` running the calls it is handed and giving the events of what they ran: each call of
    the returned ``flush_fn`` the ``flush`` kernels (5 us), each call of ``replay_fn`` the next replay's kernels
    ``(start, end, name)`` relative to the last flush's end; replays 1000 us apart. Returns ``(sweep_trace, calls,
    flush_fn, replay_fn, ran)``: ``calls`` the count of calls each profile was handed, ``ran`` what the last one ran."""
    monkeypatch.syspath_prepend(str(BENCH))
    import sweep_trace

    calls, ran = [], []
    flush_fn, replay_fn = (lambda: ran.append("flush")), (lambda: ran.append("replay"))

    def profiled(fns):
        calls.append(len(fns))
        ran.clear()
        for fn in fns:
            fn()
        events, base, after_flush, done = [], 0.0, 0.0, 0
        for what in ran:
            if what == "flush":
                events += [(base, base + 5.0, name) for name in flush]
                after_flush = base + 5.0
            else:
                events += [(after_flush + s, after_flush + e, name) for s, e, name in replays[done]]
                done += 1
            base += 1000.0 if what == "replay" else 0.0
        return sorted(events)

    monkeypatch.setattr(sweep_trace, "_profiled", profiled)
    return sweep_trace, calls, flush_fn, replay_fn, ran


def test_a_replay_is_its_kernels_busy_span_and_gaps(monkeypatch):
    a = [(2.0, 12.0, "void chunk_pass<64>(int)"), (15.0, 20.0, "merge_pass(float*)")]       # gap 3
    b = [(2.0, 14.0, "void chunk_pass<64>(int)"), (13.0, 19.0, "merge_pass(float*)")]       # overlap 1
    c = [(2.0, 11.0, "void chunk_pass<64>(int)"), (16.0, 22.0, "merge_pass(float*)")]       # gap 5
    sweep_trace, calls, flush, replay, _ = _fake(monkeypatch, [a, b, c])
    t = sweep_trace.trace(replay, flush, 3)
    assert calls == [1, 3]
    assert t["kernels"] == {"chunk_pass": 10.0, "merge_pass": 6.0}
    assert t["busy_us"] == 15.0                # 15, 17 (12 + 6 - 1 overlapping), 15
    assert t["span_us"] == 18.0                # 18, 17, 20
    assert t["gaps_us"] == 3.0                 # 3, 0, 5
    line = sweep_trace.line("ours", {"graph_us": 25.0}, t)
    assert "span 18.0" in line and "outside 7.0" in line and "chunk_pass 10.0" in line


def test_each_replay_follows_its_flush(monkeypatch):
    """Each replay runs right after an L2 flush, as in the timed rounds (the replays are split at the flushes)."""
    sweep_trace, _, flush, replay, ran = _fake(monkeypatch, [[(1.0, 2.0, "k")], [(1.0, 3.0, "k")], [(1.0, 4.0, "k")]])
    assert sweep_trace.trace(replay, flush, 3)["kernels"] == {"k": 2.0}
    assert ran == ["flush", "replay"] * 3


def test_a_replay_count_that_does_not_match_raises(monkeypatch):
    sweep_trace, _, flush, replay, _ = _fake(monkeypatch, [[(1.0, 2.0, "k")], []])    # the second launched nothing
    with pytest.raises(RuntimeError, match="1 replays with kernels seen, 2 made"):
        sweep_trace.trace(replay, flush, 2)
    sweep_trace, _, flush, replay, _ = _fake(monkeypatch, [], flush=())
    with pytest.raises(RuntimeError, match="no replay boundary"):
        sweep_trace.trace(replay, flush, 2)


def test_trace_graphs_keeps_the_trace_or_its_error_in_the_record(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import sweep

    def fake_trace(replay, flush, n):
        replay()
        return {"kernels": {"k": 1.0}, "busy_us": 1.0, "span_us": 1.0, "gaps_us": 0.0, "replays": n}

    def broken():
        raise RuntimeError("replay failed")

    monkeypatch.setattr(sweep.sweep_trace, "trace", fake_trace)
    monkeypatch.setattr(sweep, "_drain", lambda: None)
    ctx = SimpleNamespace(trace=4, clock=SimpleNamespace(flush=lambda: None))
    recs = [dict(impl="ours", graph_us=2.0), dict(impl="fa3"), dict(impl="fa2")]
    graphs = {"ours": (SimpleNamespace(replay=lambda: None), None), "fa3": (SimpleNamespace(replay=broken), None)}
    sweep.trace_graphs(ctx, recs, graphs)
    assert recs[0]["trace"]["replays"] == 4
    assert "replay failed" in recs[1]["trace_error"] and "trace" not in recs[1]
    assert "trace" not in recs[2] and "trace_error" not in recs[2]
    ctx.trace = 0
    recs = [dict(impl="ours")]
    sweep.trace_graphs(ctx, recs, graphs)
    assert recs == [dict(impl="ours")]


def test_the_report_tables_ours_and_flashinfers_fastest_traced_graph(monkeypatch):
    """SWEEP.md's trace table (``sweep_trace.table`` over ``sweep_report``'s grouping): per row ours and FlashInfer's
    fastest graph (not a slower configuration), the timed graph minus the span as "outside"; rows without a trace
    are left out."""
    monkeypatch.syspath_prepend(str(BENCH))
    import sweep_report
    import sweep_trace

    def rec(impl, graph, span, dist="uniform"):
        r = dict(type="result", impl=impl, workload="mla16_decode", bs=24, kv=16384, dist=dist, status="ok",
                 graph_us=graph)
        if span is not None:
            r["trace"] = {"kernels": {"k": span - 1.0}, "busy_us": span - 1.0, "span_us": span, "gaps_us": 1.0}
        return r

    results = [rec("ours", 70.0, 66.0), rec("fi_mla_fa3", 64.0, 61.0), rec("fi_mla_fa2", 90.0, 87.0),
               rec("ours", 40.0, None, "ragged"), rec("fi_mla_fa3", 45.0, None, "ragged")]
    rows = sweep_trace.table(sweep_report.group(results), sweep_report.best)[2:]
    assert rows == ["| uniform | mla16_decode | 24 | 16384 | ours | 70.0 | 66.0 | 65.0 | 1.0 | 4.0 | k 65.0 |",
                    "| uniform | mla16_decode | 24 | 16384 | fi_mla_fa3 | 64.0 | 61.0 | 60.0 | 1.0 | 3.0 | k 60.0 |"]


def test_kernel_names_and_the_profilers_events(monkeypatch, tmp_path):
    """A kernel's short name drops its return type, namespaces (anonymous ones too), template and parameters;
    ``_device_events`` keeps the trace's kernels and memsets (not its host events), by start."""
    monkeypatch.syspath_prepend(str(BENCH))
    import json

    import sweep_trace

    assert sweep_trace._short("void at::native::(anonymous namespace)::CatArrayBatchedCopy<int, 4>(int*)") == \
        "CatArrayBatchedCopy"
    assert sweep_trace._short("void flashinfer::BatchPrefillWithPagedKVCacheKernel<K>(P)") == \
        "BatchPrefillWithPagedKVCacheKernel"
    assert sweep_trace._short("_merge_chunk_pass_kernel") == "_merge_chunk_pass_kernel"
    assert sweep_trace._short("Memset (Device)") == "Memset"
    assert sweep_trace._short("(unnamed)") == "?"

    class _Prof:
        def export_chrome_trace(self, path):
            json.dump({"traceEvents": [
                {"cat": "kernel", "name": "b", "ts": 20.0, "dur": 5.0},
                {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1.0, "dur": 3.0},
                {"cat": "gpu_memset", "name": "Memset (Device)", "ts": 10.0, "dur": 2.0},
                {"cat": "kernel", "name": "a", "ts": 15.0, "dur": 1.0},
                {"cat": "kernel", "name": "instant"}]}, open(path, "w"))

    assert sweep_trace._device_events(_Prof()) == [(10.0, 12.0, "Memset (Device)"), (15.0, 16.0, "a"),
                                                   (20.0, 25.0, "b")]
