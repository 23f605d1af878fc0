"""A model of MLA decode's chunk pass on a budget of chunks: which order the grid's slots should run the chunks in,
without a GPU (issue #40).

    python bench/probes/grid_model.py [--rows 128x1:67,16x1:80/4] [--dists longtail,bimodal] [--caps 16,8]

Per row (heads x 1 : batch [/ chunks a request; else the budget of several waves ``schedule.many_waves`` gives]) and
length distribution (``bench/sweep``'s): the chunk size of ``chunk_map.gluon_chunk_of`` under the wave fit and a cap
(the longest request in at most ``cap`` chunks), its chunks, and the time of the grid when every SM takes the next
slot as it frees (one program an SM, ``heads / 64`` programs a chunk, 16 heads one), a program costing ``--fixed-us``
plus ``--token-us`` a KV token, slots in request order ("request") or largest first ("largest": ``_largest_first``).
The constants are MLA-128's uniform rows' (bench/RESULTS.md, 'Ragged batches', session 71); the merge, the launches
and a chunk's pipeline fill are not in it: it ranks orders and sizes (session 71's MLA-128 bs 48-96: uniform, ragged
and bimodal rows within 9 % of the graph's time either side, long tails 17-34 % under it), it does not predict a row.
"""
from __future__ import annotations

import argparse
import heapq
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sweep"))
from sweep_rows import lengths  # noqa: E402

from attn_backends_kernels.launch_record import cdiv  # noqa: E402
from attn_backends_kernels.mla.wgmma import TILE_TOKENS as TILE  # noqa: E402
from attn_backends_kernels.schedule import MIN_CHUNK_TOKENS, many_waves  # noqa: E402

MIN_TILES = MIN_CHUNK_TOKENS // TILE


def chunk_tiles(lens: list, budget: int, cap: int) -> int:
    """``gluon_chunk_of``'s chunk in tiles under the wave fit (a budget of ``budget`` chunks) and ``cap`` (0: none)."""
    tiles = [cdiv(n, TILE) for n in lens]
    total, bs = sum(tiles), len(tiles)
    per = max(cdiv(total, budget), MIN_TILES)

    def count(p: int) -> int:
        return sum(max(cdiv(t, p), 1) for t in tiles)
    hi = max(max(tiles), per)
    if budget > bs:
        hi = min(hi, max(cdiv(total, max(budget - bs, 1)), per))
    if not (count(per) > budget and budget >= bs):
        hi = per
    lo = hi if cap and cdiv(max(tiles), cap) > hi else per
    while lo < hi:                      # the smallest chunk whose count fits the budget
        mid = (lo + hi) // 2
        hi, lo = (mid, lo) if count(mid) <= budget else (hi, mid + 1)
    per = hi if 3 * (hi + MIN_TILES) <= 4 * (per + MIN_TILES) else per
    return max(per, cdiv(max(tiles), cap)) if cap else per


def chunk_tokens(lens: list, per: int, order: str) -> list:
    """The KV tokens of each chunk, in the order the slots run them."""
    sizes = []
    for n in lens:
        k = max(cdiv(cdiv(n, TILE), per), 1)
        sizes += [min(per * TILE, n - i * per * TILE) for i in range(k)]
    return sorted(sizes, reverse=True) if order == "largest" else sizes


def grid_us(sizes: list, programs_a_chunk: int, empty: int, sms: int, fixed_us: float, token_us: float) -> float:
    """The last SM's finish when each SM takes the next program as it frees (``empty`` slots past the chunks last)."""
    free = [0.0] * sms
    for n in [s for s in sizes for _ in range(programs_a_chunk)] + [None] * empty * programs_a_chunk:
        t = heapq.heappop(free)
        heapq.heappush(free, t + (fixed_us / 4 if n is None else fixed_us + token_us * n))
    return max(free)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="128x1:48,128x1:67,128x1:80,128x1:96")
    ap.add_argument("--dists", default="uniform,ragged,longtail,bimodal")
    ap.add_argument("--caps", default="16")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--fixed-us", type=float, default=4.0)
    ap.add_argument("--token-us", type=float, default=0.034)
    args = ap.parse_args(argv)
    for spec in args.rows.split(","):
        hw, batch = spec.split(":")
        heads = int(hw.split("x")[0])
        bs, _, count = batch.partition("/")
        bs, programs = int(bs), int(bs) * max(1, heads // 64)
        per_request = int(count) if count else many_waves(programs, args.sms)
        for dist in args.dists.split(","):
            lens = lengths(dist, bs, kv=16384)
            for cap in (int(c) for c in args.caps.split(",")):
                per = chunk_tiles(lens, bs * per_request, cap)
                out = []
                for order in ("request", "largest"):
                    sizes = chunk_tokens(lens, per, order)
                    us = grid_us(sizes, max(1, heads // 64), bs * per_request + bs - len(sizes), args.sms,
                                 args.fixed_us, args.token_us)
                    out.append(f"{order} {us:.1f}")
                print(f"mla{heads} bs{bs}/{per_request} {dist} cap {cap}: chunk {per * TILE} tokens, "
                      f"{len(sizes)} chunks; model us " + " / ".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
