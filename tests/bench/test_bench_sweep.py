"""The sweep (bench/sweep/sweep.py) on the CPU: its smoke path end to end (our kernels in
the interpreter, every FlashInfer configuration's arguments checked by emulation, the
report built from the JSON), and, where ``import flashinfer`` works (it imports without a
GPU), every FlashInfer call the sweep makes bound to the installed wheel's signatures."""
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "sweep"


def test_smoke_sweep_and_report(tmp_path):
    env = dict(os.environ, BENCH_DEVICE="cpu", TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(BENCH / "sweep.py"), "--smoke", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    header, footer, results = lines[0], lines[-1], lines[1:-1]
    assert header["type"] == "header" and header["smoke"] and footer["type"] == "footer"
    assert "timing" not in header and "host_timing" not in header, "the smoke run times nothing in rounds"
    assert footer["mismatches"] == [] and footer["errors"] == []
    ours = [r for r in results if r["impl"] == "ours"]
    assert all(r["status"] == "ok" and r["eager_us"] > 0 for r in ours)
    assert len([r for r in ours if r["dist"] == "uniform"]) == 10
    assert {r["dist"] for r in ours} == {"uniform", "ragged", "longtail", "bimodal"}, "a distribution not run"
    for r in ours:   # bytes over the sum of the lengths, kv their mean; lengths / 128, at least W = 8
        assert r["kv_sum"] == sum(r.get("lens", [r["kv"]] * r["bs"])) and r["kv_min"] >= 8
        per_token = r["qk_dim"] * 2 if r["family"] == "mla" else r["kv_heads"] * (r["qk_dim"] + r["v_dim"]) * 2
        kv_bytes = r["kv_sum"] * per_token
        assert r["bytes"] == kv_bytes + r["bs"] * r["width"] * r["heads"] * (r["qk_dim"] + r["v_dim"]) * 2
        if r["dist"] != "uniform":
            assert len(r["lens"]) == r["bs"] and r["kv"] == round(sum(r["lens"]) / r["bs"])
            assert r["kv_min"] < r["kv_max"], "a non-uniform smoke row of equal lengths"
    peers = [r for r in results if r["impl"].startswith("fi_")]
    emulated = [r for r in peers if r["status"] == "emulated"]
    # every workload has at least one FlashInfer configuration, each agreeing with ours
    assert {r["workload"] for r in emulated} == {r["workload"] for r in ours}
    assert all(r["check"] == "pass" for r in emulated)
    assert all(r["reason"] for r in peers if r["status"] == "skipped")
    report = subprocess.run([sys.executable, str(BENCH / "sweep_report.py"), str(tmp_path / "sweep.jsonl"),
                             "--out-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr[-2000:]
    table = (tmp_path / "SWEEP.md").read_text()
    assert "| dist | workload | bs | kv |" in table and "SMOKE DATA" in table
    assert all(f"| {r['dist']} | {r['workload']} | {r['bs']} | {r['kv']}" in table for r in ours)
    rows = [line.split(" | ")[0].strip("| ") for line in table.split("## Rows")[1].split("## Targets")[0].splitlines()
            if line.startswith(("| uniform", "| ragged", "| longtail", "| bimodal"))]
    assert rows == sorted(rows, key=["uniform", "ragged", "longtail", "bimodal"].index), "rows not grouped by dist"


def _calls():
    """Every (config, workload) call of the sweep at the smoke shape, eager and graph form."""
    sys.path.insert(0, str(BENCH))
    import sweep_flashinfer as F
    from sweep_matrix import points
    from sweep_ours import Ours
    from sweep_rows import build_group, build_row
    for pt in points(smoke=True):             # every distribution: ragged page tables and masks too
        wls = pt.wls
        group = build_group(wls[0], pt.bs, pt.kv, "cpu", lens=list(pt.lens), dist=pt.dist)
        for wl in wls:
            row = build_row(group, wl)
            inp = F.fi_inputs(row, Ours(row).layout())
            for config in F.candidates(wl):
                if F.refusal(config, wl, 90) is None:
                    call = F.call_spec(config, inp)
                    yield config, wl, call, F.graph_call(call, inp)


def _host_checks(call, graph: bool) -> None:
    """FlashInfer's own host-side validation of the values (pure PyTorch, runs on the CPU)."""
    import torch
    if call.kind == "mla":
        from flashinfer.mla._batch_mla._backends._fa_common import _BatchMLAGeneratedFaMechanics
        from flashinfer.mla._batch_mla._contracts import _resolve_structural_mla_input
        from flashinfer.mla._batch_mla._planning import _validate_csr_metadata
        kw, cpu = call.plan_kwargs, torch.device("cpu")
        csr = _validate_csr_metadata(**dict(zip(("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"),
                                                kw["metadata"])), page_size=kw["page_size"], device=cpu)
        widths = (kw["head_dim_ckv"], kw["head_dim_kpe"])
        q_nope, _ = _resolve_structural_mla_input(call.run_kwargs["query"], desired="split", widths=widths,
                                                  name="query", accepted="packed")
        _resolve_structural_mla_input(call.run_kwargs["kv_cache"], desired="split", widths=widths,
                                      name="KV cache", accepted="packed")
        assert call.run_kwargs["out"].shape == q_nope.shape
        if graph:
            c = call.ctor
            named = tuple((name, c[name], getattr(csr, name), name == "kv_indices")
                          for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"))
            _BatchMLAGeneratedFaMechanics._validate_graph_metadata_buffers(cpu, named)
        return
    from flashinfer.prefill import _compute_page_mask_indptr
    q, (k, v) = call.run_args
    assert call.run_kwargs["out"].shape == q.shape[:-1] + (v.shape[-1],)
    assert k.shape[1] == call.plan_args[-1] and k.stride() == v.stride()    # NHD pages, one stride
    if call.kind == "prefill" and "custom_mask" in call.plan_kwargs:
        qo, indptr, _, last = call.plan_args[:4]
        bits = _compute_page_mask_indptr(qo, indptr, last, call.plan_args[-1])
        assert int(bits[-1]) == call.plan_kwargs["custom_mask"].numel()


def test_flashinfer_calls_bind_to_the_wheel():
    fi = pytest.importorskip("flashinfer")
    import torch
    ws = torch.zeros(16, dtype=torch.uint8)
    n = 0
    for config, wl, *calls in _calls():
        for call in calls:
            cls = getattr(fi.mla if call.kind == "mla" else fi, call.wrapper)
            inspect.signature(cls.__init__).bind(None, ws, **call.ctor)
            plan_kw = dict(call.plan_kwargs)
            if "metadata" in plan_kw:
                plan_kw["metadata"] = fi.mla.MLAPlanMetadata.csr(*plan_kw["metadata"])
            # the decode wrapper's plan() takes **kwargs and hands them to _plan_impl
            plan = cls._plan_impl if call.kind == "decode" else cls.plan
            inspect.signature(plan).bind(None, *call.plan_args, **plan_kw)
            inspect.signature(cls.run).bind(None, *call.run_args, **call.run_kwargs)
            _host_checks(call, graph=call is calls[1])
            n += 1
    assert n > 0


def _interleave_fakes(sweep_timing, order: list, released: list, refs: list) -> tuple:
    """``(clock, Peer, Graph)`` for ``interleaved_times``: a clock whose timers each give their own
    range of values (graph 1xx, host 2xx, eager 3xx), a FlashInfer peer that records its calls and
    whether every graph in ``refs`` (weak references) is gone by then, and a graph that records its
    replays ("broken" ones raise)."""

    class _Clock(sweep_timing.Clock):
        n = 0

        def _tick(self, fn, base: int) -> float:
            fn()
            self.n += 1
            return base + self.n

        def gpu_us(self, fn):
            return self._tick(fn, 100)

        def host_us(self, fn):
            return self._tick(fn, 200)

        def eager_us(self, fn):
            return self._tick(fn, 300)

    class _Peer:
        def __init__(self, fi, config, inp, ws) -> None:
            if config == "broken":
                raise RuntimeError("plan refused")
            self.config = config

        def fn(self):
            return lambda: (order.append(self.config), released.append(all(r() is None for r in refs)))

    class _Graph:
        def __init__(self, name) -> None:
            self.name = name

        def replay(self):
            if self.name == "broken":
                raise RuntimeError("replay failed")
            order.append("graph " + self.name)

    return _Clock("cpu"), _Peer, _Graph


def test_graph_host_and_eager_times_interleave_rounds_and_a_failure_keeps_the_row(monkeypatch):
    """Every round times ours and each FlashInfer configuration that ran, in turn, each round
    starting one later: graph replays first (on the GPU clock; the graphs captured before the
    rounds, released before the host rounds), then host time (a peer planned anew each round),
    then eager time; each keeps its least round (a time already on a record is never kept), and
    the rates follow the graph time kept; one that fails gets ``*_error``, is timed no further in
    those rounds, gets no time of a kind none of whose rounds ran, and the row's other records
    keep their times."""
    import weakref
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(BENCH))
    import sweep
    import sweep_timing

    order, released, refs = [], [], []
    clock, _Peer, _Graph = _interleave_fakes(sweep_timing, order, released, refs)
    monkeypatch.setattr(sweep, "Peer", _Peer)
    monkeypatch.setattr(sweep, "_drain", lambda: None)
    monkeypatch.setattr(sweep, "roofline", lambda wl, bs, kv, us, env, lens=None: {"gbs": us} if us else {})
    ctx = SimpleNamespace(device="cuda", clock=clock, fi=None, ws=None, errors=[], env={})
    row = SimpleNamespace(wl=SimpleNamespace(name="gqa32_decode"), bs=1, kv=64, lens=(64,), dist="uniform")
    recs = [dict(impl="ours", status="ok"), dict(impl="fa2", status="ok"), dict(impl="broken", status="ok"),
            dict(impl="fa3", status="skipped")]
    recs[0]["eager_us"], recs[1]["graph_us"] = 0.0, 1.0      # times from before the rounds: never kept
    recs[2].update(graph_us=5.0, eager_us=6.0, gbs=7.0)       # a peer whose every round fails
    graphs = {name: (_Graph(name), None) for name in ("ours", "fa2", "broken")}
    refs += [weakref.ref(g) for g, _ in graphs.values()]
    got = sweep.interleaved_times(ctx, row, recs, lambda: order.append("ours"), None, graphs)
    assert got is recs and graphs == {}, "the graphs are released after their rounds"
    assert released and all(released), "a graph was still alive in the host and eager rounds"
    rounds = sweep_timing.HOST_ROUNDS
    names = ["ours", "fa2", "broken"]         # each round starts one later; "broken" fails in round 0
    turns = [n for r in range(rounds) for n in names[r % 3:] + names[:r % 3] if n != "broken"]
    assert order == ["graph " + n for n in turns] + turns * 2
    for rec in recs[:2]:
        for kind, base in (("graph", 100), ("host", 200), ("eager", 300)):
            assert len(rec[f"{kind}_rounds_us"]) == rounds
            assert all(base < t < base + 100 for t in rec[f"{kind}_rounds_us"]), f"{kind} on another clock"
            assert rec[f"{kind}_us"] == min(rec[f"{kind}_rounds_us"]), f"{kind}: not the least round"
        assert rec["gbs"] == rec["graph_us"], "rates not from the graph time kept"
    assert "replay failed" in recs[2]["graph_error"] and "graph_us" not in recs[2] and "gbs" not in recs[2]
    assert not [k for r in recs for k in r if k.endswith("_first_us")]
    assert "plan refused" in recs[2]["host_error"] and "host_us" not in recs[2]
    assert "plan refused" in recs[2]["eager_error"] and "eager_us" not in recs[2]
    assert "graph_us" not in recs[3] and "host_us" not in recs[3] and "eager_us" not in recs[3]
    assert len(ctx.errors) == 3 and "gbs" not in recs[3]
    assert all(e.startswith("gqa32_decode bs=1 kv=64 ") for e in ctx.errors), "an error without its row"


def test_ours_and_peers_leave_their_graphs_for_the_rounds(monkeypatch):
    """``time_ours`` and ``time_peer`` leave each captured graph, with what it replays, in the row's
    ``graphs`` (without them the graph rounds never run); a peer whose capture fails leaves none.
    They time no graph, eager or host call one implementation after the other (the interleaved
    rounds do), only the one median of eager calls back to back (``eager_gpu_us``)."""
    import collections
    from types import SimpleNamespace

    import torch

    monkeypatch.syspath_prepend(str(BENCH))
    import sweep
    import sweep_timing

    out = torch.ones(2, 3)

    class _Graph:
        def replay(self) -> None:
            pass

    class _Ours:
        def __init__(self, row) -> None:
            pass

        def eager(self):
            return lambda: out

        def graph(self):
            return _Graph(), out

        def layout(self):
            return "layout"

    class _Peer:
        def __init__(self, fi, config, inp, ws, graph=False) -> None:
            if graph and config == "nograph":
                raise RuntimeError("capture refused")

        def fn(self):
            return lambda: out

    monkeypatch.setattr(sweep, "Ours", _Ours)
    monkeypatch.setattr(sweep, "Peer", _Peer)
    monkeypatch.setattr(sweep, "capture", lambda fn: (_Graph(), fn()))
    monkeypatch.setattr(sweep, "roofline", lambda wl, bs, kv, us, env, lens=None: {})
    monkeypatch.setattr(sweep, "_drain", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    ctx = SimpleNamespace(device="cuda", clock=sweep_timing.Clock("cpu"), fi=None, ws=None, errors=[], env={},
                          mismatches=[], failures=collections.Counter(), broken={})
    row = SimpleNamespace(wl=SimpleNamespace(name="w", describe=lambda: {"workload": "w"}), bs=1, kv=64, lens=(64,),
                          dist="uniform")
    graphs: dict = {}
    ours, ref, _, _ = sweep.time_ours(ctx, row, graphs)
    peers = [sweep.time_peer(ctx, row, config, None, ref, graphs) for config in ("fa2", "nograph")]
    assert set(graphs) == {"ours", "fa2"} and all(isinstance(g, _Graph) for g, _ in graphs.values())
    assert ours["status"] == peers[0]["status"] == "ok" and peers[1]["status"] == "error"
    for rec in (ours, peers[0]):
        assert "eager_gpu_us" in rec and not {"graph_us", "eager_us", "host_us"} & set(rec)


def test_the_method_text_follows_how_the_data_was_timed(monkeypatch):
    """SWEEP.md describes the timing its records show, whichever format they have: power-capped rows
    settled before their graph rounds, rounds alone (first medians kept aside), first medians with
    graph rounds, or graphs timed once (the oldest records)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import sweep_report
    import sweep_timing

    # what a GPU sweep's header names (``sweep.environment``) is what the report describes
    assert sweep_timing.ROUNDS_TIMING in sweep_report.TIMING and sweep_timing.HOST_TIMING in sweep_report.HOST
    header = {"timing": "settled"}           # a header that names it (no row need settle)
    assert sweep_report.timing([{"graph_rounds_us": [1.0]}], header) == "settled"
    text = "\n".join(sweep_report.header_lines(header, {}, sweep_report.timing([], header)))
    assert sweep_report.TIMING["settled"] in text
    cases = {"settled": [{"graph_rounds_us": [1.0], "graph_first_us": 2.0}, {"graph_settle_s": 1.0}],
             "rounds": [{"graph_rounds_us": [1.0], "graph_first_us": 2.0}, {}],
             "first": [{"graph_rounds_us": [1.0], "eager_rounds_us": [1.0]}],
             "once": [{"eager_rounds_us": [1.0]}, {}]}
    for how, results in cases.items():
        assert sweep_report.timing(results) == how
        text = "\n".join(sweep_report.header_lines({}, {}, sweep_report.timing(results)))
        assert sweep_report.TIMING[how] in text and "{timing}" not in text
    # the host method is the header's (a header from before it was recorded: drained before each call)
    for header, host in (({}, "drained"), ({"host_timing": "queued"}, "queued")):
        text = " ".join(" ".join(sweep_report.header_lines(header, {}, "settled")).split())
        assert " ".join(sweep_report.HOST[host].split()) in text and "{host}" not in text
        assert all(" ".join(v.split()) not in text for k, v in sweep_report.HOST.items() if k != host)


def test_host_times_are_taken_back_to_back_while_the_device_runs(monkeypatch):
    """``Clock.host_us`` on a device: one call and a drain before, then ``HOST_ITERS + 1`` calls
    with no synchronize between them, the median of all but the first (from the drained device)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import sweep_timing

    events, spans = [], iter(range(1000))
    clock = sweep_timing.Clock("cpu")
    clock.cuda = True
    monkeypatch.setattr(sweep_timing.torch.cuda, "synchronize", lambda: events.append("sync"))
    # perf_counter pairs around each call: the k-th call takes k seconds (the first the longest: 1000)
    now = {"t": 0.0}

    def perf_counter():
        return now["t"]

    def call():
        events.append("call")
        k = next(spans)
        now["t"] += 1000.0 if k == 1 else float(k)

    monkeypatch.setattr(sweep_timing.time, "perf_counter", perf_counter)
    got = clock.host_us(call)
    n = sweep_timing.HOST_ITERS
    assert events == ["call", "sync"] + ["call"] * (n + 1) + ["sync"]
    assert got == sorted(float(k) * 1e6 for k in range(2, n + 2))[n // 2]


def test_power_capped_rows_settle_before_their_graph_rounds(monkeypatch):
    """A row of at least half the ridge intensity replays every implementation's graph in turn for
    ``SETTLE_S`` before its graph rounds (none before the host and eager rounds), a replay that
    fails left out of it after its first try; the graphs are still freed before the host rounds,
    and the records of those that took part say for how long (``graph_settle_s``). A lighter row,
    or a card whose ridge is unknown, starts its rounds at once."""
    import weakref
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(BENCH))
    import sweep
    import sweep_timing

    monkeypatch.setattr(sweep_timing, "SETTLE_S", 0.05)
    monkeypatch.setattr(sweep, "_drain", lambda: None)
    monkeypatch.setattr(sweep, "roofline", lambda wl, bs, kv, us, env, lens=None: {})
    for intensity, ridge, settles in ((50.0, 100.0, True), (49.9, 100.0, False), (60.0, None, False)):
        order, released, refs, tries = [], [], [], []
        clock, _Peer, _Graph = _interleave_fakes(sweep_timing, order, released, refs)
        monkeypatch.setattr(sweep, "Peer", _Peer)
        ctx = SimpleNamespace(device="cuda", clock=clock, fi=None, ws=None, errors=[],
                              env={"ridge_flop_per_byte": ridge} if ridge else {})
        row = SimpleNamespace(wl=SimpleNamespace(name="mla128_verify4"), bs=1, kv=64, lens=(64,), dist="uniform")
        recs = [dict(impl="ours", status="ok", intensity=intensity), dict(impl="fa3", status="ok"),
                dict(impl="broken", status="ok"), dict(impl="fa2", status="skipped")]
        graphs = {name: (_Graph(name), None) for name in ("ours", "fa3", "broken")}
        graphs["broken"] = (type("_Tried", (_Graph,), {"replay": lambda g: (tries.append(1), _Graph.replay(g))})(
            "broken"), None)                                      # counts its tries
        refs += [weakref.ref(g) for g, _ in graphs.values()]
        sweep.interleaved_times(ctx, row, recs, lambda: order.append("ours"), None, graphs)
        assert graphs == {} and released and all(released), "a graph outlived its rounds"
        names = ["ours", "fa3", "broken"]
        turns = [n for r in range(sweep_timing.HOST_ROUNDS) for n in names[r % 3:] + names[:r % 3]
                 if n != "broken"]
        tail = ["graph " + n for n in turns] + turns * 2          # the rounds, as without settling
        assert order[len(order) - len(tail):] == tail
        lead = order[:len(order) - len(tail)]
        assert len(tries) == 1 + settles, "the failing replay tried again while settling, or never"
        assert "graph_settle_s" not in recs[3], "a configuration that did not run settled"
        if settles:
            assert len(lead) > 20 and lead == ["graph ours", "graph fa3"] * (len(lead) // 2), lead[:6]
            assert all(0.05 <= r["graph_settle_s"] < 1.0 for r in recs[:2])
            assert recs[2].get("graph_settle_s", 0.0) < 0.05, "the failing replay settled to the end"
        else:
            assert lead == [] and not any("graph_settle_s" in r for r in recs)
