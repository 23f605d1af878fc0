"""Which chunk a program of a Gluon chunk pass runs (``wgmma._program``): ``chunk_kernels.chunk_of``'s schedule
without a window or fixed chunks, in Gluon, with the budget of several waves' cap, chunk size and dispatch order."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..schedule import MIN_CHUNK_TOKENS as _MIN_CHUNK_TOKENS

MIN_CHUNK_TOKENS = gl.constexpr(_MIN_CHUNK_TOKENS)   # the chunk schedule's shortest chunk

# The wave model of a budget of several waves (``picked_tiles``): a program costs one unit every PICK_TOKENS KV tokens
# and PICK_FIXED more (~4 us against 0.034 us a token of MLA-128's tiles, bench/probes/grid_model.py); it counts
# chunks at PICK_LEVELS fractions of a full one; another size where its estimate is under PICK_KEEP of the capped size's
# (the model ranks sizes, it does not time them: bench/RESULTS.md, 'Ragged batches').
PICK_TOKENS = gl.constexpr(8)
PICK_FIXED = gl.constexpr(15)
PICK_LEVELS = gl.constexpr(16)
PICK_KEEP = (17, 20)
PICK_KEEP_NUM = gl.constexpr(PICK_KEEP[0])
PICK_KEEP_DEN = gl.constexpr(PICK_KEEP[1])
PICK_SIZES = gl.constexpr(15)   # the sizes that cut the longest request into 1 ... PICK_SIZES chunks
# ``CHUNK_CAP`` packs the cap below PICK_SPAN and the SMs of the wave model over it (0: the capped size as it is)
PICK_SPAN = gl.constexpr(256)


def chunk_cap_arg(cap: int, sms: int) -> int:
    """The kernels' ``CHUNK_CAP`` of a cap of ``cap`` chunks a request and the wave model on ``sms`` SMs (0: none)."""
    if not 0 <= cap < PICK_SPAN.value or sms < 0 or (sms and not cap):
        raise ValueError(f"chunk_cap_arg: cap {cap} not in [0, {PICK_SPAN.value}) or SMs {sms} without a cap")
    return cap + PICK_SPAN.value * sms


def wave_estimate(tiles: list, per: int, programs: int, sms: int, tile_tokens: int) -> int:
    """The wave model's time (PICK_LEVELS times, in its cost units) of chunks of ``per`` tiles of ``tile_tokens``
    over requests of ``tiles``, ``programs`` programs a chunk on ``sms`` SMs: the larger of the work spread over the
    SMs and, at each level x, the waves of the programs of chunks that cost at least x (no grid finishes sooner)."""
    unit = tile_tokens // PICK_TOKENS.value
    n = [max(-(-t // per), 1) for t in tiles]
    full = sum(k - 1 for k in n)
    last = [unit * (t - (k - 1) * per) + PICK_FIXED.value for t, k in zip(tiles, n)]
    c, levels = unit * per + PICK_FIXED.value, PICK_LEVELS.value
    est = levels * -(-programs * (full * c + sum(last)) // sms)
    for j in range(1, levels + 1):
        m = programs * (full + sum(1 for x in last if levels * x >= j * c))
        est = max(est, -(-m // sms) * c * j)
    return est


def picked_tiles(tiles: list, per: int, programs: int, sms: int, tile_tokens: int) -> int:
    """The chunk size (tiles) that a budget of several waves runs, ``_picked`` op for op: of ``per`` (the capped fit)
    and the sizes that cut the longest request into 1 ... PICK_SIZES chunks (at least ``per``, so within the budget),
    the smallest of least ``wave_estimate``, where under PICK_KEEP of ``per``'s; else ``per``."""
    e0 = wave_estimate(tiles, per, programs, sms, tile_tokens)
    best, eb, longest = per, e0, max(tiles)
    for k in range(1, min(PICK_SIZES.value, (longest - 1) // per) + 1):
        p = max(per, -(-longest // k))
        e = wave_estimate(tiles, p, programs, sms, tile_tokens)
        best, eb = (p, e) if e <= eb else (best, eb)
    return best if PICK_KEEP[1] * eb < PICK_KEEP[0] * e0 else per


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def gluon_chunk_of(seq_lens_ptr, c, bs, num_chunks, N: gl.constexpr, CHUNK_BS: gl.constexpr,
                   CHUNK_CAP: gl.constexpr = 0):
    """``chunk_kernels.chunk_of`` without a window or fixed chunks, in Gluon: slot ``c``'s request (the last request
    past the batch's last chunk), its chunk's index in request order (the partial's slot: ``c``, but under a budget
    of several waves, ``_largest_first``), KV range ``[start, end)``, the batch's chunk count and the chunk in tiles.
    Every warp holds all ``CHUNK_BS`` (>= 32) lengths, so the sums and the scans stay within a warp: each partition
    of a warp-specialized kernel computes them alone. ``CHUNK_CAP`` > 0 (a budget of several waves:
    ``schedule.many_waves``): the chunk at least the size that cuts the longest request into ``CHUNK_CAP`` (the merge
    of a long request's many chunks cost more than the waves gave back, bench/RESULTS.md, 'Ragged batches'; the
    merge reads it published), and the slots run the largest chunks first; ``CHUNK_CAP`` over PICK_SPAN: the size of
    the wave model on ``CHUNK_CAP // PICK_SPAN`` SMs (``picked_tiles``), the cap ``CHUNK_CAP % PICK_SPAN``."""
    CAP: gl.constexpr = CHUNK_CAP % PICK_SPAN
    SMS: gl.constexpr = CHUNK_CAP // PICK_SPAN
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
    if num_chunks < 0:
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
        if SMS > 0:             # the wave model's size
            per = _picked(tiles, valid, per, gl.num_programs(0), N, SMS)
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


@gluon.jit
def _wave_estimate(tiles, valid, per, programs, N: gl.constexpr, SMS: gl.constexpr):
    """``wave_estimate`` in Gluon (int64: the work of long batches passes int32)."""
    UNIT: gl.constexpr = N // PICK_TOKENS
    n = gl.maximum((tiles + per - 1) // per, 1)
    full = gl.sum(gl.where(valid, n - 1, 0), 0).to(gl.int64)
    last = UNIT * (tiles - (n - 1) * per) + PICK_FIXED
    c = (UNIT * per + PICK_FIXED).to(gl.int64)
    work = programs * (full * c + gl.sum(gl.where(valid, last, 0), 0).to(gl.int64))
    est = PICK_LEVELS * ((work + SMS - 1) // SMS)
    for j in gl.static_range(1, PICK_LEVELS + 1):
        m = programs * (full + gl.sum((valid & (PICK_LEVELS * last >= j * c)).to(gl.int32), 0))
        est = gl.maximum(est, ((m + SMS - 1) // SMS) * c * j)
    return est


@gluon.jit
def _picked(tiles, valid, per, programs, N: gl.constexpr, SMS: gl.constexpr):
    """``picked_tiles`` in Gluon: every partition computes it alone, as the rest of the schedule."""
    longest = gl.max(tiles, 0)
    e0 = _wave_estimate(tiles, valid, per, programs, N, SMS)
    best = per
    eb = e0
    for k in range(1, gl.minimum((longest - 1) // per, PICK_SIZES) + 1):
        p = gl.maximum(per, (longest + k - 1) // k)
        e = _wave_estimate(tiles, valid, p, programs, N, SMS)
        best = gl.where(e <= eb, p, best)
        eb = gl.where(e <= eb, e, eb)
    return gl.where(PICK_KEEP_DEN * eb < PICK_KEEP_NUM * e0, best, per)
