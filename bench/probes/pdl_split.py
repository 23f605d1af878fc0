"""``merge_splits`` as a dependent launch or not (``pdl.SPLIT_MERGE_PDL``) on the split schedule's few-program rows
(GQA 8/1 d128 bs 1-4 on 128-256 splits, 28/4 d128 bs 2 on 64): graph us, off / on, the least of
interleaved rounds, and whether the outputs are bitwise equal. A tuning probe (bench/RESULTS.md, 'Ragged batches').

    python bench/probes/pdl_split.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ragged_decode as rd  # noqa: E402

import attn_backends_kernels.pdl as dependent  # noqa: E402

ROWS = ((8, 1, 128, 1, 256, "uniform"), (8, 1, 128, 2, 256, "uniform"), (8, 1, 128, 3, 128, "longtail"),
        (8, 1, 128, 4, 128, "ragged"), (28, 4, 128, 2, 64, "uniform"))      # each merged by merge_splits, not fused


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    for H, Hkv, D, bs, S, dist in ROWS:
        pg = rd.paged(rd.lengths(dist, bs), Hkv, D, torch.Generator().manual_seed(bs))
        kb, vb, _ = rd.kv_pair(pg["num_pages"] * rd.PAGE, Hkv, D, torch.bfloat16)
        q = torch.randn(bs, H, D, device="cuda", dtype=torch.bfloat16)
        times, outs = {False: [], True: []}, {}
        for _ in range(args.rounds):
            for on in (False, True):
                with mock.patch.object(dependent, "SPLIT_MERGE_PDL", on):
                    out, fn = rd.ours(pg, q, kb, vb, S, "split")
                    times[on].append(rd.graph_us(fn))
                outs[on] = out.clone()
        print(f"{H}/{Hkv} d{D} bs{bs} {dist} S={S}: off {min(times[False]):.1f} on {min(times[True]):.1f} "
              f"(rounds off {[round(t, 1) for t in times[False]]} on {[round(t, 1) for t in times[True]]}) "
              f"bitwise {torch.equal(outs[True], outs[False])}", flush=True)


if __name__ == "__main__":
    main()
