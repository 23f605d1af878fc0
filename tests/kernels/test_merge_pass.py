"""The chunk schedule's merge pass (``schedule.ChunkLaunch.merge_pass``) against a float64 merge of the
same partials, on tiles the other tests' shapes do not reach: MLA's fat tiles (several heads a program,
the last head block partial), several column steps a program (``DV_STEPS`` > 1: the steps after the
first reuse the first's denominator), a column count that is no multiple of the block, and a request
of more chunks than one load holds."""
import dataclasses

import pytest
import torch
import triton

from attn_backends_kernels import chunk_kernels, schedule
from attn_backends_kernels.chunk_kernels import merge_pass_tiles, merge_pass_warps
from attn_backends_kernels.launch_record import recording
from attn_backends_kernels.schedule import ChunkLaunch, chunk_workspace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []


def _chunks(lens, num_chunks, block_n, min_tiles):
    """Each request's (first chunk, chunk count): ``chunk_kernels.chunk_of``'s rule in Python."""
    tiles = [-(-n // block_n) for n in lens]
    per = max(-(-sum(tiles) // num_chunks), min_tiles)
    counts = [max(-(-t // per), 1) for t in tiles]
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    return list(zip(firsts, counts))


def _merge_against_float64(lens, H, Dv, W, block_n, budget, single=False, least=None, dead=(), spikes=(),
                           part_dtype=torch.float32, launched=None):
    """The merge pass over random partials of ``lens`` against a float64 merge; requests in ``dead`` have every
    log-sum-exp -inf (their chunks saw nothing: zeros). ``least``: the chunk's floor in tiles. ``spikes``: these
    requests' last chunk 300 above the rest in head 0 (2^300 overflows float32 unless the maximum saw it). Returns
    the spans. ``part_dtype``: the partials' (16-bit as MLA's warp-specialized chunk passes store them).
    ``launched``: a dict given the output (``out``) and the merge launch's keyword arguments."""
    bs = len(lens)
    least = least or schedule.min_tiles(block_n)
    spans = _chunks(lens, bs * budget, block_n, least)
    slots = bs * budget + bs
    g = torch.Generator().manual_seed(0)
    part = torch.randn(slots * W, H, Dv, generator=g).to(DEVICE, part_dtype)
    lse = torch.randn(slots * W, H, generator=g) * 4
    for b in dead:
        first, count = spans[b]
        lse[first * W:(first + count) * W] = float("-inf")
    for b in spikes:                                           # one head: the other checks the whole merge
        first, count = spans[b]
        lse[(first + count - 1) * W:(first + count) * W, 0] += 300.0
    lse = lse.to(DEVICE)
    out = torch.full((bs * W, H, Dv), float("nan"), device=DEVICE)
    cl = ChunkLaunch(part, lse, torch.zeros(bs, dtype=torch.int32, device=DEVICE), bs * budget, (1, 1),
                     dict(MIN_TILES=least, FIXED_TILES=0, BLOCK_BS=triton.next_power_of_2(bs)), bs, W, block_n,
                     "chunks")
    with recording() as launches:
        cl.merge_pass(torch.tensor(lens, dtype=torch.int32, device=DEVICE), None, out, single=single)
    if launched is not None:
        launched.update(launches[0][4], out=out)
    for b, (first, count) in enumerate(spans):
        rows = [(first + c) * W + j for j in range(W) for c in range(count)]
        got = out[b * W:(b + 1) * W].double().cpu()
        if count == 1 and not single:                          # written by the chunk pass itself: left alone
            assert got.isnan().all()
            continue
        if b in dead:
            assert torch.equal(got, torch.zeros_like(got)), (b, got.abs().max())
            continue
        ls = lse.double().cpu()[rows].view(W, count, H)
        ps = part.double().cpu()[rows].view(W, count, H, Dv)
        w = torch.exp2(ls - ls.amax(1, keepdim=True))
        want = (w[..., None] * ps).sum(1) / w.sum(1)[..., None]
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (b, (got - want).abs().max())
    return spans


@pytest.mark.parametrize("single", [False, True])
def test_merge_pass_on_fat_tiles_and_column_steps(monkeypatch, single):
    monkeypatch.setattr(chunk_kernels, "MERGE_PASS_PROGRAMS", 1)     # every column in one program: DV_STEPS > 1
    lens, H, Dv, W, block_n, budget = [3000, 40, 300], 12, 520, 2, 16, 2
    block_c, block_hm, block_dv, steps, z = merge_pass_tiles(len(lens) * W, H, Dv, budget, W == 1)
    assert (block_c, block_hm, steps, z) == (4, 8, 5, 1), (block_c, block_hm, steps, z)
    spans = _merge_against_float64(lens, H, Dv, W, block_n, budget, single)
    assert spans[0][1] > block_c                               # the long request: more chunks than a load


@pytest.mark.parametrize("budget,tiles", [(5, (8, 4, 5, 1)), (10, (16, 2, 5, 1))])
@pytest.mark.parametrize("part_dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_merge_on_fat_tiles(monkeypatch, part_dtype, budget, tiles):
    """MLA's decode at 5 chunks a request: fat tiles of 8 chunks and 4 heads (the last head block partial; at 10, of
    16 chunks and 2 heads: MLA-16 bs 13, request 3 then of 4 chunks), every
    column step in one program, a request of more chunks than a load (its last chunk far above the rest), the
    single-chunk requests' partials merged too (the Gluon chunk pass writes every chunk's), one request whose chunks
    saw nothing (zeros); float32 partials at 4 warps, bfloat16 at 2 (``merge_pass_warps``); the requests of at most a
    load's chunks in one round of loads (``_merge_one_load``: request 3, of 3 chunks at 5 a request and 4 at 10, the
    last far above the rest), the long
    one in two walks, the sum's prefetched over float32 partials (each column step's first load apart)."""
    monkeypatch.setattr(chunk_kernels, "MERGE_PASS_LATENT_PROGRAMS", 1)    # every column in one program
    monkeypatch.setattr(chunk_kernels, "MERGE_PASS_ONE_LOAD", True)
    monkeypatch.setattr(chunk_kernels, "MERGE_PASS_PREFETCH", True)
    lens, H, Dv, W, block_n = [6000, 40, 300, 900, 900], 14, 520, 1, 16
    block_c, block_hm, _, steps, z = merge_pass_tiles(len(lens), H, Dv, budget, True)
    assert (block_c, block_hm, steps, z) == tiles, (block_c, block_hm, steps, z)
    spans = _merge_against_float64(lens, H, Dv, W, block_n, budget, single=True, spikes=(0, 3), part_dtype=part_dtype,
                                   dead=(4,))
    assert spans[0][1] > block_c and min(c for _, c in spans) == 1 and 1 < spans[3][1] <= block_c, spans


@pytest.mark.parametrize("W", [1, 3])
def test_a_published_chunk_size_is_the_one_the_merge_uses(W):
    """``ChunkLaunch.published``: the merge reads the chunk size from the log-sum-exp row past the grid's slots
    (where MLA's Gluon chunk pass writes it under the wave fit) instead of searching: the fit's size there merges
    as the search does, the plain share there (8 tiles, not the fit's 24) merges otherwise."""
    lens, block_n, budget, H, Dv = [16384, 256, 512], 32, 8, 4, 64
    bs = len(lens)
    part, lse, counters = chunk_workspace(bs, budget, W, H, 1, Dv, DEVICE)
    assert lse.shape[0] == part.shape[0] + schedule.SCHEDULE_ROWS == (bs * budget + bs) * W + 1
    g = torch.Generator().manual_seed(0)
    part.copy_(torch.randn(part.shape, generator=g))
    lse.copy_(torch.randn(lse.shape, generator=g))
    cl = ChunkLaunch(part, lse, counters, bs * budget, (1, 1), dict(MIN_TILES=schedule.min_tiles(block_n),
                     FIXED_TILES=0, BLOCK_BS=triton.next_power_of_2(bs)), bs, W, block_n, "chunks", fit=True)
    seq = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    outs = {}
    for name, published, per in (("search", False, None), ("fit", True, 24.0), ("plain", True, 8.0)):
        if per is not None:
            lse[(bs * budget + bs) * W, 0] = per
        out = torch.zeros(bs * W, H, Dv, device=DEVICE)
        dataclasses.replace(cl, published=published).merge_pass(seq, None, out, single=True)
        outs[name] = out
    assert torch.equal(outs["search"], outs["fit"])
    assert not torch.equal(outs["search"], outs["plain"])


def test_merge_pass_loads_64_chunks_on_wide_decode_budgets():
    """16 chunks a load below a decode budget of 16 chunks a request (and the invariant schedule's 0), 64 from
    it on at Dv <= 256, 128 over 64 columns a program from 32 on (the other columns on the grid); several rows
    a chunk (verify) and MLA's latent keep 16 (fat tiles on budgets of 1-16 in decode, 1-2 in verify: 4 chunks, 8
    from 5, 16 from 9, of as many heads as fill 4,096 values)."""
    assert [merge_pass_tiles(8, 8, 128, c)[0] for c in (0, 2, 15, 16, 31, 32, 64)] == [16, 16, 16, 64, 64, 128, 128]
    assert merge_pass_tiles(8, 8, 128, 16) == (64, 1, 128, 1, 1)
    assert merge_pass_tiles(8, 8, 128, 32) == (128, 1, 64, 1, 2)
    assert merge_pass_tiles(8, 8, 256, 16)[0] == 64
    assert merge_pass_tiles(8, 8, 256, 32) == (128, 1, 64, 1, 4)
    assert merge_pass_tiles(8, 8, 128, 64, one_row=False)[0] == 16
    assert ([merge_pass_tiles(8, 16, 512, c)[:2] for c in (2, 3, 5, 8, 9, 16, 17)]
            == [(4, 8), (4, 8), (8, 4), (8, 4), (16, 2), (16, 2), (16, 1)])
    assert [merge_pass_tiles(8, 16, 512, c, one_row=False)[0] for c in (2, 3, 5)] == [4, 16, 16]


def test_mla_decode_merge_puts_its_columns_on_the_grid_while_programs_are_few():
    """MLA's decode: the latent's 4 column blocks on the grid, doubled while the programs (rows x head blocks x
    column blocks) are under MERGE_PASS_LATENT_PROGRAMS, over fat tiles of 8 heads (MLA-128 at 1-2 chunks a
    request: bs 24 384 x 4, bs 48 768 x 4, bs 100 1,600 x 2, bs 128 2,048 x 1), of 4 heads and 8 chunks (MLA-16
    bs 24 and MLA-128 bs 13 at 5 chunks a request: 96 x 4, 416 x 4), of 2 heads and 16 chunks (MLA-16 bs 13 at
    10: 104 x 4) or one head (past 16 chunks a request: MLA-16 bs 7 at 18, 112 x 4); verify (4 rows a
    chunk: 512 x 1 where decode would take 2) and
    GQA's head dims keep MERGE_PASS_PROGRAMS."""
    assert merge_pass_tiles(24, 128, 512, 2) == (4, 8, 128, 1, 4)
    assert merge_pass_tiles(48, 128, 512, 1) == (4, 8, 128, 1, 4)
    assert merge_pass_tiles(100, 128, 512, 1) == (4, 8, 128, 2, 2)
    assert merge_pass_tiles(128, 128, 512, 2) == (4, 8, 128, 4, 1)
    assert merge_pass_tiles(32, 128, 512, 2, one_row=False) == (4, 8, 128, 4, 1)
    assert merge_pass_tiles(24, 16, 512, 5) == (8, 4, 128, 1, 4)
    assert merge_pass_tiles(13, 16, 512, 10) == (16, 2, 128, 1, 4)
    assert merge_pass_tiles(7, 16, 512, 18) == (16, 1, 128, 1, 4)
    assert merge_pass_tiles(13, 128, 512, 5) == (8, 4, 128, 1, 4)
    assert merge_pass_tiles(48, 8, 256, 4) == (16, 1, 128, 2, 1)


@pytest.mark.parametrize("prefetch,block_c,block_dv,Dv,steps", [
    (True, 16, 128, 128, 1), (True, 64, 128, 128, 1), (False, 16, 128, 128, 1), (False, 64, 128, 128, 1),
    (False, 64, 32, 128, 1), (False, 64, 64, 96, 1), (True, 16, 128, 256, 2), (False, 16, 128, 256, 2),
    (True, 16, 128, 256, 1), (True, 16, 128, 96, 1)])
def test_merge_pass_of_a_long_request(monkeypatch, prefetch, block_c, block_dv, Dv, steps):
    """GQA's tiles (a head and 128 columns a program, or 32 or 64 and the rest over the grid, the last block partial
    at Dv 96: ``MERGE_PASS_DEEP_*``; at Dv 256 two column steps a program, or one and two column blocks on the grid)
    over a request of hundreds of chunks beside short ones, the sum's walk prefetched or not (``MERGE_PASS_PREFETCH``;
    never on the deep tiles: ``merge_pass_prefetch``), 16 or 64 chunks a load, the long request's last chunk far
    above the rest (the maximum must see every load); a request whose chunks saw nothing merges to zeros."""
    monkeypatch.setattr(chunk_kernels, "MERGE_PASS_PREFETCH", prefetch)
    monkeypatch.setattr(chunk_kernels, "MERGE_PASS_CHUNKS", block_c)
    monkeypatch.setattr(chunk_kernels, "MERGE_PASS_WIDE_CHUNKS", block_c)
    monkeypatch.setattr(chunk_kernels, "MERGE_PASS_DEEP_FROM", 1 << 30 if block_dv == 128 else 1)
    monkeypatch.setattr(chunk_kernels, "MERGE_PASS_DEEP_CHUNKS", block_c)
    monkeypatch.setattr(chunk_kernels, "MERGE_PASS_DEEP_DV", block_dv)
    if steps > 1:
        monkeypatch.setattr(chunk_kernels, "MERGE_PASS_PROGRAMS", 1)     # every column in one program
    lens, H, W, block_n, budget = [20000, 300, 5, 700], 2, 1, 16, 64
    assert merge_pass_tiles(len(lens) * W, H, Dv, budget) == (block_c, 1, block_dv, steps, -(-Dv // block_dv) // steps)
    launched = {}
    spans = _merge_against_float64(lens, H, Dv, W, block_n, budget, least=1, dead=(3,), spikes=(0,),
                                   launched=launched)
    assert spans[0][1] > 3 * block_c and spans[3][1] > 1, spans
    assert launched["PREFETCH"] is prefetch, launched["PREFETCH"]


@pytest.mark.parametrize("H, Dv, budget, patch, part_dtype, tiles", [
    (2, 96, 16, dict(MERGE_PASS_WIDE_CHUNKS=16), torch.bfloat16, (16, 1, 128, 1, 1)),    # wide, a partial column block
    (2, 512, 64, dict(MERGE_PASS_LATENT_PROGRAMS=16), torch.bfloat16, (16, 1, 128, 2, 2)),   # steps and grid blocks
    (14, 520, 5, dict(MERGE_PASS_LATENT_PROGRAMS=40), torch.float32, (8, 4, 128, 3, 2)),     # MLA-16's fat tiles
])
def test_the_prefetched_merge_is_the_plain_one_bit_for_bit(monkeypatch, H, Dv, budget, patch, part_dtype, tiles):
    """The merge pass with its sum's walk prefetched (``MERGE_PASS_PREFETCH``) writes what the plain walk writes, bit
    for bit (the same chunks in the same order: the batch-invariant mode's fixed merge order), on tiles the rule
    prefetches: GQA's wide ones at a partial column block, MLA's one-head tiles at two column steps a program over two
    grid blocks, MLA-16's fat tiles of float32 partials at three steps (the last past Dv) over two blocks; each
    against the float64 merge too."""
    for name, value in patch.items():
        monkeypatch.setattr(chunk_kernels, name, value)
    lens = [20000, 300, 5, 700, 900]
    assert merge_pass_tiles(len(lens), H, Dv, budget) == tiles
    outs = {}
    for prefetch in (True, False):
        monkeypatch.setattr(chunk_kernels, "MERGE_PASS_PREFETCH", prefetch)
        launched = {}
        spans = _merge_against_float64(lens, H, Dv, 1, 16, budget, single=True, least=1, dead=(3,), spikes=(0,),
                                       part_dtype=part_dtype, launched=launched)
        assert launched["PREFETCH"] is prefetch and launched["DV_STEPS"] == tiles[3], launched
        outs[prefetch] = launched["out"]
    assert spans[0][1] > 2 * tiles[0], spans
    assert torch.equal(outs[True], outs[False]), (outs[True] - outs[False]).abs().max()


@pytest.mark.parametrize("few", [0, 8])
def test_few_chunk_requests_merged_by_their_last_chunk_the_rest_by_the_pass(monkeypatch, few):
    """Decode's merge="pass" at a budget of 4 chunks a request with ``DECODE_FEW_LAST`` (0: off; 8: requests of at
    most pow2(4) chunks): requests of 1 to 5 and 11 chunks, those of at most 4 merged by their last chunk program in
    one load, the others by the pass, each exactly once: a request the chunk pass left to a pass that skipped it stays
    NaN (output and workspace start as NaN); the counters end at 0."""
    from kernel_refs import assert_close
    from test_decode_attention import run_chunked

    from attn_backends_kernels import decode_attention
    monkeypatch.setattr(decode_attention, "DECODE_FEW_LAST", few)
    lens = [64, 128, 192, 256, 320, 700]                      # 64-token chunks: 1, 2, 3, 4, 5 and 11 of them
    dtype, tol = (torch.bfloat16, 2e-2) if DEVICE == "cuda" else (torch.float32, 1e-5)
    out, ref, ws = run_chunked(lens, 16, 4, 2, 16, 4, dtype, DEVICE, merge="pass")
    assert_close(out[:len(lens)], ref, tol)
    assert not ws[2].any(), "a merge left its counter set: the next launch would merge early"
    assert int(ws[1][:, 0].isfinite().sum()) == 2 + 3 + 4 + 5 + 11, "the chunks' partials: 64-token chunks"


def test_fat_decode_merge_tiles_give_a_thread_128_bytes_of_partials_a_load():
    """MLA's fat decode tiles at the warps that give a thread 128 bytes of partials a load, 2 at least (4 warps laid
    16-bit tiles out through shared memory, the merge at half speed); one-head tiles and verify at 4."""
    assert merge_pass_warps(*merge_pass_tiles(13, 128, 512, 5)[:3], 2, True) == 2    # [4 heads, 8 chunks, 128] bf16
    assert merge_pass_warps(*merge_pass_tiles(24, 128, 512, 2)[:3], 2, True) == 2    # [8 heads, 4 chunks, 128] bf16
    assert merge_pass_warps(*merge_pass_tiles(24, 16, 512, 5)[:3], 4, True) == 4     # MLA-16's float32 partials
    assert merge_pass_warps(*merge_pass_tiles(13, 16, 512, 10)[:3], 4, True) == 4    # [2 heads, 16 chunks, 128] f32
    assert merge_pass_warps(*merge_pass_tiles(13, 16, 512, 17)[:3], 4, True) == 4    # one head a program
    assert merge_pass_warps(*merge_pass_tiles(48, 8, 64, 4)[:3], 4, True) == 4       # GQA
    assert merge_pass_warps(*merge_pass_tiles(24, 128, 512, 2, False)[:3], 2, False) == 4    # verify
    assert merge_pass_warps(8, 2, 128, 2, True) == 2                                  # two heads: 2 at least


@pytest.mark.parametrize("H, Dv, W, dtype, budget, want", [
    (14, 520, 1, torch.bfloat16, 2, (2, True, False, True)),     # MLA's fat decode tiles, 16-bit partials
    (14, 520, 1, torch.float32, 2, (4, True, True, True)),       # float32 partials (MLA-16's transposed kernel)
    (8, 128, 1, torch.float32, 2, (4, False, True, False)),      # GQA: one head a program
    (8, 128, 1, torch.bfloat16, 16, (4, False, True, False)),    # the wide tiles
    (8, 128, 1, torch.bfloat16, 32, (4, False, False, False)),   # the deep ones
    (8, 128, 2, torch.float32, 2, (4, False, False, False)),     # verify
    (14, 520, 2, torch.bfloat16, 2, (4, False, False, True)),    # verify's fat tiles
])
def test_the_merge_launch_takes_the_warps_and_the_one_round_of_its_tiles(monkeypatch, H, Dv, W, dtype, budget, want):
    """``ChunkLaunch.merge_pass`` launches with ``merge_pass_warps`` of the partials' dtype, ONE_LOAD on the fat
    decode tiles alone and PREFETCH on decode's tiles but the deep ones and the fat ones of 16-bit partials."""
    monkeypatch.setattr(chunk_kernels, "MERGE_PASS_PREFETCH", True)
    lens = [900, 40, 300]
    bs = len(lens)
    part, lse, counters = chunk_workspace(bs, budget, W, H, 1, Dv, DEVICE, dtype)
    part.normal_()
    lse.normal_()
    out = torch.empty(bs * W, H, Dv, dtype=torch.float32, device=DEVICE)       # 4 bytes a value, unlike bf16 partials
    cl = ChunkLaunch(part, lse, counters, bs * budget, (1, 1),
                     dict(MIN_TILES=1, FIXED_TILES=0, BLOCK_BS=triton.next_power_of_2(bs)), bs, W, 16, "chunks")
    with recording() as launches:
        cl.merge_pass(torch.tensor(lens, dtype=torch.int32, device=DEVICE), None, out, single=True)
    (kernel, _, _, _, kwargs), = launches
    assert kernel is chunk_kernels._merge_chunk_pass_kernel
    assert (kwargs["num_warps"], kwargs["ONE_LOAD"], kwargs["PREFETCH"], kwargs["BLOCK_HM"] > 1) == want, kwargs
