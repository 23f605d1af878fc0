"""Launch-parameter probe (issue #10): our Triton backends on the sweep's rows with keywords of the
kernel wrappers and split counts injected, beside FlashInfer's configurations, in one process.

    python bench/probes/probe_launch.py gqa64_verify4 --points 16x8192,4x32768 \\
        --variant num_warps=2,block_n=64,num_stages=3 --variant num_warps=4 --splits x0.5 x2 16

Variant 0 is the backend as it stands (no keyword, its own split count). Each ``--variant`` is a
set of keywords (``k=v``, ints or words; ``block_q``, ``block_n``, ``num_warps``, ``num_stages``, ...)
passed to the kernel wrapper the backend calls (``extend_attention_fwd``, ``decode_attention_fwd``,
``mla_attention_fwd``; ``kernel=chunked`` picks an MLA kernel); ``--splits`` adds, to variant 0
and to each keyword set, split counts: ``xF`` scales the backend's count (at least 1), ``N`` sets it. Rows come from
``sweep_rows.build_row`` (shuffled pages, the sweep's data).

Timing: each variant's call is captured in a CUDA graph once (its backend, static buffers and
workspace alive while it replays) and replayed with the L2 flushed (``Clock.gpu_us``), in
``--rounds`` interleaved rounds, every variant and every FlashInfer configuration that can run
the row (``--no-flashinfer`` leaves them out) in each round; the least round is kept. ``err`` is
each output (after its replays) against variant 0's and against the fastest FlashInfer
configuration's (``sweep.rel_err``: max abs diff / max abs, inf for a non-finite output;
variant 0 is the first variant that ran). A variant or a FlashInfer configuration that fails is
printed (``!!``) and left out. Each point's rows go to stdout, and the whole table to ``--out``
(markdown) after every point.

On the CPU (``BENCH_DEVICE=cpu``: the interpreter, the row's smoke shape, no FlashInfer) each
variant runs eagerly, timed by one perf_counter span: a check of the tool, not a measurement.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sweep"))   # the sweep's modules, bench/sweep/
if os.environ.get("BENCH_DEVICE") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton

import torch  # noqa: E402
from sweep import import_flashinfer, rel_err  # noqa: E402
from sweep_flashinfer import Peer, candidates, fi_inputs, new_workspace, refusal  # noqa: E402
from sweep_ours import Ours  # noqa: E402
from sweep_rows import BY_NAME, build_group, build_row, smoke_workload  # noqa: E402
from sweep_timing import Clock, capture  # noqa: E402

from attn_backends.backends import triton_backend, triton_common, triton_mla  # noqa: E402

WRAPPERS = ((triton_backend, "extend_attention_fwd"), (triton_backend, "decode_attention_fwd"),
            (triton_mla, "mla_attention_fwd"))


class Injector:
    """While :meth:`active`: ``kwargs`` go to every kernel-wrapper call of the triton backends, and
    ``splits`` (None, ``"xF"`` or an int) overrides their split count; ``last`` is the count the
    latest choice gave."""

    def __init__(self) -> None:
        self.kwargs: dict = {}
        self.splits = None
        self.last = None

    @contextlib.contextmanager
    def active(self):
        saved = [(m, n, getattr(m, n)) for m, n in WRAPPERS]
        choose = triton_common.choose_num_kv_splits
        for m, n, fn in saved:
            setattr(m, n, lambda *a, _fn=fn, **k: _fn(*a, **{**k, **self.kwargs}))
        triton_common.choose_num_kv_splits = lambda *a, **k: self._pick(choose(*a, **k))
        try:
            yield self
        finally:
            for m, n, fn in saved:
                setattr(m, n, fn)
            triton_common.choose_num_kv_splits = choose

    def _pick(self, count: int) -> int:
        if isinstance(self.splits, str):
            count = max(1, int(count * float(self.splits[1:])))
        elif self.splits is not None:
            count = self.splits
        self.last = count
        return count


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workload", choices=sorted(BY_NAME))
    p.add_argument("--points", required=True, help="comma-separated BSxKV, e.g. 16x8192,4x32768")
    p.add_argument("--variant", action="append", default=[], help="k=v[,k=v...] for the kernel wrapper")
    p.add_argument("--splits", nargs="*", default=[], help="xF (scale the backend's count) or N")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--out", help="markdown file for the table")
    a = p.parse_args(argv)
    a.points = [tuple(int(v) for v in pt.split("x")) for pt in a.points.split(",")]
    a.variant = [{}] + [{k: int(v) if v.lstrip("-").isdigit() else v
                         for k, v in (kv.split("=") for kv in s.split(","))} for s in a.variant]
    a.splits = [None] + [s if s.startswith("x") else int(s) for s in a.splits]
    return a


def _peers(fi, row, ws, cuda: bool) -> dict:
    """``{config: (replay, static output, keep-alive)}`` for every FlashInfer configuration that
    runs the row (graph form, captured and replayed once)."""
    if fi is None or not cuda:
        return {}
    major, minor = torch.cuda.get_device_capability()
    inp, out = fi_inputs(row, Ours(row).layout()), {}
    for config in candidates(row.wl):
        if refusal(config, row.wl, major * 10 + minor) is None:
            try:
                peer = Peer(fi, config, inp, ws, graph=True)
                g, o = capture(peer.fn())
                out[config] = (g.replay, o, (peer, g))
            except Exception as e:  # printed, and the configuration left out of the row
                print(f"!! {row.wl.name} bs {row.bs} kv {row.kv} {config}: {type(e).__name__}: {e}"[:300], flush=True)
    return out


def probe_point(args, wl, bs: int, kv: int, clock: Clock, inj: Injector, fi, ws) -> list:
    cuda = clock.cuda
    row = build_row(build_group(wl, bs, kv, clock.device), wl)
    runs = []                                # (label, call, output getter, keep-alive, splits)
    for kwargs in args.variant:
        for splits in args.splits:
            inj.kwargs, inj.splits = kwargs, splits
            try:
                ours = Ours(row)
                if cuda:
                    g, o = ours.graph()
                    runs.append((kwargs, splits, g.replay, lambda o=o: o, (ours, g), inj.last))
                else:
                    fn, got = ours.eager(), {}
                    call = lambda fn=fn, got=got, kw=kwargs: (setattr(inj, "kwargs", kw),  # noqa: E731
                                                              got.__setitem__("o", fn()))
                    call()                   # fails here, as a capture would on the GPU
                    runs.append((kwargs, splits, call, lambda got=got: got["o"], ours, inj.last))
            except Exception as e:  # a keyword the wrapper refuses, a tile that does not fit: printed
                print(f"!! {wl.name} bs {bs} kv {kv} {kwargs} splits {splits}: {type(e).__name__}: {e}"[:300],
                      flush=True)
    if not runs:
        return []
    inj.kwargs, inj.splits = {}, None
    peers = _peers(fi, row, ws, cuda)
    times = {i: [] for i in range(len(runs))} | {c: [] for c in peers}
    for _ in range(args.rounds if cuda else 1):
        for i, r in enumerate(runs):
            times[i].append(clock.gpu_us(r[2]))
        for c, (replay, _, _) in peers.items():
            times[c].append(clock.gpu_us(replay))
    best_fi = min(peers, key=lambda c: min(times[c]), default=None)
    base = runs[0][3]()
    rows = []
    for i, (kwargs, splits, _, get, _, count) in enumerate(runs):
        us = min(times[i])
        fi_us = min(times[best_fi]) if best_fi else None
        rows.append(dict(workload=wl.name, bs=bs, kv=kv, variant=kwargs, splits=splits, count=count, us=us,
                         rounds=times[i], x_default=min(times[0]) / us, fi=best_fi, fi_us=fi_us,
                         x_fi=fi_us / us if fi_us else None, err=rel_err(get(), base),
                         err_fi=rel_err(get(), peers[best_fi][1]) if best_fi else None))
    return rows


def table(rows: list) -> str:
    head = ("| workload | bs | kv | variant | splits | us (least) | rounds | x variant 0 | FlashInfer best "
            "| x FI | err vs 0 | err vs FI |\n|---|---:|---:|---|---|---:|---|---:|---|---:|---:|---:|\n")
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    return head + "".join(
        f"| {r['workload']} | {r['bs']} | {r['kv']} | {r['variant'] or '(as is)'} | "
        f"{r['count']}{'' if r['splits'] is None else ' (' + str(r['splits']) + ')'} | {r['us']:.1f} | "
        f"{' '.join(f'{t:.1f}' for t in r['rounds'])} | {r['x_default']:.3f} | "
        f"{'-' if r['fi'] is None else r['fi'] + ' ' + format(r['fi_us'], '.1f')} | {f(r['x_fi'], '.3f')} | "
        f"{r['err']:.1e} | {f(r['err_fi'], '.1e')} |\n" for r in rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cpu" if os.environ.get("BENCH_DEVICE") == "cpu" else "cuda"
    wl = BY_NAME[args.workload] if device == "cuda" else smoke_workload(BY_NAME[args.workload])
    fi = None
    if device == "cuda" and not args.no_flashinfer:
        fi, error = import_flashinfer()
        if fi is None:
            print(f"!! flashinfer: {error}; ours alone", flush=True)
    clock, inj, rows = Clock(device), Injector(), []
    ws = new_workspace(device) if fi is not None else None
    with inj.active():
        for bs, kv in args.points:
            new = probe_point(args, wl, bs, kv, clock, inj, fi, ws)
            rows += new
            print(table(new), flush=True)
            if args.out:                     # after every point: a run cut short keeps what it measured
                with open(args.out, "w") as f:
                    f.write(table(rows))
            if device == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
