"""The chunk size of MLA decode's budget of several waves, planned on the device by one program before the chunk
pass (once a step for every layer: ``balanced.mla_chunk_plan``, which ``triton_mla`` launches; or in every call:
``balanced.PLAN_WAVES``): of the capped fit's size and the sizes that cut the longest request into 1 ...
PLAN_SIZES chunks, the one a wave model of the grid ranks first. Where the capped fit leaves its last wave nearly
empty (bimodal and ragged lengths), fewer, larger chunks run fewer waves (bench/RESULTS.md, 'Ragged batches'). The
plan writes the size where the chunk pass publishes it for the merge (``ChunkLaunch.published``); the chunk pass reads
it there (``chunk_map.gluon_chunk_of``). One program: evaluated in every chunk program, the model cost each 4-60 us.

The model (``wave_estimate``): a program costs one unit every PLAN_TOKENS KV tokens and PLAN_FIXED more (~4 us
against 0.034 us a token of MLA-128's tiles, bench/probes/grid_model.py); its time is the larger of the work spread
over the SMs and, at each of PLAN_LEVELS fractions x of a full chunk, the waves of the programs of chunks costing at
least x (no grid finishes sooner). It ranks sizes, it does not time them: another size where its estimate is under
PLAN_KEEP of the capped fit's."""
import triton
import triton.language as tl

from ..chunk_kernels import _balanced_per

PLAN_TOKENS = 8
PLAN_FIXED = 15
PLAN_LEVELS = 16
PLAN_SIZES = 15
PLAN_KEEP = (17, 20)


def wave_estimate(tiles: list, per: int, programs: int, sms: int, tile_tokens: int) -> int:
    """The model's time (PLAN_LEVELS times, in its units) of chunks of ``per`` tiles of ``tile_tokens`` over requests
    of ``tiles``, ``programs`` programs a chunk on ``sms`` SMs (the grid's empty slots cost nothing in it)."""
    unit = tile_tokens // PLAN_TOKENS
    n = [max(-(-t // per), 1) for t in tiles]
    full = sum(k - 1 for k in n)
    last = [unit * (t - (k - 1) * per) + PLAN_FIXED for t, k in zip(tiles, n)]
    c = unit * per + PLAN_FIXED
    est = PLAN_LEVELS * -(-programs * (full * c + sum(last)) // sms)
    for j in range(1, PLAN_LEVELS + 1):
        m = programs * (full + sum(1 for x in last if PLAN_LEVELS * x >= j * c))
        est = max(est, -(-m // sms) * c * j)
    return est


def planned_tiles(tiles: list, per: int, programs: int, sms: int, tile_tokens: int) -> int:
    """The plan's size (tiles) from the capped fit's ``per``, as ``_mla_chunk_plan_kernel`` finds it: the smallest of
    the sizes of least estimate, where under PLAN_KEEP of ``per``'s; else ``per``. Never below ``per``, whose count
    fits the grid's slots (budget + bs)."""
    e0 = wave_estimate(tiles, per, programs, sms, tile_tokens)
    longest = max(tiles)
    sizes = {max(per, -(-longest // k)) for k in range(1, PLAN_SIZES + 1)} | {per}
    best = min(sizes, key=lambda p: (wave_estimate(tiles, p, programs, sms, tile_tokens), p))
    eb = wave_estimate(tiles, best, programs, sms, tile_tokens)
    return best if PLAN_KEEP[1] * eb < PLAN_KEEP[0] * e0 else per


@triton.jit
def _mla_chunk_plan_kernel(seq_lens_ptr, out_ptr, bs, num_chunks, programs, sms, N: tl.constexpr,
                           CAP: tl.constexpr, MIN_TILES: tl.constexpr, BLOCK_BS: tl.constexpr,
                           SIZES: tl.constexpr, LAST: tl.constexpr, LEVELS: tl.constexpr, UNIT: tl.constexpr,
                           FIXED: tl.constexpr, KEEP_NUM: tl.constexpr, KEEP_DEN: tl.constexpr):
    """``planned_tiles`` of the capped fit (``_balanced_per``, then at least the longest request's / CAP), every size
    at once (row 0 the fit's, row k <= LAST the longest request's / k, rows past LAST the fit's again: SIZES is a
    power of two), stored as float32 at ``out_ptr``."""
    offs = tl.arange(0, BLOCK_BS)
    valid = offs < bs
    tiles = (tl.load(seq_lens_ptr + offs, mask=valid, other=0) + N - 1) // N
    longest = tl.max(tiles, 0)
    per = tl.maximum(_balanced_per(tiles, valid, bs, num_chunks, MIN_TILES), (longest + CAP - 1) // CAP)
    k = tl.arange(0, SIZES)
    p = tl.maximum(per, (longest + k - 1) // tl.maximum(k, 1))                  # [SIZES]
    p = tl.where((k == 0) | (k > LAST), per, p)
    n = tl.maximum((tiles[None, :] + p[:, None] - 1) // p[:, None], 1)            # [SIZES, BLOCK_BS]
    full = tl.sum(tl.where(valid[None, :], n - 1, 0), 1).to(tl.int64)
    last = UNIT * (tiles[None, :] - (n - 1) * p[:, None]) + FIXED
    c = (UNIT * p + FIXED).to(tl.int64)
    work = programs * (full * c + tl.sum(tl.where(valid[None, :], last, 0), 1).to(tl.int64))
    est = LEVELS * ((work + sms - 1) // sms)
    for j in tl.static_range(1, LEVELS + 1):
        m = programs * (full + tl.sum((valid[None, :] & (LEVELS * last >= j * c[:, None])).to(tl.int32), 1))
        est = tl.maximum(est, ((m + sms - 1) // sms) * c * j)
    e0 = tl.sum(tl.where(k == 0, est, 0), 0)
    least = tl.min(est, 0)
    best = tl.min(tl.where(est == least, p, 2147483647), 0)
    tl.store(out_ptr, tl.where(KEEP_DEN * least < KEEP_NUM * e0, best, per).to(tl.float32))


def plan_chunks(seq_lens, out, bs: int, num_chunks: int, programs: int, sms: int, tile_tokens: int, cap: int,
                min_tiles: int, block_bs: int, launch) -> None:
    """Launch the plan: its size into ``out[0]`` (float32) for the chunk pass and the merge."""
    launch(_mla_chunk_plan_kernel, (1,), seq_lens, out, bs, num_chunks, programs, sms, N=tile_tokens, CAP=cap,
           MIN_TILES=min_tiles, BLOCK_BS=block_bs, SIZES=triton.next_power_of_2(PLAN_SIZES + 1), LAST=PLAN_SIZES,
           LEVELS=PLAN_LEVELS,
           UNIT=tile_tokens // PLAN_TOKENS, FIXED=PLAN_FIXED, KEEP_NUM=PLAN_KEEP[0], KEEP_DEN=PLAN_KEEP[1],
           num_warps=4)
