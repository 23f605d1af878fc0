"""The sweep (bench/sweep/sweep.py) on the CPU: its smoke path end to end (our kernels in
the interpreter, every FlashInfer configuration's arguments checked by emulation, the
report built from the JSON), and, where ``import flashinfer`` works (it imports without a
GPU), every FlashInfer call the sweep makes bound to the installed wheel's signatures; the report
with our batch-invariant mode. The timing's tests are in test_sweep_timing.py."""
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
    # our batch-invariant mode: one record per GQA row, checked against ours; none for MLA (no such mode)
    inv = {(r["dist"], r["workload"], r["bs"]): r for r in results if r["impl"] == "ours_invariant"}
    assert len(inv) == len([r for r in results if r["impl"] == "ours_invariant"]), "a row's mode twice"
    assert set(inv) == {(r["dist"], r["workload"], r["bs"]) for r in ours if r["family"] == "gqa"}
    assert all(r["family"] == "gqa" for r in inv.values()), "an MLA row ran the batch-invariant mode"
    assert all(r["status"] == "ok" and r["eager_us"] > 0 and r["err"] is not None and r["check"] == "pass"
               for r in inv.values())
    report = subprocess.run([sys.executable, str(BENCH / "sweep_report.py"), str(tmp_path / "sweep.jsonl"),
                             "--out-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr[-2000:]
    table = (tmp_path / "SWEEP.md").read_text()
    assert "| dist | workload | bs | kv |" in table and "SMOKE DATA" in table
    assert all(f"| {r['dist']} | {r['workload']} | {r['bs']} | {r['kv']}" in table for r in ours)
    rows = [line.split(" | ")[0].strip("| ") for line in table.split("## Rows")[1].split("## Targets")[0].splitlines()
            if line.startswith(("| uniform", "| ragged", "| longtail", "| bimodal"))]
    assert rows == sorted(rows, key=["uniform", "ragged", "longtail", "bimodal"].index), "rows not grouped by dist"
    configs, modes = table.split("## Every FlashInfer configuration")[1].split("## Our batch-invariant mode")
    assert "ours_invariant" not in configs, "our batch-invariant mode listed as a FlashInfer configuration"
    assert all(f"| {d} | {w} | {bs} |" in modes for d, w, bs in inv), "a batch-invariant record not in its table"


def test_no_invariant_skips_the_batch_invariant_mode(tmp_path):
    env = dict(os.environ, BENCH_DEVICE="cpu", TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(BENCH / "sweep.py"), "--smoke", "--out", str(tmp_path), "--dist",
                          "uniform", "--workloads", "gqa32_decode", "--no-invariant"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    impls = [json.loads(x).get("impl") for x in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert "ours" in impls and "ours_invariant" not in impls


def test_fp8_rows_run_on_an_fp8_cache_and_flashinfer_is_handed_its_scales(tmp_path):
    """``*_fp8`` workloads (by name): a group of their own on an e4m3 pool, ours and every
    FlashInfer configuration's arguments (emulated: the cache times run()'s k_scale / v_scale)
    agree; the bytes are the FP8 cache's."""
    env = dict(os.environ, BENCH_DEVICE="cpu", TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(BENCH / "sweep.py"), "--smoke", "--out", str(tmp_path), "--dist",
                          "ragged", "--workloads", "gqa28_4_d64_decode,gqa28_4_d64_decode_fp8,gqa28_4_d64_verify4_fp8",
                          "--no-invariant"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    rows = [r for r in recs if r.get("impl")]
    fp8 = [r for r in rows if r["workload"].endswith("_fp8")]
    assert {r["workload"] for r in fp8} == {"gqa28_4_d64_decode_fp8", "gqa28_4_d64_verify4_fp8"}
    assert all(r["kv_dtype"] == "float8_e4m3fn" for r in fp8)
    peers = [r for r in fp8 if r["impl"].startswith("fi_") and r["status"] == "emulated"]
    assert len(peers) >= 4 and all(r["check"] == "pass" for r in peers), [(r["impl"], r.get("err")) for r in fp8]
    ours = {r["workload"]: r for r in rows if r["impl"] == "ours"}
    bf16, e4m3 = ours["gqa28_4_d64_decode"], ours["gqa28_4_d64_decode_fp8"]
    q_out = bf16["bs"] * bf16["width"] * bf16["heads"] * (bf16["qk_dim"] + bf16["v_dim"]) * 2   # bf16 both times
    assert 2 * (e4m3["bytes"] - q_out) == bf16["bytes"] - q_out > 0, "FP8 rows' KV bytes not halved"


def test_ours_invariant_is_the_batch_invariant_backend_in_eager_and_graph_form(monkeypatch):
    """``Ours(row, invariant=True)`` runs ``BatchInvariantTritonBackend`` (its eager backend and the one
    its graph captures), ``Ours(row)`` the balanced default; an MLA row is refused by name."""
    monkeypatch.syspath_prepend(str(BENCH))
    import sweep_ours
    from sweep_matrix import points
    from sweep_rows import build_group, build_row

    from attn_backends.backends.triton_backend import BatchInvariantTritonBackend

    monkeypatch.setattr(sweep_ours, "capture", lambda fn: (None, fn()))   # the CPU: the captured call runs once
    pts = {p.family: p for p in points(smoke=True, dists=["uniform"])}
    for family, pt in pts.items():
        wl = pt.wls[0]
        row = build_row(build_group(wl, pt.bs, pt.kv, "cpu", lens=list(pt.lens), dist=pt.dist), wl)
        if family == "mla":
            with pytest.raises(ValueError, match=f"invariant=True: workload '{wl.name}' is mla"):
                sweep_ours.Ours(row, invariant=True)
            continue
        for invariant, schedule in ((True, "invariant"), (False, "chunks")):
            ours = sweep_ours.Ours(row, invariant=invariant)
            ours.graph()
            for be in (ours.backend, ours._graph_backend):
                assert be.schedule == schedule and isinstance(be, BatchInvariantTritonBackend) == invariant


def test_prewarm_builds_the_batch_invariant_kernels_of_gqa_workloads_only(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import sweep_prewarm
    from sweep_matrix import points

    groups = points(smoke=True, dists=["uniform"])
    gqa = sorted(w.name for p in groups for w in p.wls if w.family == "gqa")
    assert gqa and len(gqa) < len({w.name for p in groups for w in p.wls}), "the smoke grid lost a family"
    got = sweep_prewarm.jobs(groups, False, 90, invariant=True)
    assert [j for j in got if j.startswith("ours_invariant:")] == [f"ours_invariant:{n}" for n in gqa]
    assert not [j for j in sweep_prewarm.jobs(groups, False, 90) if j.startswith("ours_invariant")]


def _report_records() -> list:
    """One GQA row where our batch-invariant mode is the fastest of all (graph 5, eager 6), FlashInfer's
    decode 12 / 13 against ours 10 / 10, and an MLA row without that mode."""
    base = dict(type="result", family="gqa", workload="gqa32_decode", bs=8, kv=4096, dist="uniform", status="ok",
                intensity=1.0, bound="memory", gbs=1.0, frac_copy=0.5, tflops=0.1)
    return [dict(base, impl="ours", graph_us=10.0, eager_us=10.0, host_us=4.0),
            dict(base, impl="ours_invariant", graph_us=5.0, eager_us=6.0, host_us=3.0, err=0.0, check="pass"),
            dict(base, impl="fi_decode", graph_us=12.0, eager_us=13.0, host_us=5.0, err=1e-3, check="pass"),
            dict(base, impl="fi_decode_tc", graph_us=20.0, eager_us=20.0, host_us=5.0, err=1e-3, check="pass"),
            dict(base, family="mla", workload="mla16_decode", impl="ours", graph_us=10.0, eager_us=10.0),
            dict(base, family="mla", workload="mla16_decode", impl="fi_mla_fa2", graph_us=9.0, eager_us=9.0,
                 err=1e-3, check="pass")]


def test_the_report_never_counts_the_batch_invariant_mode_as_flashinfer(monkeypatch):
    """FI best, x (row and per distribution), the targets, the check and the console line take
    FlashInfer's configurations only: ours_invariant, faster than every one here, is shown beside ours
    (invariant graph, inv/ours, its median per distribution), never as FlashInfer's best."""
    monkeypatch.syspath_prepend(str(BENCH))
    import sweep_ours
    import sweep_report as R

    assert R.INVARIANT == sweep_ours.INVARIANT
    results = _report_records()
    grouped = R.group(results)
    recs = grouped[("uniform", "gqa32_decode", 8, 4096)]
    assert R.best(recs, "graph_us")["impl"] == "fi_decode" and R.best(recs, "eager_us")["impl"] == "fi_decode"
    assert R.x_rows(grouped)["uniform"][0][1:] == (1.2, 1.3)
    assert "FI best fi_decode 12.0/13.0 us (1.20x)" in R.row_summary(results[:4])
    table = R.markdown({}, results, {})
    summary = table.split("## Rows")[0]
    assert "| uniform | 2 | 0.90x | 1.20x | 1.20x | 1 | 0.90x | 1.30x | 0.50x |" in summary, summary
    row = next(x for x in table.split("## Targets")[0].splitlines() if "| gqa32_decode |" in x)
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[8:15] == ["5.0", "0.50x", "12.0 (decode)", "13.0 (decode)", "5.0", "1.20x", "1.30x"], cells
    assert "- graph: GQA and MLA-16 >= 1.0x FlashInfer's best: 1/2 met" in table
    assert "miss: gqa32_decode" not in table and "- eager: >= 0.95x FlashInfer's best: 1/2 met" in table
    configs = table.split("## Every FlashInfer configuration")[1].split("## Our batch-invariant mode")[0]
    assert "ours_invariant" not in configs and "| decode_tc |" in configs
    # a mismatch of the mode is marked on its own cell, not on FlashInfer's check
    results[1]["check"] = "FAIL"
    row = next(x for x in R.main_table(R.group(results)) if "| gqa32_decode |" in x)
    assert "| 5.0 ! | 0.50x |" in row and row.endswith("| pass |"), row


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
