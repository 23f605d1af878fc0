"""The MLA chunk pass (``kernels/mla/balanced.py``) against float64: ragged and long-tail lengths
on shuffled pages, every uniform mask, a padded row on page 0 (NaN there and in unread page
tails), a NaN-filled workspace, and the graph form: captured on one batch, replayed on other
lengths (another schedule, the same grid)."""
import pytest
import torch
from kernel_refs import BIMODAL, CAUSAL, DRAFT, TREE, assert_close, make_paged_batch, ref_paged_attention

from attn_backends_kernels.mla.attention import tile_shape
from attn_backends_kernels.mla.balanced import mla_chunk_fwd
from attn_backends_kernels.mla.warpspec import partial_dtype
from attn_backends_kernels.schedule import chunk_workspace, slots_per_request

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter on the CPU; on a GPU these are GPU tests (`pytest -m cuda` picks them)
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []


def _batch(seq_lens, W, page_size, H, latent, rope, dtype, mask, seed, max_pages=None):
    torch.manual_seed(seed)
    page_table, lens, num_pages = make_paged_batch(seq_lens, page_size, pad_rows=1, pad_len=W, device=DEVICE,
                                                   seed=seed)
    if max_pages is not None:      # the capture's page-table width, for a replay on other lengths
        page_table = torch.nn.functional.pad(page_table, (0, max_pages - page_table.shape[1]))
    bs = lens.shape[0]
    kv = torch.randn(num_pages * page_size, 1, latent + rope, device=DEVICE).to(dtype)
    used = torch.zeros(kv.shape[0], dtype=torch.bool, device=DEVICE)
    for i in range(len(seq_lens)):
        pos = torch.arange(int(lens[i]), device=DEVICE)
        used[page_table[i, pos // page_size].long() * page_size + pos % page_size] = True
    kv[~used] = float("nan")                       # page 0 (the pad row's) and every unread slot
    q = torch.randn(bs * W, H, latent + rope, device=DEVICE).to(dtype)
    custom = draft = None
    if mask == TREE:
        custom = torch.rand(bs * W * W, device=DEVICE) < 0.5
        custom.view(bs, W, W).diagonal(dim1=1, dim2=2).fill_(True)
    if mask == DRAFT:
        draft = (lens - W * torch.randint(1, 4, (bs,), device=DEVICE)).clamp_min(0).to(torch.int32)
    return page_table, lens, kv, q, custom, draft


def _reference(seq_lens, W, page_table, lens, kv, q, latent, page_size, mask, custom, draft):
    n = len(seq_lens)
    cu = torch.arange(0, n * W + 1, W, dtype=torch.int32)
    return ref_paged_attention(q[:n * W], kv, kv[:, :, :latent], page_table[:n], lens[:n], cu, page_size, 0.1,
                               mask, None if custom is None else custom[:n * W * W],
                               None if draft is None else draft[:n])


CASES = [   # page size, lengths, W, heads, mask, splits a request
    (16, [3000, 40, 5, 300], 1, 16, CAUSAL, 2),      # long tail: the long request cut into many chunks
    (1, [700, 33, 90], 1, 16, CAUSAL, 3),
    (16, [1900, 8, 700], 4, 16, CAUSAL, 2),          # verify chain
    (64, [1900, 37, 700], 4, 16, TREE, 2),
    (16, [1500, 30, 600], 4, 20, DRAFT, 2),          # 16-head blocks, the second one partly past H
    (16, [513, 512, 511], 2, 16, CAUSAL, 1),         # near-uniform
    (16, [8, 2100, 700], 4, 16, CAUSAL, 2),          # the long request not first: its merged rows are b * W on
]
# On an H200 the default runs the Gluon kernels where they serve a tile (the cases above at page 16 with
# 64-row tiles: wgmma's; page 64: chunked's); these take the others: swap (16-head decode), chunked with
# 128 heads, seesaw (page 32), and chunked's draft mask.
GLUON_CASES = [
    (64, [3000, 40, 5, 300, 64], 1, 16, CAUSAL, 2),
    (64, [5000, 40, 700, 2000], 1, 128, CAUSAL, 1),
    (32, [1900, 8, 700], 4, 16, CAUSAL, 2),
    (64, [1500, 30, 600], 4, 16, DRAFT, 2),
    (64, [3000, 40, 5, 300, 64], 1, 16, CAUSAL, 5),     # counts that are not powers of two (EXACT_CHUNK_SPLITS):
    (64, [5000, 40, 700, 2000], 1, 128, CAUSAL, 5),     # swap and chunked-128 at 5 chunks a request's budget
] if DEVICE == "cuda" else []
KERNELS = [None, "triton"] if DEVICE == "cuda" else [None]       # the CPU's default is the Triton tile


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("schedule,fit", [("chunks", False), ("chunks", True), ("invariant", False)])
@pytest.mark.parametrize("page_size,seq_lens,W,H,mask,splits", CASES + GLUON_CASES)
def test_mla_chunk_pass_against_float64(page_size, seq_lens, W, H, mask, splits, schedule, fit, kernel):
    """``fit``: the wave fit (``chunk_kernels._balanced_per``), which the long-tail cases take (their whole
    chunks a request overrun the budget): the kernel and the merge pass must cut alike."""
    latent, rope, dtype = (32, 16, torch.float32) if DEVICE == "cpu" else (512, 64, torch.bfloat16)
    page_table, lens, kv, q, custom, draft = _batch(seq_lens, W, page_size, H, latent, rope, dtype, mask, 0)
    bs = lens.shape[0]
    out = torch.full((bs * W, H, latent), float("nan"), device=DEVICE, dtype=dtype)
    # the default takes the partials the backend allocates (16-bit on the warp-specialized kernels); the Triton
    # tile float32
    bw, bh = tile_shape(W, H)
    part = partial_dtype(dtype, q.device, page_size, bw * bh, latent, rope) if kernel is None else torch.float32
    ws = chunk_workspace(bs, slots_per_request(schedule, splits, page_table.shape[1] * page_size), W, H, 1, latent,
                         DEVICE, part)
    ws[0].fill_(float("nan"))
    ws[1].fill_(float("nan"))
    mla_chunk_fwd(q, kv, page_table, lens, page_size, 0.1, splits, out, q_per_req=W, mask=mask, custom_mask=custom,
                  workspace=ws, draft_prefix_lens=draft, schedule=schedule, block_n=16 if DEVICE == "cpu" else None,
                  kernel=kernel, fit=fit)
    ref = _reference(seq_lens, W, page_table, lens, kv, q, latent, page_size, mask, custom, draft)
    assert_close(out[:len(seq_lens) * W], ref, 1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
# 128 heads: the chunked, wgmma and seesaw kernels (seesaw: 32-token tiles); 16 heads at page 64: the transposed one
@pytest.mark.parametrize("H,page_size", [(128, 64), (128, 16), (128, 32), (16, 64)])
@pytest.mark.parametrize("seq_lens,fitted", [
    ([20000] + [64] * 8, {64: 11, 32: 21}),         # the fit's size would cut the long request into 29-30 chunks
    ([64] * 4 + [20000] + [64] * 4, {64: 11, 32: 21}),  # mid-batch: the first slots run its chunks (largest first)
    ([3000, 2900, 40, 2500, 700, 3100], {64: 8, 32: 16}),   # near-uniform: the fit's size (7 or 14 a chunk cut 31)
    (BIMODAL, {64: 9, 32: 17}),     # the planned size past the fit's at 128 heads (test_chunk_plan.py)
])
@pytest.mark.parametrize("planned", [False, True, "step"])
def test_mla_chunk_pass_on_a_budget_of_waves(seq_lens, fitted, H, page_size, planned, monkeypatch, splits=4):
    """``many_waves``: the fit's budget of several waves (``schedule.many_waves``), whose Gluon chunk pass cuts no
    request into more than ``MANY_WAVES_CAP`` chunks, its size published for the merge (a merge that recomputed the
    uncapped size would cut otherwise); the published size is that rule's, or where ``planned`` the plan's
    (``chunk_plan``), which the chunk pass reads: planned by the call (``PLAN_WAVES``) or, "step", before it by
    ``mla_chunk_plan`` (a call with ``planned=True`` plans nothing itself). Its slots run the largest chunks first
    (``chunk_map``): every chunk once, into its slot in request order (a chunk never run leaves NaN). The slots past
    the batch's chunks (most of the grid where capped) store nothing."""
    from attn_backends_kernels.mla import balanced
    from attn_backends_kernels.mla.balanced import MANY_WAVES_CAP, mla_chunk_plan
    from attn_backends_kernels.mla.chunk_plan import planned_tiles
    monkeypatch.setattr(balanced, "PLAN_WAVES", planned is True)
    latent, rope, W = 512, 64, 1
    page_table, lens, kv, q, _, _ = _batch(seq_lens, W, page_size, H, latent, rope, torch.bfloat16, CAUSAL, 3)
    bs = lens.shape[0]
    out = torch.full((bs, H, latent), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    ws = chunk_workspace(bs, splits, W, H, 1, latent, DEVICE, partial_dtype(torch.bfloat16, q.device, page_size,
                                                                             min(H, 64), latent, rope))
    ws[0].fill_(float("nan"))
    ws[1].fill_(float("nan"))
    if planned == "step":
        assert mla_chunk_plan(q, kv, page_table, lens, page_size, splits, out, ws, fit=True, many_waves=True)
        monkeypatch.setattr(balanced, "plan_chunks", lambda *a: pytest.fail("a planned call planned again"))
    mla_chunk_fwd(q, kv, page_table, lens, page_size, 0.1, splits, out, workspace=ws, fit=True, many_waves=True,
                  planned=planned == "step")
    ref = _reference(seq_lens, W, page_table, lens, kv, q, latent, page_size, CAUSAL, None, None)
    assert_close(out[:len(seq_lens)], ref, 2e-2)
    n = 32 if page_size == 32 else 64
    tiles = [-(-int(x) // n) for x in lens]
    published, fit = int(ws[1][(bs * splits + bs) * W, 0].item()), fitted[n]
    capped = -(-max(tiles) // fit) > MANY_WAVES_CAP         # the longest request in MANY_WAVES_CAP chunks
    assert capped == (max(seq_lens) == 20000)
    rule = -(-max(tiles) // MANY_WAVES_CAP) if capped else fit
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    programs = -(-H // tile_shape(W, H)[1])
    assert published == (planned_tiles(tiles, rule, programs, sms, n) if planned else rule)
    chunks = sum(-(-t // published) for t in tiles)
    assert chunks < bs * splits + bs        # slots past the chunks exist: the NaN check below is not vacuous
    past = slice(chunks * W, (bs * splits + bs) * W)
    assert ws[0][past].isnan().all() and ws[1][past].isnan().all()
    assert not ws[1][:chunks * W].isnan().any()
    with pytest.raises(ValueError, match="many_waves=True is a budget of the wave fit"):
        mla_chunk_fwd(q, kv, page_table, lens, page_size, 0.1, splits, out, workspace=ws, many_waves=True)


def test_mla_chunk_pass_refuses_the_split_schedule_and_ragged_rows():
    q = torch.zeros(2, 16, 48)
    kv = torch.zeros(64, 1, 48)
    pt = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="schedule='split'"):
        mla_chunk_fwd(q, kv, pt, lens, 16, 0.1, 2, torch.zeros(2, 16, 32), schedule="split")
    with pytest.raises(ValueError, match="merge='last'"):
        mla_chunk_fwd(q, kv, pt, lens, 16, 0.1, 2, torch.zeros(2, 16, 32), merge="last")
    with pytest.raises(TypeError):
        mla_chunk_fwd(q, kv, pt, lens, 16, 0.1, 2, torch.zeros(2, 16, 32), cu_seqlens_q=lens)
    with pytest.raises(ValueError, match="kernel='wgmma'"):
        mla_chunk_fwd(q, kv, pt, lens, 16, 0.1, 2, torch.zeros(2, 16, 32), kernel="wgmma")
    ws = chunk_workspace(2, 2, 1, 16, 1, 32, "cpu", torch.float16)     # 16-bit partials where the tile takes float32
    with pytest.raises(ValueError, match=r"torch\.float16 / .*\(float32, float32, int32"):
        mla_chunk_fwd(q, kv, pt, lens, 16, 0.1, 2, torch.zeros(2, 16, 32), workspace=ws)


def test_a_planned_call_names_what_it_reads(monkeypatch):
    """``planned=True`` reads a budget of several waves' size from a given workspace: without one, or without
    ``many_waves``, it says so; ``mla_chunk_plan`` writes into a given workspace only, and where the Triton tile runs
    the launch (no planned size to read: here the CPU) it launches nothing and says False."""
    from attn_backends_kernels.mla import balanced
    from attn_backends_kernels.mla.balanced import mla_chunk_plan
    q, kv = torch.zeros(2, 16, 48), torch.zeros(64, 1, 48)
    pt, lens, out = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32), torch.zeros(2, 16, 32)
    ws = chunk_workspace(2, 2, 1, 16, 1, 32, "cpu")
    with pytest.raises(ValueError, match="workspace None, many_waves=True"):
        mla_chunk_fwd(q, kv, pt, lens, 16, 0.1, 2, out, fit=True, many_waves=True, planned=True)
    with pytest.raises(ValueError, match="workspace given, many_waves=False"):
        mla_chunk_fwd(q, kv, pt, lens, 16, 0.1, 2, out, workspace=ws, fit=True, planned=True)
    with pytest.raises(ValueError, match="a given workspace"):
        mla_chunk_plan(q, kv, pt, lens, 16, 2, out, None, fit=True, many_waves=True)
    monkeypatch.setattr(balanced, "plan_chunks", lambda *a: pytest.fail("planned for the Triton tile"))
    assert mla_chunk_plan(q, kv, pt, lens, 16, 2, out, ws, fit=True, many_waves=True) is False


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("fit", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("W,mask", [(1, CAUSAL), (4, TREE)])
def test_mla_chunk_pass_replays_other_lengths(W, mask, kernel, fit):
    """One graph captured on a long-tail batch, replayed on uniform lengths: the schedule is
    recomputed on the device from the new lengths (``fit``: with the wave fit, which a long tail
    can take and uniform lengths do not)."""
    latent, rope, page_size, H, splits = 512, 64, 64, 16, 4
    first = _batch([6000, 40, 300], W, page_size, H, latent, rope, torch.bfloat16, mask, 1, max_pages=128)
    second = _batch([2000, 2000, 2000], W, page_size, H, latent, rope, torch.bfloat16, mask, 2, max_pages=128)
    page_table, lens, kv, q, custom, draft = (t.clone() if t is not None else None for t in first)
    bs = lens.shape[0]
    out = torch.empty(bs * W, H, latent, device=DEVICE, dtype=torch.bfloat16)
    ws = chunk_workspace(bs, splits, W, H, 1, latent, DEVICE)
    kv_big = torch.cat([kv, torch.empty_like(second[2])])        # room for the second batch's pages

    def run():
        mla_chunk_fwd(q, kv_big, page_table, lens, page_size, 0.1, splits, out, q_per_req=W, mask=mask,
                      custom_mask=custom, workspace=ws, draft_prefix_lens=draft, kernel=kernel, fit=fit)
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    pt2, lens2, kv2, q2, custom2, draft2 = second
    kv_big[kv.shape[0]:] = kv2
    page_table.copy_(pt2 + kv.shape[0] // page_size)
    lens.copy_(lens2)
    q.copy_(q2)
    if custom is not None:
        custom.copy_(custom2)
    out.fill_(float("nan"))
    graph.replay()
    ref = _reference([2000] * 3, W, page_table, lens, kv_big, q, latent, page_size, mask, custom, draft)
    assert_close(out[:3 * W], ref, 2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (the Gluon chunk pass)")
def test_a_merge_that_skips_one_chunk_requests_fails_the_gluon_cases(monkeypatch):
    """The Gluon chunk pass writes a partial for every chunk: a merge pass that leaves one-chunk
    requests alone (the Triton tile's rule) leaves their rows as they were, which the float64 test
    must catch."""
    from attn_backends_kernels import schedule
    merge = schedule.ChunkLaunch.merge_pass
    monkeypatch.setattr(schedule.ChunkLaunch, "merge_pass",
                        lambda self, lens, cu, out, single=False: merge(self, lens, cu, out))
    with pytest.raises(AssertionError):
        test_mla_chunk_pass_against_float64(64, [3000, 40, 5, 300, 64], 1, 16, CAUSAL, 2, "chunks", False, None)
