"""The chunk schedule's merge pass (``schedule.ChunkLaunch.merge_pass``) against a float64 merge of the
same partials, on tiles the other tests' shapes do not reach: MLA's fat tiles (several heads a program,
the last head block partial), several column steps a program (``DV_STEPS`` > 1: the steps after the
first reuse the first's denominator), a column count that is no multiple of the block, and a request
of more chunks than one load holds."""
import pytest
import torch

from attn_backends_kernels import schedule
from attn_backends_kernels.schedule import ChunkLaunch, merge_pass_tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []


def _chunks(lens, num_chunks, block_n, min_tiles):
    """Each request's (first chunk, chunk count): ``schedule.chunk_of``'s rule in Python."""
    tiles = [-(-n // block_n) for n in lens]
    per = max(-(-sum(tiles) // num_chunks), min_tiles)
    counts = [max(-(-t // per), 1) for t in tiles]
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    return list(zip(firsts, counts))


@pytest.mark.parametrize("single", [False, True])
def test_merge_pass_on_fat_tiles_and_column_steps(monkeypatch, single):
    monkeypatch.setattr(schedule, "MERGE_PASS_PROGRAMS", 1)     # every column in one program: DV_STEPS > 1
    lens, H, Dv, W, block_n, budget = [3000, 40, 300], 12, 520, 2, 16, 2
    bs = len(lens)
    block_c, block_hm, block_dv, steps, z = merge_pass_tiles(bs * W, H, Dv, budget)
    assert (block_c, block_hm, steps, z) == (4, 8, 5, 1), (block_c, block_hm, steps, z)
    spans = _chunks(lens, bs * budget, block_n, schedule.min_tiles(block_n))
    assert spans[0][1] > block_c                               # the long request: more chunks than a load
    slots = bs * budget + bs
    g = torch.Generator().manual_seed(0)
    part = torch.randn(slots * W, H, Dv, generator=g).to(DEVICE)
    lse = (torch.randn(slots * W, H, generator=g) * 4).to(DEVICE)
    out = torch.full((bs * W, H, Dv), float("nan"), device=DEVICE)
    cl = ChunkLaunch(part, lse, torch.zeros(bs, dtype=torch.int32, device=DEVICE), bs * budget, (1, 1),
                     dict(MIN_TILES=schedule.min_tiles(block_n), FIXED_TILES=0, BLOCK_BS=4), bs, W, block_n, "chunks")
    cl.merge_pass(torch.tensor(lens, dtype=torch.int32, device=DEVICE), None, out, single=single)
    for b, (first, count) in enumerate(spans):
        rows = [(first + c) * W + j for j in range(W) for c in range(count)]
        got = out[b * W:(b + 1) * W].double().cpu()
        if count == 1 and not single:                          # written by the chunk pass itself: left alone
            assert got.isnan().all()
            continue
        ls = lse.double().cpu()[rows].view(W, count, H)
        ps = part.double().cpu()[rows].view(W, count, H, Dv)
        w = torch.exp2(ls - ls.amax(1, keepdim=True))
        want = (w[..., None] * ps).sum(1) / w.sum(1)[..., None]
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (b, (got - want).abs().max())
