"""The sweep's table (SWEEP.md) and plot (sweep.png) from its JSON lines.

Usage: ``python bench/sweep/sweep_report.py DIR/sweep.jsonl [--out-dir bench/sweep]`` (the table needs
nothing but the standard library; the plot needs matplotlib, ``pip install -e '.[bench]'``,
and is skipped, with a note, without it).

Ratios are FlashInfer's best time over ours (above 1: ours is faster); "FI best" is the
fastest FlashInfer configuration of the row, chosen separately for graph and eager times. Rows are
grouped by their KV-length distribution (``sweep_rows.DISTS``; records without one are uniform).
Our batch-invariant mode (``ours_invariant``, GQA rows) is shown beside ours as inv/ours (its time
over ours): it is ours, never a FlashInfer configuration (not in FI best, x, the targets or the
configurations' table).
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Optional

import sweep_trace

TARGETS = """Targets (issue #10): in graphs every GQA and MLA-16 row >= 1.0x FlashInfer's best,
MLA-128 >= 0.8x fa3, verify N=4 <= 1.15x our decode at the same batch and kv; eagerly every
row >= 0.95x FlashInfer's best and our host time per call <= FlashInfer's."""
METHOD = """Method: `graph` = replay of the call captured in a CUDA graph (GPU time, events, L2
flushed before each call); `eager` = one eager call from an idle GPU, host launch included
(L2 flushed, device drained, events around the call); `host` = {host}. Medians of 8-30 calls
(host: 25); {timing}. Ours eager: `forward()` after
one `init_forward_metadata()`; FlashInfer eager: `run()` after one `plan()`. bytes = KV read
once + q + out; flops = 2*W*H*S*(Dqk+Dv), S the sum of the requests' KV lengths (bs*kv when uniform;
a non-uniform row's kv is the lengths' mean). GB/s, % copy and TFLOPs are ours, from the
graph time; "mm" is the fraction of the measured matmul rate (compute-bound rows). Bound:
compute when flops/bytes exceeds the ridge (measured matmul TFLOPs / copy GB/s), memory
otherwise. check: our output against the fastest FlashInfer configuration's
(max abs diff / max abs < 2e-2; `!` marks a mismatch of any configuration). `invariant graph`: our
batch-invariant mode (`ours_invariant`, GQA rows) replayed in a graph, in the same rounds, its
output checked against ours at the same tolerance (`!`: a mismatch); inv/ours = its time / ours."""

INVARIANT = "ours_invariant"    # sweep_ours.INVARIANT (no torch import here)


def is_fi(impl: str) -> bool:
    """A FlashInfer configuration's record (not ours, ``ours_invariant`` or a skipped ``row``)."""
    return impl.startswith("fi_")


def row_summary(recs: list) -> str:
    """One console line of a measured row (``sweep.measure_row``'s records, ours first)."""
    ours = recs[0]
    where = f"{ours['workload']:15s} bs={ours['bs']:<3d} kv={ours['kv']:<5d}" + (
        "" if dist_of(ours) == "uniform" else f" {dist_of(ours)} {ours['kv_min']}-{ours['kv_max']}")
    if ours["status"] != "ok":
        return f"{where} ours {ours['status']}"
    us = lambda r, k: f"{r[k]:.1f}" if r.get(k) is not None else "-"  # noqa: E731
    peers = [r for r in recs[1:] if is_fi(r["impl"]) and r.get("graph_us")]
    best = min(peers, key=lambda r: r["graph_us"], default=None)
    fi = "FI -"
    if best and ours.get("graph_us"):
        fi = (f"FI best {best['impl']} {us(best, 'graph_us')}/{us(best, 'eager_us')} us "
              f"({best['graph_us'] / ours['graph_us']:.2f}x)")
    inv = next((r for r in recs if r["impl"] == INVARIANT), None)
    if inv:
        fi = f"inv {us(inv, 'graph_us')}/{us(inv, 'eager_us')} us ({inv['status']}) | " + fi
    checks = ",".join(sorted({r["check"] for r in recs if r.get("check")}))
    return (f"{where} ours graph/eager "
            f"{us(ours, 'graph_us')}/{us(ours, 'eager_us')} us host {us(ours, 'host_us')} | {fi} "
            f"| check {checks or '-'}")


# How the host times were taken (the header's ``host_timing``; none: before it was recorded).
HOST = {
    "queued": "host time of one eager call: 26 made back to back while the GPU runs the ones before "
              "(perf_counter around each, no synchronize between them), the median of the last 25 (the "
              "first, from an idle GPU, left out)",
    "drained": "host time of one eager call (perf_counter, the device drained before each call)",
}
# How the data's graph / eager / host times were taken (``timing``: the header's, else what the records show).
_ROUNDS = ("graph, eager and host: the least of 3 rounds, every round timing ours and each FlashInfer "
           "configuration in turn, starting one later each round (a time none of whose rounds ran is left out)")
TIMING = {
    "rounds": _ROUNDS + "; `eager (GPU)`: one median",
    "settled": _ROUNDS + "; the graph rounds of a row of at least half the ridge intensity (on an H100 the "
                         "MLA-128 rows, which draw the card to its power limit) start after 1 s of replays of "
                         "every implementation in turn, so that the rounds start under that load (they still "
                         "spread as the card heats); `eager (GPU)`: one median",
    "first": "graph and eager: the least of the first median and 3 rounds, every round timing ours and "
             "each FlashInfer configuration in turn; host: the least of 3 such rounds; `eager (GPU)`: one median",
    "once": "graph and `eager (GPU)`: one median, ours first, then each configuration; eager: the least "
            "of the first median and 3 rounds, every round timing ours and each configuration in turn; "
            "host: the least of 3 such rounds",
}


def timing(results: list, header: Optional[dict] = None) -> str:
    """Which ``TIMING`` the records were taken by: the header's ``timing`` where it names one
    (since 3a14aae, which also stopped taking first medians), else what the records show:
    power-capped rows settled before their graph rounds (``graph_settle_s``), since a82f3c3 they
    keep their first medians aside (``*_first_us``), from 7b9d8b9 they carry graph rounds,
    before that neither."""
    if header and header.get("timing"):
        return header["timing"]
    if any("graph_settle_s" in r for r in results):
        return "settled"
    if any("graph_first_us" in r or "eager_first_us" in r for r in results):
        return "rounds"
    return "first" if any("graph_rounds_us" in r for r in results) else "once"


def load(path) -> tuple:
    header, results, footer = {}, [], {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "header":
            header = rec
        elif rec["type"] == "footer":
            footer = rec
        else:
            results.append(rec)
    return header, results, footer


DIST_ORDER = ("uniform", "ragged", "longtail", "bimodal")   # sweep_rows.DISTS (no torch import here)


def dist_of(rec: dict) -> str:
    return rec.get("dist", "uniform")           # records from before issue #40 are uniform


def group(results) -> dict:
    """``{(dist, workload, bs, kv): {impl: record}}``, grouped by distribution, in sweep order within."""
    out = collections.OrderedDict()
    for r in results:
        out.setdefault((dist_of(r), r["workload"], r["bs"], r["kv"]), {})[r["impl"]] = r
    rank = lambda d: DIST_ORDER.index(d) if d in DIST_ORDER else len(DIST_ORDER)  # noqa: E731
    return collections.OrderedDict(sorted(out.items(), key=lambda kv: rank(kv[0][0])))


def x_rows(grouped: dict) -> dict:
    """``{dist: [(label, x graph, x eager)]}``: FlashInfer's best time over ours per measured row
    (None where either has no time), the data of the x plot and of the per-distribution summary."""
    out = collections.OrderedDict()
    for (dist, wl, bs, kv), recs in grouped.items():
        ours = recs.get("ours")
        if not ours or ours["status"] != "ok":
            continue
        x = []
        for key in ("graph_us", "eager_us"):
            b = best(recs, key)
            x.append(b[key] / ours[key] if b and ours.get(key) else None)
        out.setdefault(dist, []).append((f"{wl} bs {bs} kv {kv}", *x))
    return out


def inv_ratio(recs: dict, key: str = "graph_us"):
    """Our batch-invariant mode's time over ours (None where either has no time)."""
    ours, inv = recs.get("ours"), recs.get(INVARIANT)
    return inv[key] / ours[key] if ours and inv and ours.get(key) and inv.get(key) else None


def x_summary(grouped: dict) -> list:
    lines = ["| dist | rows | x graph min | median | max | rows < 1.0x | x eager min | median "
             "| inv/ours graph median |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f = lambda v: f"{v:.2f}x" if v is not None else "-"  # noqa: E731
    mid = lambda v: v[len(v) // 2] if v else None  # noqa: E731
    for dist, rows in x_rows(grouped).items():
        g = sorted(x for _, x, _ in rows if x is not None)
        e = sorted(x for _, _, x in rows if x is not None)
        inv = sorted(r for key, recs in grouped.items() if key[0] == dist and (r := inv_ratio(recs)) is not None)
        lines.append(f"| {dist} | {len(rows)} | {f(g[0] if g else None)} | {f(mid(g))} | {f(g[-1] if g else None)} "
                     f"| {sum(x < 1.0 for x in g)} | {f(e[0] if e else None)} | {f(mid(e))} | {f(mid(inv))} |")
    return lines


def best(recs: dict, key: str):
    peers = [r for impl, r in recs.items() if is_fi(impl) and r.get(key)]
    return min(peers, key=lambda r: r[key], default=None)


def _us(x) -> str:
    return "-" if x is None else (f"{x:.1f}" if x < 1000 else f"{x:.0f}")


def _ratio(peer, ours, key) -> str:
    if not peer or not ours.get(key) or not peer.get(key):
        return "-"
    return f"{peer[key] / ours[key]:.2f}x"


def _range(rec: dict) -> str:
    """A non-uniform row's lengths beside its mean kv."""
    return f" ({rec['kv_min']}-{rec['kv_max']})" if dist_of(rec) != "uniform" and "kv_min" in rec else ""


def _short(impl: str) -> str:
    return impl[3:] if impl.startswith("fi_") else impl


def _check(recs: dict, fastest) -> str:
    fail = any(r.get("check") == "FAIL" for r in recs.values() if is_fi(r["impl"]))
    if fastest is None:
        checked = [r for r in recs.values() if r.get("check") and is_fi(r["impl"])]
        mark = ("FAIL" if fail else "pass") + (" (emulated)" if any(r["status"] == "emulated" for r in checked) else "")
        return mark if checked else "-"
    return (fastest.get("check") or "-") + (" !" if fail and fastest.get("check") != "FAIL" else "")


def main_table(grouped: dict) -> list:
    lines = ["| dist | workload | bs | kv | bound (flop/B) | ours graph | ours eager | ours host | invariant graph "
             "| inv/ours | FI best graph | FI best eager | FI host | x graph | x eager | GB/s | % copy | TFLOPs "
             "| check |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for (dist, wl, bs, kv), recs in grouped.items():
        ours = recs.get("ours")
        if ours is None or ours["status"] != "ok":
            why = (ours or recs.get("row") or {}).get("reason", "")
            lines.append(f"| {dist} | {wl} | {bs} | {kv} | {why} |" + " |" * 14)
            continue
        bg, be, inv = best(recs, "graph_us"), best(recs, "eager_us"), recs.get(INVARIANT)
        inv_us = "-" if not inv else _us(inv.get("graph_us")) + (" !" if inv.get("check") == "FAIL" else "")
        ratio = inv_ratio(recs)
        inv_us += f" | {'-' if ratio is None else f'{ratio:.2f}x'}"
        frac = f"{ours['frac_copy']:.0%}" if ours.get("frac_copy") else "-"
        tflops = f"{ours.get('tflops', 0):.1f}"
        if ours.get("bound") == "compute" and ours.get("frac_matmul"):
            tflops += f" ({ours['frac_matmul']:.0%} mm)"
        lines.append(
            f"| {dist} | {wl} | {bs} | {kv}{_range(ours)} | {ours.get('bound') or '-'} ({ours['intensity']:.0f}) "
            f"| {_us(ours.get('graph_us'))} | {_us(ours.get('eager_us'))} | {_us(ours.get('host_us'))} "
            f"| {inv_us} | {_us(bg and bg['graph_us'])} {'(' + _short(bg['impl']) + ')' if bg else ''} "
            f"| {_us(be and be['eager_us'])} {'(' + _short(be['impl']) + ')' if be else ''} "
            f"| {_us(be and be.get('host_us'))} | {_ratio(bg, ours, 'graph_us')} | {_ratio(be, ours, 'eager_us')} "
            f"| {ours.get('gbs', 0):.0f} | {frac} | {tflops} | {_check(recs, bg)} |")
    return lines


def config_table(grouped: dict) -> list:
    lines = ["| dist | workload | bs | kv | config | graph | eager | eager (GPU) | host | err vs ours | status |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for (dist, wl, bs, kv), recs in grouped.items():
        for impl, r in recs.items():
            if not is_fi(impl):
                continue
            err = max((e for e in (r.get("err"), r.get("err_graph")) if e is not None), default=None)
            status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
            lines.append(f"| {dist} | {wl} | {bs} | {kv} | {_short(impl)} | {_us(r.get('graph_us'))} "
                         f"| {_us(r.get('eager_us'))} "
                         f"| {_us(r.get('eager_gpu_us'))} | {_us(r.get('host_us'))} "
                         f"| {'-' if err is None else f'{err:.1e}'} | {status[:140]} |")
    return lines


def invariant_table(grouped: dict) -> list:
    """Our batch-invariant mode on each row that ran it: its times, each over ours, its error against ours."""
    lines = ["| dist | workload | bs | kv | graph | eager | eager (GPU) | host | inv/ours graph | inv/ours eager "
             "| err vs ours | status |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (dist, wl, bs, kv), recs in grouped.items():
        if (r := recs.get(INVARIANT)) is None:
            continue
        err = max((e for e in (r.get("err"), r.get("err_graph")) if e is not None), default=None)
        err = "-" if err is None else f"{err:.1e} ({r.get('check', '-')})"
        ratios = [inv_ratio(recs, k) for k in ("graph_us", "eager_us")]
        lines.append(f"| {dist} | {wl} | {bs} | {kv} | {_us(r.get('graph_us'))} | {_us(r.get('eager_us'))} "
                     f"| {_us(r.get('eager_gpu_us'))} | {_us(r.get('host_us'))} "
                     + "".join(f"| {'-' if x is None else f'{x:.2f}x'} " for x in ratios)
                     + f"| {err} | {r['status']}"
                     + (f": {r['reason'][:140]}" if r.get("reason") else "") + " |")
    return lines


def _target(name: str, items: list) -> list:
    """``items``: (label, value, ok); one line with the count, then the misses."""
    if not items:
        return [f"- {name}: no data"]
    miss = [(label, v) for label, v, ok in items if not ok]
    out = [f"- {name}: {len(items) - len(miss)}/{len(items)} met"]
    out += [f"  - miss: {label} ({v})" for label, v in miss[:30]]
    if len(miss) > 30:
        out.append(f"  - ... {len(miss) - 30} more")
    return out


def targets(grouped: dict) -> list:
    graph, mla128, verify, eager, host = [], [], [], [], []
    for (dist, wl, bs, kv), recs in grouped.items():
        ours, label = recs.get("ours"), f"{wl} bs {bs} kv {kv}" + ("" if dist == "uniform" else f" {dist}")
        if not ours or ours["status"] != "ok":
            continue
        bg, be, fa3 = best(recs, "graph_us"), best(recs, "eager_us"), recs.get("fi_mla_fa3")
        if bg and ours.get("graph_us") and not wl.startswith("mla128"):
            r = bg["graph_us"] / ours["graph_us"]
            graph.append((label, f"{r:.2f}x {_short(bg['impl'])}", r >= 1.0))
        if wl.startswith("mla128") and fa3 and fa3.get("graph_us") and ours.get("graph_us"):
            r = fa3["graph_us"] / ours["graph_us"]
            mla128.append((label, f"{r:.2f}x, ours {ours.get('tflops', 0):.0f} TFLOPs", r >= 0.8))
        dec = grouped.get((dist, wl.rsplit("_", 1)[0] + "_decode", bs, kv), {}).get("ours")
        if "_verify4" in wl and dec and dec.get("graph_us") and ours.get("graph_us"):
            r = ours["graph_us"] / dec["graph_us"]
            verify.append((label, f"{r:.2f}x our decode", r <= 1.15))
        if be and ours.get("eager_us"):
            r = be["eager_us"] / ours["eager_us"]
            eager.append((label, f"{r:.2f}x {_short(be['impl'])}", r >= 0.95))
        if be and be.get("host_us") and ours.get("host_us"):
            host.append((label, f"ours {ours['host_us']:.1f} vs {be['host_us']:.1f} us",
                          ours["host_us"] <= be["host_us"]))
    return (_target("graph: GQA and MLA-16 >= 1.0x FlashInfer's best", graph)
            + _target("graph: MLA-128 >= 0.8x fa3", mla128)
            + _target("graph: verify N=4 <= 1.15x our decode", verify)
            + _target("eager: >= 0.95x FlashInfer's best", eager)
            + _target("eager: our host time <= FlashInfer's (its eager-best config)", host))


def problems(results: list, footer: dict) -> list:
    out = [f"- mismatch: {m}" for m in footer.get("mismatches", [])]
    out += [f"- error: {r['workload']} bs {r['bs']} kv {r['kv']} {r['impl']}: {r.get('reason', '')[:200]}"
            for r in results if r["status"] == "error"]
    out += [f"- skipped row: {r['workload']} bs {r['bs']} kv {r['kv']} {dist_of(r)}: {r.get('reason')}"
            for r in results if r["impl"] == "row"]
    reasons = collections.Counter((r["impl"], r.get("reason")) for r in results
                                  if r["status"] == "skipped" and r["impl"] != "row")
    out += [f"- {_short(impl)} not run on {n} rows: {why}" for (impl, why), n in reasons.items()]
    return out or ["- none"]


def header_lines(h: dict, footer: dict, how: str = "rounds") -> list:
    lines = ["# Sweep: ours against FlashInfer's configurations (issue #10)", ""]
    if h.get("smoke"):
        lines += ["**SMOKE DATA** (CPU, Triton interpreter, tiny shapes): times are meaningless; "
                  "FlashInfer's arguments were checked by emulation, not run.", ""]
    lines.append(f"- Card: **{h.get('device')}** (sm_{h.get('sm')}, {h.get('num_sms', '-')} SMs, "
                 f"{h.get('memory_gb', '-')} GiB); torch {h.get('torch')}, triton {h.get('triton')}, "
                 f"flashinfer {h.get('flashinfer') or '-'} (FLASHINFER_CUDA_ARCH_LIST "
                 f"{h.get('flashinfer_cuda_arch_list') or '-'}), CUDA {h.get('cuda')}; commit {h.get('git')}; "
                 f"{h.get('date')}; sweep {footer.get('elapsed_s', '-')} s.")
    if h.get("flashinfer_error"):
        lines.append(f"- FlashInfer: {h['flashinfer_error']}")
    if h.get("copy_gbs"):
        lines.append(f"- Device copy {h['copy_gbs']:.0f} GB/s (1 GiB, read + write); bf16 matmul "
                     f"{h['matmul_tflops']:.0f} TFLOPs (8192^3); ridge {h['ridge_flop_per_byte']:.0f} flop/byte.")
    if h.get("prewarm"):
        slow = max(h["prewarm"].values(), key=lambda r: r["s"])["s"]
        failed = [f"{job} (rc {r['rc']}: {r.get('tail', '')[-200:]})" for job, r in h["prewarm"].items() if r["rc"]]
        lines.append(f"- Prewarm (JIT modules and Triton kernels, in parallel): {slow:.0f} s"
                     + (f"; failed: {'; '.join(failed)}" if failed else "."))
    if h.get("not_swept"):
        lines.append("- Not swept: " + "; ".join(f"{k}: {v}" for k, v in h["not_swept"].items()) + ".")
    host = HOST[h.get("host_timing", "drained")]
    return lines + ["", METHOD.format(timing=TIMING[how], host=host), "", TARGETS, ""]


def markdown(header: dict, results: list, footer: dict) -> str:
    grouped = group(results)
    parts = header_lines(header, footer, timing(results, header))
    parts += ["## x by distribution (FlashInfer's best / ours)", ""] + x_summary(grouped)
    parts += ["", "## Rows (times in us)", ""] + main_table(grouped)
    parts += ["", "## Targets", ""] + targets(grouped)
    parts += ["", "## Mismatches, errors, skips", ""] + problems(results, footer)
    parts += ["", "## Every FlashInfer configuration (times in us)", ""] + config_table(grouped)
    parts += ["", "## Our batch-invariant mode, ours_invariant (times in us)", ""] + invariant_table(grouped)
    if any("trace" in r for r in results):
        parts += ["", "## Where each graph's time goes (--trace; us)", ""] + sweep_trace.table(grouped, best)
    return "\n".join(parts) + "\n"


def write_all(path, out_dir) -> None:
    header, results, footer = load(path)
    out_dir = Path(out_dir)
    (out_dir / "SWEEP.md").write_text(markdown(header, results, footer))
    print(f"table -> {out_dir / 'SWEEP.md'}")
    try:
        import sweep_plot
        grouped = group(results)
        sweep_plot.plot(header, grouped, out_dir / "sweep.png")
        sweep_plot.plot_x(header, x_rows(grouped), out_dir / "sweep_x.png")
        print(f"plot -> {out_dir / 'sweep.png'}, {out_dir / 'sweep_x.png'}")
    except ImportError as e:
        print(f"no plot ({e}); pip install -e '.[bench]' and rerun bench/sweep/sweep_report.py")
    except Exception as e:  # the table is written; a plot failure must not fail the sweep
        print(f"no plot: {type(e).__name__}: {e}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="SWEEP.md and sweep.png from sweep.jsonl")
    p.add_argument("path")
    p.add_argument("--out-dir", default=str(Path(__file__).parent))
    a = p.parse_args()
    write_all(a.path, a.out_dir)
