import pytest
import torch
from kernel_refs import CAUSAL, DRAFT, TREE, assert_close, make_paged_batch, ref_paged_attention

from attn_backends_kernels.attention_core import decode_workspace
from attn_backends_kernels.extend_attention import extend_attention_fwd
from attn_backends_kernels.schedule import chunk_workspace


def run_extend(q_lens, seq_lens, page_size, H, Hkv, D, dtype, device, mask=CAUSAL, splits=1,
               pad_rows=1, draft_prefix=None, seed=0, block_q=None, schedule="split", block_n=None,
               heads_first=None, merge="last"):
    """Requests with q_lens[i] rows over seq_lens[i] KV tokens, plus padding rows that
    own W = q_lens[0] rows over page 0 (seq_len = W)."""
    torch.manual_seed(seed)
    W = q_lens[0]
    page_table, lens, num_pages = make_paged_batch(seq_lens, page_size, pad_rows=pad_rows,
                                                   pad_len=W, device=device, seed=seed)
    all_q = list(q_lens) + [W] * pad_rows
    bs = len(all_q)
    cu = torch.tensor([0] + all_q, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    T = int(cu[-1])
    k_buf = torch.randn(num_pages * page_size, Hkv, D, device=device).to(dtype)
    v_buf = torch.randn(num_pages * page_size, Hkv, D, device=device).to(dtype)
    q = torch.randn(T, H, D, device=device).to(dtype)
    custom_mask = draft_lens = None
    if mask == TREE:
        custom_mask = torch.rand(bs * W * W, device=device) < 0.5
        custom_mask.view(bs, W, W).diagonal(dim1=1, dim2=2).fill_(True)
    if mask == DRAFT:
        draft_lens = torch.tensor(list(draft_prefix) + [0] * pad_rows, dtype=torch.int32,
                                  device=device)
    out = torch.full((T, H, D), float("nan"), device=device, dtype=dtype)
    ws = None
    if schedule == "chunks":
        ws = chunk_workspace(bs, splits, max(all_q), H, Hkv, D, device)
        k_buf[:page_size] = v_buf[:page_size] = float("nan")     # page 0: the pad rows' page
        ws[0].fill_(float("nan"))
        ws[1].fill_(float("nan"))
    elif splits > 1:
        ws = decode_workspace(T, H, D, splits, device)
        ws[0].fill_(float("nan"))
        ws[1].fill_(float("nan"))
    scale = D ** -0.5
    extend_attention_fwd(q, k_buf, v_buf, page_table, lens, cu, page_size, scale, max(all_q),
                         out, mask=mask, custom_mask=custom_mask, draft_prefix_lens=draft_lens,
                         num_kv_splits=splits, workspace=ws, block_q=block_q, schedule=schedule, block_n=block_n,
                         heads_first=heads_first, merge=merge)
    if schedule == "split":
        return out, ref_paged_attention(q, k_buf, v_buf, page_table, lens, cu, page_size, scale, mask,
                                        custom_mask, draft_lens)
    assert not ws[2].any(), "a merge left its counter set: the next launch would merge early"
    n = len(q_lens)       # the pad rows read page 0 (NaN here): their rows are not compared
    T = int(cu[n])
    ref = ref_paged_attention(q[:T], k_buf, v_buf, page_table[:n], lens[:n], cu[:n + 1], page_size, scale, mask,
                              custom_mask, draft_lens)
    return out[:T], ref


@pytest.mark.parametrize("page_size,q_lens,seq_lens,H,Hkv,splits", [
    (1, [5, 1, 9], [5, 40, 30], 4, 2, 1),      # ragged extend, first request has no prefix
    (16, [7, 20, 3], [50, 20, 70], 2, 1, 1),
    (64, [3, 11], [140, 75], 8, 2, 2),         # split-KV with causal tiles
])
def test_extend_causal_cpu(page_size, q_lens, seq_lens, H, Hkv, splits):
    out, ref = run_extend(q_lens, seq_lens, page_size, H, Hkv, 16, torch.float32, "cpu",
                          splits=splits)
    assert_close(out, ref, 1e-5)


def test_extend_many_query_blocks_cpu():
    """Several query blocks per request (block_q < q_len) with split-KV."""
    out, ref = run_extend([13, 6], [40, 6], 16, 4, 1, 16, torch.float32, "cpu", splits=2,
                          block_q=4)
    assert_close(out, ref, 1e-5)


@pytest.mark.parametrize("mask", [CAUSAL, TREE])
@pytest.mark.parametrize("page_size,W,splits", [(1, 4, 1), (16, 3, 2), (64, 8, 1)])
def test_verify_cpu(mask, page_size, W, splits):
    seq_lens = [W + 17, W, W + 70]
    out, ref = run_extend([W] * 3, seq_lens, page_size, 4, 1, 16, torch.float32, "cpu",
                          mask=mask, splits=splits, pad_rows=2)
    assert_close(out, ref, 1e-5)


@pytest.mark.parametrize("W,group,splits,want", [
    (4, 8, 2, dict(BLOCK_Q=4, BLOCK_N=64, num_warps=2, num_stages=3)),   # the 32-row tile (GQA 64/8)
    (4, 8, 8, dict(BLOCK_Q=4, BLOCK_N=64, num_warps=2, num_stages=3)),   # ... at any split count
    (4, 4, 2, dict(BLOCK_Q=4, BLOCK_N=64, num_warps=4, num_stages=2)),   # 16 rows (GQA 32/8)
    (8, 8, 2, dict(BLOCK_Q=8, BLOCK_N=64, num_warps=4, num_stages=2)),   # a 64-row tree tile
])
def test_verify_tile_launch_cpu(monkeypatch, W, group, splits, want):
    """The verify tiles' launch parameters (kernels/extend_attention.py; figures: bench/RESULTS.md,
    'GQA launch parameters'): a 32-row chain-verify tile runs 2 warps and 3 stages of 64-token KV tiles, other
    tiles 4 warps and 2 stages; the result still matches the reference over lengths that end inside
    a tile."""
    import attn_backends_kernels.extend_attention as ea
    seen = []
    launch = ea.launch

    def spy(kernel, grid, *args, **kwargs):
        seen.append(kwargs)
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(ea, "launch", spy)
    out, ref = run_extend([W] * 2, [W + 100, W + 37], 16, group, 1, 16, torch.float32, "cpu",
                          splits=splits, pad_rows=1)
    assert_close(out, ref, 1e-5)
    assert {k: seen[0][k] for k in want} == want


@pytest.mark.parametrize("page_size,W,steps,splits", [(1, 2, 3, 1), (16, 4, 2, 2)])
def test_draft_branch_cpu(page_size, W, steps, splits):
    draft_prefix = [9, 30]
    seq_lens = [p + steps * W for p in draft_prefix]
    out, ref = run_extend([W] * 2, seq_lens, page_size, 4, 2, 16, torch.float32, "cpu",
                          mask=DRAFT, splits=splits, draft_prefix=draft_prefix)
    assert_close(out, ref, 1e-5)


def test_extend_rejects_bad_mask():
    q = torch.zeros(2, 4, 16)
    kv = torch.zeros(10, 2, 16)
    pt = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    cu = torch.arange(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="custom_mask"):
        extend_attention_fwd(q, kv, kv, pt, lens, cu, 1, 1.0, 1, torch.zeros(2, 4, 16),
                             mask="tree")


@pytest.mark.cuda
# fp16 / head_dim 64 runs at page size 16 only (compile budget): the pairs are listed, not skipped
@pytest.mark.parametrize("dtype,D,page_size", [(torch.bfloat16, 128, 1), (torch.bfloat16, 128, 16),
                                               (torch.bfloat16, 128, 64), (torch.float16, 64, 16)])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("mask,W", [(CAUSAL, 4), (TREE, 8)])
def test_verify_gpu(dtype, D, group, page_size, mask, W):
    seq_lens = [W, W + 1, 1000, 4096, 32768]
    out, ref = run_extend([W] * 5, seq_lens, page_size, 4 * group, 4, D, dtype, "cuda",
                          mask=mask, splits=4, pad_rows=2)
    assert_close(out, ref, 1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_extend_gpu(dtype, page_size):
    q_lens = [300, 1, 77, 1024]
    seq_lens = [300, 500, 2000, 9000]
    out, ref = run_extend(q_lens, seq_lens, page_size, 32, 8, 128, dtype, "cuda")
    assert_close(out, ref, 1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 64])
def test_draft_branch_gpu(dtype, page_size):
    draft_prefix = [1, 300, 5000]
    out, ref = run_extend([4] * 3, [p + 12 for p in draft_prefix], page_size, 32, 8, 128,
                          dtype, "cuda", mask=DRAFT, draft_prefix=draft_prefix)
    assert_close(out, ref, 1e-2)


@pytest.mark.parametrize("mask", [CAUSAL, TREE, DRAFT])
@pytest.mark.parametrize("page_size,W,H,Hkv,per_request,heads_first,merge", [
    (16, 4, 4, 1, 2, False, "last"), (1, 3, 8, 2, 1, True, "last"), (64, 8, 4, 2, 3, True, "pass")])
def test_verify_chunk_schedule_cpu(mask, page_size, W, H, Hkv, per_request, heads_first, merge):
    """The chunk schedule on a long-tail batch (one request cut into many chunks, the rest
    whole), every mask; NaN in the workspace and in page 0 (the pad rows')."""
    seq_lens = [2500, W + 3, W, 300]
    draft = [max(n - W * 2, 0) for n in seq_lens] if mask == DRAFT else None
    out, ref = run_extend([W] * 4, seq_lens, page_size, H, Hkv, 16, torch.float32, "cpu", mask=mask,
                          splits=per_request, pad_rows=2, draft_prefix=draft, schedule="chunks", block_n=16,
                          heads_first=heads_first, merge=merge)
    assert_close(out, ref, 1e-5)


@pytest.mark.parametrize("rows,extra,match", [(20, {}, "max_q_len=20 > block_q=16"),
                                             (4, {"fuse": True}, "fuse=True applies to the split schedule")])
def test_chunk_schedule_refuses_what_it_cannot_run(rows, extra, match):
    """Requests wider than a tile, and a fused merge (the chunk passes merge their own way)."""
    kv = torch.zeros(64, 1, 16)
    cu = torch.tensor([0, rows, 2 * rows], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        extend_attention_fwd(torch.zeros(2 * rows, 4, 16), kv, kv, torch.zeros(2, 4, dtype=torch.int32),
                             torch.full((2,), 30, dtype=torch.int32), cu, 16, 1.0, rows, torch.zeros(2 * rows, 4, 16),
                             schedule="chunks", **extra)


@pytest.mark.cuda
@pytest.mark.parametrize("mask", [CAUSAL, TREE, DRAFT])
@pytest.mark.parametrize("W,H,Hkv,D,per_request,merge", [(4, 28, 4, 128, 2, "last"), (4, 32, 8, 64, 4, "pass"),
                                                         (8, 32, 8, 128, 1, "last"), (4, 8, 1, 128, 8, "pass")])
def test_verify_chunk_schedule_gpu(mask, W, H, Hkv, D, per_request, merge):
    seq_lens = [30000, W + 3, 700, 4096, W, 129]
    draft = [max(n - W * 2, 0) for n in seq_lens] if mask == DRAFT else None
    out, ref = run_extend([W] * len(seq_lens), seq_lens, 16, H, Hkv, D, torch.bfloat16, "cuda", mask=mask,
                          splits=per_request, pad_rows=2, draft_prefix=draft, schedule="chunks", merge=merge)
    assert_close(out, ref, 1e-2)


@pytest.mark.parametrize("mask", [CAUSAL, TREE, DRAFT])
def test_invariant_verify_is_bitwise_the_same_in_any_batch(mask):
    """Request 0 (three invariant chunks) alone and inside two other batches, every mask: the same
    bits, and the float64 reference."""
    W, H, Hkv, D, ps = 3, 6, 2, 16, 16
    table, lens, num_pages = make_paged_batch([2100, 7, 300, 40, 9, 1000], ps, seed=4)
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(num_pages * ps, Hkv, D, generator=g), torch.randn(num_pages * ps, Hkv, D, generator=g)
    q_req = torch.randn(6, W, H, D, generator=g)
    tree = torch.rand(6, W, W, generator=g) < 0.5
    tree.diagonal(dim1=1, dim2=2).fill_(True)
    got = []
    for ids in ([0], [0, 1, 2], [3, 0, 4, 5]):
        bs = len(ids)
        cu = torch.arange(0, (bs + 1) * W, W, dtype=torch.int32)
        q = q_req[ids].reshape(bs * W, H, D)
        out = torch.full((bs * W, H, D), float("nan"))
        draft = (lens[ids] - 2 * W).clamp(min=0).to(torch.int32) if mask == DRAFT else None
        custom = tree[ids].reshape(-1) if mask == TREE else None
        extend_attention_fwd(q, k, v, table[ids], lens[ids], cu, ps, D ** -0.5, W, out, mask=mask, custom_mask=custom,
                             draft_prefix_lens=draft, num_kv_splits=2, schedule="invariant")
        assert_close(out, ref_paged_attention(q, k, v, table[ids], lens[ids], cu, ps, D ** -0.5, mask, custom, draft),
                     1e-5)
        got.append(out[ids.index(0) * W:(ids.index(0) + 1) * W])
    assert all(torch.equal(got[0], o) for o in got[1:]), "request 0's rows depend on the batch"
