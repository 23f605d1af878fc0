"""Which chunk a program of a Gluon chunk pass runs (``wgmma._program``): ``chunk_kernels.chunk_of``'s schedule
without a window or fixed chunks, in Gluon, with the budget of several waves' cap, planned size and dispatch order."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..schedule import MIN_CHUNK_TOKENS as _MIN_CHUNK_TOKENS

MIN_CHUNK_TOKENS = gl.constexpr(_MIN_CHUNK_TOKENS)   # the chunk schedule's shortest chunk
# ``CHUNK_CAP`` at least PLANNED: the chunk size planned before the launch (``chunk_plan``), the cap CHUNK_CAP - PLANNED
PLANNED = gl.constexpr(256)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def gluon_chunk_of(seq_lens_ptr, plan_ptr, c, bs, num_chunks, N: gl.constexpr, CHUNK_BS: gl.constexpr,
                   CHUNK_CAP: gl.constexpr = 0):
    """``chunk_kernels.chunk_of`` without a window or fixed chunks, in Gluon: slot ``c``'s request (the last request
    past the batch's last chunk), its chunk's index in request order (the partial's slot: ``c``, but under a budget
    of several waves, ``_largest_first``), KV range ``[start, end)``, the batch's chunk count and the chunk in
    tiles. Every warp holds all ``CHUNK_BS`` (>= 32) lengths, so the sums and the scans stay within a warp: each
    partition of a warp-specialized kernel computes them alone. ``CHUNK_CAP`` > 0 (a budget of several waves:
    ``schedule.many_waves``): the chunk at least the size that cuts the longest request into ``CHUNK_CAP % PLANNED``
    (the merge of a long request's many chunks cost more than the waves gave back, bench/RESULTS.md, 'Ragged
    batches'; the merge reads it published), and the slots run the largest chunks first. ``CHUNK_CAP`` >= PLANNED:
    the chunk size planned at ``plan_ptr`` (``chunk_plan``; float32) instead of the fit's search."""
    CAP: gl.constexpr = CHUNK_CAP % PLANNED
    L: gl.constexpr = gl.BlockedLayout([CHUNK_BS // 32], [32], [gl.num_warps()], [0])
    MIN_TILES: gl.constexpr = MIN_CHUNK_TOKENS // N
    offs = gl.arange(0, CHUNK_BS, layout=L)
    lens = gl.load(seq_lens_ptr + offs, mask=offs < bs, other=0)
    tiles = (lens + N - 1) // N
    valid = offs < bs
    # chunk_kernels._balanced_per, op for op but the cap (the merge pass recomputes the schedule in Triton, or reads
    # this `per`: always where the cap applies)
    budget = gl.maximum(num_chunks, -num_chunks)
    total = gl.sum(tiles, 0)
    per = gl.maximum((total + budget - 1) // budget, MIN_TILES)
    if CHUNK_CAP >= PLANNED:
        per = gl.load(plan_ptr).to(gl.int32)
    elif num_chunks < 0:
        over = gl.sum(gl.where(valid, gl.maximum((tiles + per - 1) // per, 1), 0), 0) > budget
        hi = gl.maximum(gl.max(tiles, 0), per)
        hi = gl.where(budget > bs, gl.minimum(hi, gl.maximum((total + budget - bs - 1) // gl.maximum(budget - bs, 1),
                                                             per)), hi)
        lo = per
        hi = gl.where(over & (budget >= bs), hi, per)
        if CAP > 0:             # the search finds at most hi: where hi already cuts into more than CAP, the cap
            lo = gl.where((gl.max(tiles, 0) + CAP - 1) // CAP > hi, hi, lo)     # holds: no search
        while lo < hi:
            mid = (lo + hi) // 2
            fits = gl.sum(gl.where(valid, gl.maximum((tiles + mid - 1) // mid, 1), 0), 0) <= budget
            hi = gl.where(fits, mid, hi)
            lo = gl.where(fits, lo, mid + 1)
        per = gl.where(3 * (hi + MIN_TILES) <= 4 * (per + MIN_TILES), hi, per)
        if CAP > 0:             # the longest request in at most CAP chunks
            per = gl.maximum(per, (gl.max(tiles, 0) + CAP - 1) // CAP)
    n = gl.where(valid, gl.maximum((tiles + per - 1) // per, 1), 0)
    ends = gl.associative_scan(n, 0, _add)
    total = gl.sum(n, 0)
    k = c
    if CAP > 0:
        k = _largest_first(c, n, ends, tiles, per, offs, valid, bs)
    b = gl.minimum(gl.sum((ends <= k).to(gl.int32), 0), bs - 1)
    mine = offs == b
    first = gl.sum(gl.where(mine, ends - n, 0), 0)
    start = (k - first) * per * N
    return b, k, start, gl.minimum(start + per * N, gl.sum(gl.where(mine, lens, 0), 0)), total, per


@gluon.jit
def _largest_first(c, n, ends, tiles, per, offs, valid, bs):
    """The chunk (its index in request order) that slot ``c`` of a budget of several waves runs: the longest first,
    as the SMs free (a long request's chunks dispatched last ran a wave of their own behind the short ones: bench/
    RESULTS.md, 'Ragged batches'). Every request's chunks but its last are full, in request order; then the last
    chunks by their tiles, descending (request order among equals), the rank found by bisection on the tiles."""
    full = n - 1
    full_ends = gl.associative_scan(gl.maximum(full, 0), 0, _add)
    num_full = gl.sum(gl.maximum(full, 0), 0)
    bf = gl.minimum(gl.sum((full_ends <= c).to(gl.int32), 0), bs - 1)
    k_full = c + gl.sum(gl.where(offs == bf, (ends - n) - (full_ends - full), 0), 0)
    last = gl.where(valid, tiles - full * per, -1)      # a last chunk's tiles; -1 past the batch
    q = c - num_full                                    # the rank sought among the last chunks
    lo = per * 0
    hi = per
    while lo < hi:          # the largest v with more than q last chunks of at least v tiles
        mid = (lo + hi + 1) // 2
        more = gl.sum((last >= mid).to(gl.int32), 0) > q
        lo = gl.where(more, mid, lo)
        hi = gl.where(more, hi, mid - 1)
    ties = gl.associative_scan((last == lo).to(gl.int32), 0, _add)
    br = gl.minimum(gl.sum((ties <= q - gl.sum((last > lo).to(gl.int32), 0)).to(gl.int32), 0), bs - 1)
    k_last = gl.sum(gl.where(offs == br, ends, 0), 0) - 1
    return gl.where(c < num_full, k_full, gl.where(c < num_full + bs, k_last, c))
