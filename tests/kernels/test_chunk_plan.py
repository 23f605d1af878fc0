"""The MLA chunk plan (``kernels/mla/chunk_plan.py``): its wave model, the size it picks, and its kernel against the
model on the CPU (interpreter) and the GPU."""
import heapq
import random

import pytest
import torch
from kernel_refs import BIMODAL

from attn_backends_kernels.launch_record import launch
from attn_backends_kernels.mla.chunk_plan import (
    PLAN_FIXED,
    PLAN_LEVELS,
    PLAN_TOKENS,
    plan_chunks,
    planned_tiles,
    wave_estimate,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []      # the kernel on the GPU where there is one


def _tiles(lens, n=64):
    return [-(-x // n) for x in lens]


def test_plan_takes_larger_chunks_where_the_last_wave_is_nearly_empty():
    """132 SMs: BIMODAL (and its pad row) at the fit's 9 tiles a chunk and 2 programs a chunk (128 heads) leaves its
    last wave nearly empty, 12 tiles run fewer waves; at 1 program a chunk (16 heads), on a long tail and on uniform
    lengths the capped fit's size stays, and where another size is better by less than PLAN_KEEP."""
    tiles = _tiles(BIMODAL + [1])
    assert planned_tiles(tiles, 9, 2, 132, 64) == 12
    assert planned_tiles(tiles, 9, 1, 132, 64) == 9
    tail = _tiles([32768, 32768] + [300 + 53 * i for i in range(32)])
    assert planned_tiles(tail, 32, 2, 132, 64) == 32            # the cap's size: 16 chunks of each long request
    assert planned_tiles([256] * 34, 52, 2, 132, 64) == 52
    near = _tiles([302, 84, 449, 44, 7660, 567, 7426, 363, 6737, 7841, 5796, 334, 156, 5036, 5186, 6914, 4440, 3567])
    assert wave_estimate(near, 16, 2, 132, 64) < wave_estimate(near, 14, 2, 132, 64)     # better, not by PLAN_KEEP:
    assert planned_tiles(near, 14, 2, 132, 64) == 14                                     # the fit's size stays
    ties = _tiles([7554, 6985, 4379, 30, 6926, 421, 6074, 400, 5702, 7386, 40, 342, 574, 5134, 110, 256, 84, 7112,
                   386, 501, 141])
    assert wave_estimate(ties, 14, 2, 132, 64) == wave_estimate(ties, 15, 2, 132, 64)
    assert planned_tiles(ties, 12, 2, 132, 64) == 14             # of equal estimates the smaller chunk


def test_wave_model_is_a_bound_no_grid_beats():
    """``wave_estimate`` is at most PLAN_LEVELS times the finish of the chunks' programs on the SMs (each SM takes the
    next as it frees, largest first), at any size; the plan never takes a size below the fit's (whose count fits the
    grid's slots)."""
    rng = random.Random(5)
    for _ in range(200):
        tiles = [rng.choice([rng.randint(0, 30), rng.randint(60, 300)]) for _ in range(rng.randint(1, 40))]
        per, programs, sms, n = rng.randint(1, 40), rng.randint(1, 4), rng.randint(8, 140), rng.choice([32, 64])
        costs = sorted((n // PLAN_TOKENS * min(per, t - i * per) + PLAN_FIXED for t in tiles
                        for i in range(max(-(-t // per), 1)) for _ in range(programs)), reverse=True)
        free = [0] * sms
        for cost in costs:
            heapq.heappush(free, heapq.heappop(free) + cost)
        assert wave_estimate(tiles, per, programs, sms, n) <= PLAN_LEVELS * max(free)
        assert planned_tiles(tiles, per, programs, sms, n) >= per


def _plan(lens, num_chunks, programs, sms, n, cap, min_tiles=4, block_bs=None):
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.full((2,), float("nan"), device=DEVICE)
    block_bs = block_bs or max(32, 1 << (len(lens) - 1).bit_length())
    plan_chunks(seq, out, len(lens), num_chunks, programs, sms, n, cap, min_tiles, block_bs, launch)
    assert out[1].isnan()                       # one float written, no more
    return out[0].item()


def test_plan_kernel_is_its_model():
    """The kernel's size is ``planned_tiles`` of the capped fit: BIMODAL's fit (9 tiles at 4 chunks a request, the
    search of ``_balanced_per``) planned to 12 at 128 heads, kept at 16; on random batches at a plain budget (no
    search: the size ``cdiv(total, budget)``, at least 4 tiles, capped) the model's size, exactly; of two sizes of
    equal estimates the smaller; lanes past the batch (a wider block) change nothing."""
    lens = BIMODAL + [1]
    assert _plan(lens, -4 * len(lens), 2, 132, 64, 16) == 12.0
    assert _plan(lens, -4 * len(lens), 1, 132, 64, 16) == 9.0
    ties = [7554, 6985, 4379, 30, 6926, 421, 6074, 400, 5702, 7386, 40, 342, 574, 5134, 110, 256, 84, 7112, 386, 501,
            141]
    assert _plan(ties, 84, 2, 132, 64, 16) == 14.0          # the fit's 12 planned to 14, the smaller of equal estimates
    assert _plan(lens, -4 * len(lens), 2, 132, 64, 16, block_bs=256) == 12.0      # lanes past the batch count nothing
    few = [300] * 4 + [5000]                                                         # at no level of the model either:
    assert _plan(few, 10, 2, 132, 64, 16, block_bs=1024) == planned_tiles(_tiles(few), 10, 2, 132, 64) == 10.0
    rng = random.Random(7)
    for _ in range(12 if DEVICE == "cpu" else 200):
        lens = [rng.choice([rng.randint(1, 700), rng.randint(3000, 9000), 64 * rng.randint(1, 140)])  # whole tiles too
                for _ in range(rng.randint(2, 70))]
        budget, programs, sms = rng.randint(1, 5) * len(lens), rng.randint(1, 2), rng.choice([66, 132])
        n, cap = rng.choice([32, 64]), rng.choice([8, 16])
        tiles = _tiles(lens, n)
        per = max(-(-sum(tiles) // budget), 4, -(-max(tiles) // cap))
        assert _plan(lens, budget, programs, sms, n, cap) == planned_tiles(tiles, per, programs, sms, n)
