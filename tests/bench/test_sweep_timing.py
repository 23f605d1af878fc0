"""The sweep's timing (bench/sweep/sweep.py, sweep_timing.py) on the CPU with fakes: the interleaved
graph, host and eager rounds over ours, our batch-invariant mode and each FlashInfer configuration,
the graphs each leaves for them, power-capped rows settling first, the host method, and the method
text of SWEEP.md. Moved from test_bench_sweep.py (which keeps the smoke run and the report)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "sweep"


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
    ctx = SimpleNamespace(device="cuda", clock=clock, fi=None, ws=None, errors=[], env={}, trace=0)
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
        ctx = SimpleNamespace(device="cuda", clock=clock, fi=None, ws=None, errors=[], trace=0,
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


def test_the_batch_invariant_mode_is_timed_in_the_same_rounds_from_its_own_call(monkeypatch):
    """``ours_invariant`` takes its turn in every graph, host and eager round beside ours and the
    FlashInfer configurations, its eager call ours (``mine``), never a FlashInfer plan."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(BENCH))
    import sweep
    import sweep_timing

    order, released, refs = [], [], []
    clock, _Peer, _Graph = _interleave_fakes(sweep_timing, order, released, refs)
    monkeypatch.setattr(sweep, "Peer", _Peer)
    monkeypatch.setattr(sweep, "_drain", lambda: None)
    monkeypatch.setattr(sweep, "roofline", lambda wl, bs, kv, us, env, lens=None: {})
    ctx = SimpleNamespace(device="cuda", clock=clock, fi=None, ws=None, errors=[], env={}, trace=0)
    row = SimpleNamespace(wl=SimpleNamespace(name="gqa32_decode"), bs=1, kv=64, lens=(64,), dist="uniform")
    names = ["ours", "ours_invariant", "fa2"]
    recs = [dict(impl=n, status="ok") for n in names]
    graphs = {n: (_Graph(n), None) for n in names}
    sweep.interleaved_times(ctx, row, recs, lambda: order.append("ours"), None, graphs,
                            {"ours_invariant": lambda: order.append("inv")})
    calls = ["ours", "inv", "fa2"]
    turns = lambda x: [x[i] for r in range(sweep_timing.HOST_ROUNDS) for i in [*range(r % 3, 3), *range(r % 3)]]  # noqa: E731
    assert order == ["graph " + n for n in turns(names)] + turns(calls) * 2, order
    assert all(len(r[f"{k}_rounds_us"]) == sweep_timing.HOST_ROUNDS for r in recs for k in ("graph", "host", "eager"))
    assert ctx.errors == []


def test_the_batch_invariant_mode_is_checked_against_ours_and_a_failure_is_recorded(monkeypatch):
    """``time_invariant`` builds ``Ours(row, invariant=True)``, checks its eager and graph outputs
    against ours at the FlashInfer configurations' tolerance, leaves its graph for the rounds; a
    failure is an error record (in the footer's errors), no graph and no call for the rounds."""
    import collections
    from types import SimpleNamespace

    import torch

    monkeypatch.syspath_prepend(str(BENCH))
    import sweep
    import sweep_timing

    outs = {"eager": torch.ones(2, 3), "graph": torch.ones(2, 3)}

    class _Graph:
        def replay(self) -> None:
            pass

    class _Ours:
        def __init__(self, row, invariant=False) -> None:
            assert invariant, "not the batch-invariant mode"

        def eager(self):
            return lambda: outs["eager"]

        def graph(self):
            if outs["graph"] is None:
                raise RuntimeError("capture refused")
            return _Graph(), outs["graph"]

    monkeypatch.setattr(sweep, "Ours", _Ours)
    monkeypatch.setattr(sweep, "roofline", lambda wl, bs, kv, us, env, lens=None: {})
    monkeypatch.setattr(sweep, "_drain", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    ctx = SimpleNamespace(device="cuda", clock=sweep_timing.Clock("cpu"), errors=[], env={}, mismatches=[],
                          failures=collections.Counter(), broken={})
    row = SimpleNamespace(wl=SimpleNamespace(name="w", describe=lambda: {"workload": "w"}), bs=1, kv=64, lens=(64,),
                          dist="uniform")
    ref, graphs = torch.ones(2, 3), {}
    rec, fn = sweep.time_invariant(ctx, row, ref, graphs)
    assert rec["impl"] == "ours_invariant" and rec["check"] == "pass" and rec["err"] == rec["err_graph"] == 0.0
    assert fn is not None and set(graphs) == {"ours_invariant"} and "eager_gpu_us" in rec
    outs["graph"] = torch.ones(2, 3) * (1 + 1.5 * sweep.TOLERANCE)         # the graph's output off by 1.5x tolerance
    rec, _ = sweep.time_invariant(ctx, row, ref, {})
    assert rec["check"] == "FAIL" and ctx.mismatches == ["w bs=1 kv=64 ours_invariant: err 0.03 vs ours"]
    outs["graph"], graphs = None, {}
    rec, fn = sweep.time_invariant(ctx, row, ref, graphs)
    assert rec["status"] == "error" and "capture refused" in rec["reason"] and fn is None and graphs == {}
    assert len(ctx.errors) == 1 and ctx.errors[0].startswith("w bs=1 kv=64 ours_invariant graph: RuntimeError")
