import pytest
import torch
import triton
import triton.language as tl
from kernel_refs import assert_close, make_paged_batch, ref_paged_attention

from attn_backends_kernels.attention_core import decode_workspace
from attn_backends_kernels.chunk_kernels import chunk_of
from attn_backends_kernels.decode_attention import decode_attention_fwd
from attn_backends_kernels.schedule import chunk_slots, chunk_workspace, min_tiles, slots_per_request


def run_decode(seq_lens, page_size, H, Hkv, D, splits, dtype, device, pad_rows=1, seed=0,
               use_workspace=True):
    torch.manual_seed(seed)
    page_table, lens, num_pages = make_paged_batch(seq_lens, page_size, pad_rows=pad_rows,
                                                   device=device, seed=seed)
    bs = lens.shape[0]
    k_buf = torch.randn(num_pages * page_size, Hkv, D, device=device).to(dtype)
    v_buf = torch.randn(num_pages * page_size, Hkv, D, device=device).to(dtype)
    q = torch.randn(bs, H, D, device=device).to(dtype)
    out = torch.full((bs, H, D), float("nan"), device=device, dtype=dtype)
    ws = None
    if use_workspace and splits > 1:
        ws = decode_workspace(bs, H, D, splits, device)
        ws[0].fill_(float("nan"))
        ws[1].fill_(float("nan"))
    scale = D ** -0.5
    decode_attention_fwd(q, k_buf, v_buf, page_table, lens, page_size, scale, splits, out, ws)
    cu = torch.arange(bs + 1, dtype=torch.int32)  # one query row per request
    ref = ref_paged_attention(q, k_buf, v_buf, page_table, lens, cu, page_size, scale)
    return out, ref


@pytest.mark.parametrize("page_size,seq_lens,splits,H,Hkv", [
    (1, [5, 37, 1], 3, 4, 1),
    (16, [70, 3, 16], 4, 8, 2),
    (64, [130, 64, 1], 2, 2, 2),
    (16, [33, 100], 1, 4, 4),
    (16, [4100, 3], 256, 8, 1),       # a few-program decode's deep splits: most of the short one's empty
])
def test_decode_cpu(page_size, seq_lens, splits, H, Hkv):
    out, ref = run_decode(seq_lens, page_size, H, Hkv, 16, splits, torch.float32, "cpu")
    assert_close(out, ref, 1e-5)


def test_decode_rejects_bad_inputs():
    q = torch.zeros(2, 4, 16)
    kv = torch.zeros(10, 2, 16)
    pt = torch.zeros(2, 4, dtype=torch.int64)
    lens = torch.ones(2, dtype=torch.int32)
    out = torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match="page_table.dtype"):
        decode_attention_fwd(q, kv, kv, pt, lens, 1, 1.0, 2, out)
    with pytest.raises(ValueError, match="num_kv_splits=0"):
        decode_attention_fwd(q, kv, kv, pt.int(), lens, 1, 1.0, 0, out)
    with pytest.raises(ValueError, match="merge='pass' not in"):
        decode_attention_fwd(q, kv, kv, pt.int(), lens, 1, 1.0, 2, out, merge="pass")


# dtype x head_dim x group in full; page sizes rotate through the cases (each kernel
# specialisation costs a compile on the GPU machine, so the matrix is kept covering,
# not exhaustive).
GPU_CASES = [(dtype, D, group, (1, 16, 64)[i % 3])
             for i, (dtype, D, group) in enumerate(
                 (dt, d, g) for dt in (torch.bfloat16, torch.float16) for d in (64, 128)
                 for g in (1, 4, 8))]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,D,group,page_size", GPU_CASES)
def test_decode_gpu(dtype, D, group, page_size):
    seq_lens = [1, 17, 700, 4096, 32768, 129]
    out, ref = run_decode(seq_lens, page_size, 4 * group, 4, D, 8, dtype, "cuda", pad_rows=2)
    assert_close(out, ref, 1e-2)


@pytest.mark.cuda
def test_decode_gpu_deep_splits():
    """256 splits of one KV head (the backend's decode of few programs, ``DEEP_MAX_KV_SPLITS``), the
    separate merge of 256 partials a row, over lengths that leave most splits empty or 128 tokens long."""
    out, ref = run_decode([1, 4096, 32768], 16, 8, 1, 128, 256, torch.bfloat16, "cuda", pad_rows=2)
    assert_close(out, ref, 1e-2)


@pytest.mark.cuda
def test_decode_gpu_deep_splits_fp8():
    """256 splits of one KV head over an e4m3 cache stored with scales 0.5 / 0.25 (the backend's FP8 decode of
    few programs), against the float64 reference over the dequantized cache; the workspace poisoned."""
    from attn_backends.kv_cache import to_cache
    torch.manual_seed(1)
    page_table, lens, num_pages = make_paged_batch([1, 4096, 32768, 700], 16, pad_rows=2, device="cuda", seed=1)
    bs, fp8 = lens.shape[0], torch.float8_e4m3fn
    k, v = (to_cache(torch.randn(num_pages * 16, 1, 128, device="cuda"), fp8, s) for s in (0.5, 0.25))
    q = torch.randn(bs, 8, 128, device="cuda").to(torch.bfloat16)
    out = torch.full((bs, 8, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    ws = decode_workspace(bs, 8, 128, 256, "cuda")
    ws[0].fill_(float("nan"))
    ws[1].fill_(float("nan"))
    decode_attention_fwd(q, k, v, page_table, lens, 16, 128 ** -0.5, 256, out, ws, k_scale=0.5, v_scale=0.25)
    cu = torch.arange(bs + 1, dtype=torch.int32)
    ref = ref_paged_attention(q, k.float() * 0.5, v.float() * 0.25, page_table, lens, cu, 16, 128 ** -0.5)
    assert_close(out, ref, 1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_cuda_graph_replay(page_size):
    """Capture with one batch, replay with other lengths and pages written in place."""
    dtype, H, Hkv, D, splits = torch.bfloat16, 32, 8, 128, 8
    lens_a, lens_b = [100, 5000, 1, 33], [4000, 7, 300, 2048]
    max_len = max(lens_a + lens_b)
    pt_a, sl_a, n_a = make_paged_batch(lens_a, page_size, device="cuda", seed=1)
    pt_b, sl_b, n_b = make_paged_batch(lens_b, page_size, device="cuda", seed=2)
    num_pages = max(n_a, n_b)
    width = max_len // page_size + 4
    page_table = torch.zeros(len(lens_a), width, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(len(lens_a), dtype=torch.int32, device="cuda")
    k_buf = torch.randn(num_pages * page_size, Hkv, D, device="cuda").to(dtype)
    v_buf = torch.randn(num_pages * page_size, Hkv, D, device="cuda").to(dtype)
    q = torch.randn(len(lens_a), H, D, device="cuda").to(dtype)
    out = torch.empty(len(lens_a), H, D, device="cuda", dtype=dtype)
    ws = decode_workspace(len(lens_a), H, D, splits, "cuda")

    def load(pt, sl):
        page_table.zero_()
        page_table[:, :pt.shape[1]] = pt
        seq_lens.copy_(sl)

    load(pt_a, sl_a)
    run = lambda: decode_attention_fwd(q, k_buf, v_buf, page_table, seq_lens, page_size,
                                       D ** -0.5, splits, out, ws)
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    load(pt_b, sl_b)
    out.fill_(float("nan"))
    graph.replay()
    cu = torch.arange(len(lens_a) + 1, dtype=torch.int32)
    ref = ref_paged_attention(q, k_buf, v_buf, page_table, seq_lens, cu, page_size, D ** -0.5)
    assert_close(out, ref, 1e-2)


# The chunk schedule (kernels/schedule.py): ragged, long-tail and uniform lengths, block_n 16 so
# that the interpreter's lengths make several chunks of the long requests (their merge runs).
CHUNK_CASES = [
    (16, [3000, 40, 5, 300], 8, 2, 2),      # long tail: one request cut into 9 chunks
    (1, [1, 700, 33], 4, 1, 3),
    (64, [513, 512, 511], 4, 4, 1),         # near-uniform: two chunks a request (the pad row counts in the budget)
    (16, [2, 900, 900, 17, 1800], 6, 2, 4),
]


def run_chunked(seq_lens, page_size, H, Hkv, D, per_request, dtype, device, pad_rows=1, seed=0, block_n=16,
                schedule="chunks", heads_first=None, merge="last"):
    torch.manual_seed(seed)
    page_table, lens, num_pages = make_paged_batch(seq_lens, page_size, pad_rows=pad_rows, device=device, seed=seed)
    bs = lens.shape[0]
    k_buf = torch.randn(num_pages * page_size, Hkv, D, device=device).to(dtype)
    v_buf = torch.randn(num_pages * page_size, Hkv, D, device=device).to(dtype)
    k_buf[:page_size] = v_buf[:page_size] = float("nan")     # page 0: the pad rows' page
    q = torch.randn(bs, H, D, device=device).to(dtype)
    out = torch.full((bs, H, D), float("nan"), device=device, dtype=dtype)
    ws = chunk_workspace(bs, slots_per_request(schedule, per_request, page_table.shape[1] * page_size), 1, H, Hkv, D,
                         device)
    ws[0].fill_(float("nan"))
    ws[1].fill_(float("nan"))
    decode_attention_fwd(q, k_buf, v_buf, page_table, lens, page_size, D ** -0.5, per_request, out, ws,
                         block_n=block_n, schedule=schedule, heads_first=heads_first, merge=merge)
    n = len(seq_lens)
    ref = ref_paged_attention(q[:n], k_buf, v_buf, page_table[:n], lens[:n], torch.arange(n + 1, dtype=torch.int32),
                              page_size, D ** -0.5)
    return out, ref, ws


@pytest.mark.parametrize("heads_first,merge", [(False, "last"), (True, "last"), (False, "pass")])
@pytest.mark.parametrize("page_size,seq_lens,H,Hkv,per_request", CHUNK_CASES)
def test_decode_chunk_schedule_cpu(page_size, seq_lens, H, Hkv, per_request, heads_first, merge):
    out, ref, ws = run_chunked(seq_lens, page_size, H, Hkv, 16, per_request, torch.float32, "cpu",
                               heads_first=heads_first, merge=merge)
    assert_close(out[:len(seq_lens)], ref, 1e-5)
    assert not ws[2].any(), "a merge left its counter set: the next launch would merge early"


def test_decode_chunks_span_the_decode_floor():
    """Decode chunks span at least ``DECODE_MIN_CHUNK_TOKENS`` (64), not the other modes' 256: one
    request of 256 tokens at a budget of 4 chunks of 32-token tiles runs as 4 chunks, each writing a
    partial (at a 256-token floor it is one chunk, written whole: no partial)."""
    from attn_backends_kernels.decode_attention import DECODE_MIN_CHUNK_TOKENS
    assert DECODE_MIN_CHUNK_TOKENS == 64
    out, ref, ws = run_chunked([256], 16, 2, 1, 16, 4, torch.float32, "cpu", pad_rows=0, block_n=32, merge="pass")
    assert_close(out, ref, 1e-5)
    assert int(ws[1][:, 0].isfinite().sum()) == 4, "the chunks a 256-token request was cut into, by their partials"


@triton.jit
def _schedule_probe(seq_lens_ptr, out_ptr, bs, num_chunks, BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr,
                    BLOCK_BS: tl.constexpr):
    j = tl.program_id(0)
    b, first, count, start, end, total = chunk_of(seq_lens_ptr, j, bs, num_chunks, 0, 1, seq_lens_ptr, BLOCK_N,
                                                  MIN_TILES, 0, BLOCK_BS, -1, False)
    for i, x in enumerate((b, first, count, start, end)):
        tl.store(out_ptr + j * 5 + i, x)


def _fitted_per(tiles, budget, least, fit):
    """The chunk the schedule should take, found by counting up (the kernel bisects)."""
    per = max(-(-sum(tiles) // budget), least)

    def count(p):
        return sum(max(1, -(-t // p)) for t in tiles)
    if not fit or count(per) <= budget or len(tiles) > budget:
        return per
    p = per
    while count(p) > budget:
        p += 1
    return p if 3 * (p + least) <= 4 * (per + least) else per


@pytest.mark.parametrize("lens,per_request,fit,fitted", [
    ([32768, 300, 2000, 256, 1024, 700, 5, 1], 2, False, None),
    ([32768, 300, 2000, 256, 1024, 700, 5, 1], 2, True, None),  # 22 chunks for 16: 114 tiles fit, 73 balanced
    ([32768, 300, 2000, 256, 1024, 700, 5, 1], 6, True, 27),    # 51 chunks for 48: 27 tiles for 25
    ([4096] * 6, 4, True, None), ([1, 1, 1], 1, False, None),
    ([16384, 256, 512], 8, False, None), ([16384, 256, 512], 8, True, 24),
    ([8192, 64, 64, 64], 1, True, None),          # one chunk a request: dearer than the overrun, not fitted
    ([0, 3000, 0, 2000, 40], 3, True, 14),        # empty rows take a chunk too
])
def test_chunk_schedule_covers_every_token_once_in_equal_chunks(lens, per_request, fit, fitted):
    """Every request's tokens fall in its chunks exactly once, in order; chunks past the last do
    nothing; no chunk spans more than the schedule's share (long requests are cut, short ones not).
    ``fit`` (a negative budget, ``ChunkLaunch.budget``): where whole chunks a request overran the
    budget, the smallest chunk that fits it, if that costs at most 4/3 of the plain share (``fitted``:
    the tiles it takes; None: the plain share)."""
    block_n, bs = 32, len(lens)
    num_chunks = bs * per_request
    slots = chunk_slots(bs, per_request)
    got = torch.full((slots, 5), -1, dtype=torch.int32)
    _schedule_probe[(slots,)](torch.tensor(lens, dtype=torch.int32), got, bs, -num_chunks if fit else num_chunks,
                              BLOCK_N=block_n, MIN_TILES=min_tiles(block_n), BLOCK_BS=triton.next_power_of_2(bs))
    tiles = [-(-n // block_n) for n in lens]
    per = _fitted_per(tiles, num_chunks, min_tiles(block_n), fit)
    plain = max(-(-sum(tiles) // num_chunks), min_tiles(block_n))
    assert per == (fitted or plain), (per, fitted, plain)
    if per != plain:
        assert sum(max(1, -(-t // per)) for t in tiles) <= num_chunks
    rows = got.tolist()
    for b, n in enumerate(lens):
        mine = [r for r in rows if r[0] == b]
        assert [r[3] for r in mine] == list(range(0, n, per * block_n)) or (n == 0 and len(mine) == 1)
        assert all(r[2] == len(mine) and r[1] == rows.index(mine[0]) for r in mine)
        assert sum(r[4] - r[3] for r in mine) == n and all(0 < r[4] - r[3] <= per * block_n or n == 0 for r in mine)
    assert all(r[0] >= bs for r in rows[sum(max(1, -(-t // per)) for t in tiles):])


@pytest.mark.cuda
@pytest.mark.parametrize("merge", ["last", "pass"])
@pytest.mark.parametrize("dtype,D,group,per_request", [(torch.bfloat16, 128, 4, 2), (torch.bfloat16, 64, 8, 8),
                                                       (torch.float16, 128, 1, 1)])
def test_decode_chunk_schedule_gpu(dtype, D, group, per_request, merge):
    lens = [32768, 17, 700, 1, 4096, 129, 2000, 256]          # long tail: one request holds most tokens
    out, ref, ws = run_chunked(lens, 16, 4 * group, 4, D, per_request, dtype, "cuda", pad_rows=2, block_n=32,
                               merge=merge)
    assert_close(out[:len(lens)], ref, 1e-2)
    assert not ws[2].any()


@pytest.mark.cuda
def test_decode_chunk_schedule_graph_replays_any_lengths():
    """One graph captured on uniform lengths replays long-tail and other lengths (a different
    schedule each replay): each replay equals the eager launch bitwise and the float64 reference."""
    dtype, H, Hkv, D, per_request, page_size = torch.bfloat16, 32, 8, 128, 2, 16
    batches = [[2048] * 6, [30000, 300, 17, 1, 900, 2048], [5, 6000, 6000, 12000, 1, 64]]
    made = [make_paged_batch(lens, page_size, device="cuda", seed=i) for i, lens in enumerate(batches)]
    num_pages = max(m[2] for m in made)
    page_table = torch.zeros(6, 30000 // page_size + 4, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(6, dtype=torch.int32, device="cuda")
    k_buf = torch.randn(num_pages * page_size, Hkv, D, device="cuda").to(dtype)
    v_buf = torch.randn(num_pages * page_size, Hkv, D, device="cuda").to(dtype)
    q = torch.randn(6, H, D, device="cuda").to(dtype)
    out = torch.empty(6, H, D, device="cuda", dtype=dtype)
    ws = chunk_workspace(6, per_request, 1, H, Hkv, D, "cuda")
    run = lambda: decode_attention_fwd(q, k_buf, v_buf, page_table, seq_lens, page_size, D ** -0.5,  # noqa: E731
                                       per_request, out, ws, schedule="chunks")

    def load(m):
        page_table.zero_()
        page_table[:, :m[0].shape[1]] = m[0]
        seq_lens.copy_(m[1])

    load(made[0])
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for m in made[1:] + made[:1]:
        load(m)
        out.fill_(float("nan"))
        graph.replay()
        replayed = out.clone()
        run()
        assert torch.equal(replayed, out), "replay differs from the eager launch on the same lengths"
        ref = ref_paged_attention(q, k_buf, v_buf, page_table, seq_lens, torch.arange(7, dtype=torch.int32),
                                  page_size, D ** -0.5)
        assert_close(replayed, ref, 1e-2)


def _shared_pool_batches(lens, batches, page_size, H, Hkv, D, dtype, device, seed=0):
    """One pool holding requests of ``lens`` on shuffled pages; for each ``(ids, pad_rows)`` of
    ``batches`` the page table, lengths and q of those requests (q rows per request fixed) plus
    ``pad_rows`` pad rows on page 0 (length 1)."""
    g = torch.Generator().manual_seed(seed)
    counts = [-(-n // page_size) for n in lens]
    perm = (torch.randperm(sum(counts), generator=g) + 1).tolist()
    pages, at = [], 0
    for c in counts:
        pages.append(perm[at:at + c])
        at += c
    k_buf = torch.randn((sum(counts) + 1) * page_size, Hkv, D, generator=g).to(dtype).to(device)
    v_buf = torch.randn((sum(counts) + 1) * page_size, Hkv, D, generator=g).to(dtype).to(device)
    q_all = torch.randn(len(lens), H, D, generator=g).to(dtype).to(device)
    out = []
    for ids, pad in batches:
        table = torch.zeros(len(ids) + pad, max(counts) + 2, dtype=torch.int32)
        for r, i in enumerate(ids):
            table[r, :counts[i]] = torch.tensor(pages[i], dtype=torch.int32)
        sl = torch.tensor([lens[i] for i in ids] + [1] * pad, dtype=torch.int32)
        q = torch.cat([q_all[list(ids)], torch.randn(pad, H, D, generator=g).to(dtype).to(device)])
        out.append((table.to(device), sl.to(device), q))
    return k_buf, v_buf, out


INVARIANT_BATCHES = [((0,), 0), ((0, 1, 2), 0), ((3, 4, 0, 5, 1), 0), ((0, 1, 2), 3)]   # alone, 3 batches, 2 buckets


def test_invariant_schedule_is_bitwise_the_same_in_any_batch_and_bucket():
    """Request 0 (three invariant chunks, merged) alone, in three batches and padded
    to another bucket: the same bits each time (the balanced schedule cuts it by the batch)."""
    lens = [2500, 50, 1500, 2100, 12, 400]
    k_buf, v_buf, batches = _shared_pool_batches(lens, INVARIANT_BATCHES, 16, 4, 2, 16, torch.float32, "cpu")
    got = []
    for (ids, _), (table, sl, q) in zip(INVARIANT_BATCHES, batches):
        out = torch.empty_like(q)
        decode_attention_fwd(q, k_buf, v_buf, table, sl, 16, 0.25, 2, out, None, schedule="invariant")
        got.append(out[ids.index(0)])
    assert all(torch.equal(got[0], o) for o in got[1:]), "request 0's output depends on its batch or bucket"
    ref = ref_paged_attention(batches[0][2], k_buf, v_buf, batches[0][0], batches[0][1],
                              torch.arange(2, dtype=torch.int32), 16, 0.25)
    assert_close(got[0][None], ref, 1e-5)
