"""The sweep's points: which (distribution, bs, lengths, workloads) groups a run measures.

A grid gives the workloads, batch sizes, uniform kvs and distributions; the selection flags of
``sweep.py`` (``--dist``, ``--workloads``, ``--bs``, ``--kv``, ``--only``) narrow or replace them,
so that a run on a time budget measures a chosen subset. Grids:

* ``issue10``: issue #10's uniform grid as it was (GQA 32/8 and 64/8 d128 decode, verify N=4, tree
  N=8; MLA 16 and 128 decode and verify N=4; bs 1, 4, 16, 64, 128 x kv 2048, 8192, 32768;
  ``--quick``: bs 1, 16, 128 x kv 8192);
* ``issue40`` (the default): every distribution of ``sweep_rows.DISTS``, GQA 8/1, 28/4, 32/8 and 64/8
  at d64 and d128, MLA 16 and 128, bs 1, 3, 8, 24, 48, 64, 100, 128, uniform kv 2048, 8192, 16384,
  32768 (``--quick``: bs 3, 24, 100, uniform kv 16384).

The quick points of a grid run first in a full run too (a run cut short by its budget keeps them).
A point's workloads share one KV geometry, hence one memory and one set of requests.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Optional

from sweep_rows import (
    BATCHES,
    BY_NAME,
    DISTS,
    ISSUE10_WORKLOADS,
    KVS,
    QUICK_BATCHES,
    QUICK_KVS,
    SMOKE_BS,
    SMOKE_KV,
    WORKLOADS,
    lengths,
    smoke_lengths,
    smoke_workload,
)

GRIDS = {
    "issue10": dict(workloads=ISSUE10_WORKLOADS, batches=BATCHES, kvs=KVS, dists=("uniform",),
                    quick_batches=QUICK_BATCHES, quick_kvs=QUICK_KVS),
    "issue40": dict(workloads=WORKLOADS, batches=(1, 3, 8, 24, 48, 64, 100, 128), kvs=(2048, 8192, 16384, 32768),
                    dists=DISTS, quick_batches=(3, 24, 100), quick_kvs=(16384,)),
}
SMOKE_RAGGED_BS = 3
# --smoke's non-uniform rows: every mode of a d64 group of 7 and MLA decode (the interpreter is slow)
SMOKE_RAGGED = ("gqa28_4_d64_decode", "gqa28_4_d64_verify4", "gqa28_4_d64_tree8", "mla16_decode")


@dataclass(frozen=True)
class Point:
    dist: str
    bs: int
    kv: int              # uniform: every request's length; else the lengths' mean, rounded
    lens: tuple          # each request's KV length
    wls: tuple           # workloads of one KV geometry

    @property
    def family(self) -> str:
        return self.wls[0].family


def select_workloads(patterns: Optional[list], pool) -> list:
    """The workloads of ``pool`` whose name (or its long alias) matches one of ``patterns``
    (names or fnmatch patterns such as ``gqa*_d64_decode``), in ``pool``'s order; all without patterns.
    The MLA rows' ``*_balanced`` / ``*_split`` forms, every row's ``*_pow2`` and the GQA rows' ``*_fp8``
    forms, in no grid, are taken where named exactly."""
    if not patterns:
        return list(pool)
    # a by-name-only workload (*_balanced, *_split, *_pow2, *_fp8, #42's *_w4096 / *_cap / *_sinks) joins
    # where named exactly
    pool = list(pool) + [BY_NAME[p] for p in patterns if p in BY_NAME and BY_NAME[p] not in pool
                         and (BY_NAME[p].balanced or BY_NAME[p].split or BY_NAME[p].pow2
                              or BY_NAME[p].kv_dtype is not None or BY_NAME[p].variant or BY_NAME[p].sinks)]
    names = {w.name: {w.name} | {a for a, v in BY_NAME.items() if v.name == w.name} for w in pool}
    for p in patterns:
        if not any(fnmatch.fnmatchcase(n, p) for ns in names.values() for n in ns):
            raise ValueError(f"--workloads {p}: matches none of this grid's workloads ({', '.join(names)})")
    return [w for w in pool if any(fnmatch.fnmatchcase(n, p) for n in names[w.name] for p in patterns)]


def _point(dist: str, bs: int, kv: Optional[int], wls, seed: int, smoke: bool) -> Point:
    lens = lengths(dist, bs, seed, kv)
    if smoke and dist != "uniform":
        lens = smoke_lengths(lens)
    mean = kv if dist == "uniform" else round(sum(lens) / bs)
    return Point(dist, bs, mean, tuple(lens), tuple(wls))


def points(grid: str = "issue40", *, quick: bool = False, only: Optional[str] = None, dists=None,
           workloads=None, batches=None, kvs=None, smoke: bool = False, seed: int = 0) -> list:
    """The points of ``grid`` narrowed by the selection (None: the grid's), quick ones first."""
    if grid not in GRIDS:
        raise ValueError(f"--grid {grid}: not one of {', '.join(GRIDS)}")
    g = GRIDS[grid]
    for d in dists or ():
        if d not in DISTS:
            raise ValueError(f"--dist {d}: not one of {', '.join(DISTS)}")
    dists = list(dists or g["dists"])
    if smoke:
        return smoke_points(grid, dists, workloads, only, seed)
    wls = [w for w in select_workloads(workloads, g["workloads"]) if only in (None, w.family)]
    if not wls:
        raise ValueError(f"--only {only}: no workload of the selection is of that family")
    if kvs and "uniform" not in dists:
        raise ValueError(f"--kv {','.join(map(str, kvs))}: sets the uniform rows' kv, and --dist {','.join(dists)} "
                         "has none")
    widest = max(w.width for w in wls)
    for kv in kvs or ():
        if kv < widest:
            raise ValueError(f"--kv {kv}: below the widest query of the selection (W={widest})")
    for bs in batches or ():
        if bs < 1:
            raise ValueError(f"--bs {bs}: below 1")
    quick_b, quick_k = g["quick_batches"], g["quick_kvs"]
    batches = list(batches or (quick_b if quick else g["batches"]))
    kvs = list(kvs or (quick_k if quick else g["kvs"]))
    geoms = list(dict.fromkeys(w.geometry for w in wls))
    keys = [(d, kv, geo, bs) for d in dists for kv in (kvs if d == "uniform" else [None])
            for geo in geoms for bs in batches]
    is_quick = lambda k: k[3] in quick_b and k[1] in (None, *quick_k)  # noqa: E731
    keys.sort(key=lambda k: not is_quick(k))                           # stable: quick first, in order
    return [_point(d, bs, kv, [w for w in wls if w.geometry == geo], seed, False) for d, kv, geo, bs in keys]


def smoke_points(grid: str, dists: list, workloads, only: Optional[str], seed: int = 0) -> list:
    """The interpreter's points: uniform, every workload of issue #10 at SMOKE_BS x SMOKE_KV (one
    group per family); every other distribution (issue40's grid), SMOKE_RAGGED at
    bs SMOKE_RAGGED_BS, lengths / SMOKE_DIV; heads cut by ``smoke_workload``; a group per KV
    geometry (GQA, MLA, an FP8 cache)."""
    out = []
    for d in dists:
        names = [w.name for w in ISSUE10_WORKLOADS] if d == "uniform" else list(SMOKE_RAGGED)
        if d != "uniform" and grid == "issue10":
            raise ValueError(f"--dist {d}: the issue10 grid is uniform only")
        wls = [smoke_workload(w) for w in select_workloads(workloads, [BY_NAME[n] for n in names])
               if only in (None, w.family)]
        for geo in dict.fromkeys(w.geometry for w in wls):      # a family's, an FP8 cache's apart
            fw = [w for w in wls if w.geometry == geo]
            fam = fw[0].family
            bs = SMOKE_BS if d == "uniform" else SMOKE_RAGGED_BS
            out.append(_point(d, bs, SMOKE_KV[fam] if d == "uniform" else None, fw, seed, True))
    if not out:
        raise ValueError(f"--workloads {','.join(workloads or [])}: no smoke row of --dist {','.join(dists)}")
    return out
