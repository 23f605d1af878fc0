"""How a sweep row's graph time follows the SM clock, ours against FlashInfer's: after seconds of
back-to-back replays of one implementation (``--load``: ours, FlashInfer, both in turn, or idle),
which can draw the card to its power cap and lower the SM clock, each implementation is timed as
the sweep times it (``sweep_timing.Clock.gpu_us``) between two readings of the SM clock (cycles of
``torch.cuda._sleep`` over its event time). Prints each timing with its clock, then per implementation
the times at the highest and the lowest clocks seen. A probe for the rows that run slower inside the
sweep's rounds than alone (bench/RESULTS.md, 'Ragged batches').

    PYTHONPATH=$PWD:bench/sweep python bench/probes/clock_sensitivity.py --rows gqa28_4_d128_decode:32:uniform \
        [--configs fi_decode_tc_fa2,fi_prefill_fa2] [--load-s 2] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import flashinfer
import torch
import triton
from backend_vs_kernel import load as replays
from sweep_flashinfer import Peer, fi_inputs, new_workspace
from sweep_ours import Ours
from sweep_rows import BY_NAME, build_group, build_row, lengths
from sweep_timing import Clock, capture

SLEEP_CYCLES = 2_000_000      # about 1 ms at the H200's 1980 MHz: the events' resolution is far below


def sm_mhz() -> float:
    """The SM clock now: a fixed count of cycles spun on the device over its event time."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    end.record()
    end.synchronize()
    return SLEEP_CYCLES / (start.elapsed_time(end) * 1e3)


def load(fns, seconds: float) -> None:
    """The calls of ``fns`` in turn for ``seconds`` (``backend_vs_kernel.load``); none: idle."""
    if fns:
        replays(lambda: [fn() for fn in fns], seconds)
    else:
        time.sleep(seconds)


def row_graphs(spec: str, kv: int, configs: list, ws) -> dict:
    """``{impl: replay}`` of one row: ours through the backend contract, each FlashInfer
    configuration with its graph buffers; every output checked against ours."""
    name, bs, dist = spec.split(":")
    wl, bs = BY_NAME[name], int(bs)
    row = build_row(build_group(wl, bs, kv, "cuda", lens=lengths(dist, bs, kv=kv), dist=dist), wl)
    ours = Ours(row)
    g, out = ours.graph()
    g.replay()
    torch.cuda.synchronize()
    graphs, keep = {"ours": g.replay}, [ours, g]
    inp = fi_inputs(row, ours.layout())
    for config in configs:
        peer = Peer(flashinfer, config, inp, ws, graph=True)
        pg, pout = capture(peer.fn())
        pg.replay()
        torch.cuda.synchronize()
        err = ((pout.float() - out.float()).abs().max() / out.float().abs().max()).item()
        assert err < 2e-2, f"{spec} {config}: relative difference {err:.2e} from ours"
        graphs[config] = pg.replay
        keep += [peer, pg]
    graphs["_keep"] = keep
    return graphs


def summary(samples: list) -> str:
    """Median time at the third of the samples of highest clocks, and at the third of lowest."""
    by_clock = sorted(samples)
    third = max(1, len(by_clock) // 3)
    lo, hi = by_clock[:third], by_clock[-third:]
    t_hi, t_lo = statistics.median(t for _, t in hi), statistics.median(t for _, t in lo)
    return (f"{statistics.median(m for m, _ in hi):6.0f} MHz {t_hi:8.1f} us | "
            f"{statistics.median(m for m, _ in lo):6.0f} MHz {t_lo:8.1f} us | slower by {t_lo / t_hi - 1:+.1%}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="gqa28_4_d128_decode:32:uniform",
                   help="workload:bs:dist, comma-separated (GQA workloads of bench/sweep/sweep_rows.py)")
    p.add_argument("--configs", default="fi_decode_tc_fa2,fi_prefill_fa2", help="FlashInfer configurations")
    p.add_argument("--kv", type=int, default=16384, help="the uniform rows' KV length")
    p.add_argument("--load-s", type=float, default=2.0, help="seconds of replays before each set of timings")
    p.add_argument("--repeats", type=int, default=3, help="passes over the loads")
    p.add_argument("--once", action="store_true", help="replay each graph once and stop (under a profiler)")
    args = p.parse_args(argv)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          "flashinfer", flashinfer.__version__)
    clock, ws = Clock("cuda"), new_workspace("cuda")
    for spec in args.rows.split(","):
        graphs = row_graphs(spec, args.kv, args.configs.split(","), ws)
        impls = [k for k in graphs if not k.startswith("_")]
        if args.once:
            for k in impls:
                graphs[k]()
            torch.cuda.synchronize()
            continue
        loads = {"idle": [], "ours": [graphs["ours"]], "fi": [graphs[k] for k in impls[1:]],
                 "all": [graphs[k] for k in impls]}
        samples = {k: [] for k in impls}
        for rep in range(args.repeats):
            for lname, fns in loads.items():
                load(fns, args.load_s)
                for k in impls[rep % len(impls):] + impls[:rep % len(impls)]:
                    before = sm_mhz()
                    us = clock.gpu_us(graphs[k])
                    mhz = (before + sm_mhz()) / 2
                    samples[k].append((mhz, us))
                    print(f"{spec} load {lname:<4} {k:<18} {mhz:6.0f} MHz {us:8.1f} us", flush=True)
        for k in impls:
            print(f"{spec} {k:<18} high clocks {summary(samples[k])}")


if __name__ == "__main__":
    main()
