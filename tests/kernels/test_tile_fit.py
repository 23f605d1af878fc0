"""Kernel tiles fit the card's shared memory in every dtype a backend serves (a float32 MLA
prefill tile sized as for 16 bits needs more than an H200's 232,448 bytes): the rule on the CPU
with the H200's limit patched in, the launches themselves on a GPU."""
import pytest
import torch
from kernel_refs import CAUSAL, TREE, assert_close
from test_extend_attention import run_extend
from test_mla_attention import run_mla

import attn_backends_kernels.attention_core as core
import attn_backends_kernels.extend_attention as ea
import attn_backends_kernels.mla.attention as mla

H200_SMEM = 232_448
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def h200(monkeypatch):
    fits = lambda t, nbytes: nbytes <= H200_SMEM
    monkeypatch.setattr(core, "shared_mem_fits", fits)


@pytest.mark.parametrize("dtype,W,H,want", [
    (torch.float32, 16, 16, 32),     # ragged prefill, 64-row tile: 64 tokens x 2 stages need 294,912 bytes
    (torch.bfloat16, 16, 16, 64),    # the same tile at 16 bits keeps its 64 tokens
    (torch.float32, 1, 128, 32),     # 64-head decode tile
    (torch.bfloat16, 1, 16, 64),     # 16-head decode tile: 3 stages of 64 tokens at 16 bits
    (torch.float32, 4, 4, 32),       # 16-row tile: 32 tokens
])
def test_mla_tile_fits_h200(h200, dtype, W, H, want):
    q = torch.empty(W, H, 576, dtype=dtype)
    _, _, block_n, _, _ = mla._tile_config(q, W, H, 576, None, None, None, None, None)
    assert block_n == want
    assert 2 * block_n * 576 * q.element_size() + core.SMEM_RESERVE <= H200_SMEM


def test_mla_tile_keeps_the_callers_block_n(h200):
    q = torch.empty(16, 16, 576, dtype=torch.float32)
    assert mla._tile_config(q, 16, 16, 576, None, None, 64, None, None)[2] == 64


@pytest.mark.parametrize("dtype,D,group,W,want", [
    (torch.float32, 256, 4, 16, 32),   # head dim 256 at float32: K and V tiles of 64 tokens do not fit
    (torch.bfloat16, 256, 4, 16, 64),
    (torch.float32, 128, 8, 4, 64),    # the 32-row verify tile at float32
    (torch.float32, 128, 4, 16, 64),
])
def test_extend_tile_fits_h200(h200, monkeypatch, dtype, D, group, W, want):
    seen = []
    monkeypatch.setattr(ea, "launch", lambda kernel, grid, *a, **kw: seen.append(kw))
    q = torch.zeros(W, group, D, dtype=dtype)
    kv = torch.zeros(16, 1, D, dtype=dtype)
    ea.extend_attention_fwd(q, kv, kv, torch.zeros(1, 1, dtype=torch.int32), torch.full((1,), W, dtype=torch.int32),
                            torch.tensor([0, W], dtype=torch.int32), 16, 1.0, W, torch.empty_like(q))
    kw = seen[0]
    assert kw["BLOCK_N"] == want
    assert 2 * kw["BLOCK_N"] * 2 * D * q.element_size() + core.SMEM_RESERVE <= H200_SMEM


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,W,mask", [(16, 1, CAUSAL), (128, 1, CAUSAL), (16, 4, CAUSAL), (128, 4, CAUSAL),
                                      (16, 8, TREE)])
def test_mla_launches_in_every_dtype_gpu(dtype, H, W, mask):
    out, ref = run_mla([W, 700, 3000], W, 64, H, dtype, "cuda", mask=mask, splits=2, pad_rows=1)
    assert_close(out, ref, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_ragged_prefill_in_every_dtype_gpu(dtype):
    """The ragged EXTEND of the MLA backend's prefill (the crash of #38.4), through its launcher."""
    torch.manual_seed(0)
    from kernel_refs import make_paged_batch, ref_paged_attention
    q_lens, seq_lens = [300, 1, 77], [300, 500, 2000]
    page_table, lens, num_pages = make_paged_batch(seq_lens, 64, device="cuda")
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
    kv = torch.randn(num_pages * 64, 1, 576, device="cuda").to(dtype)
    q = torch.randn(int(cu[-1]), 16, 576, device="cuda").to(dtype)
    out = torch.full((q.shape[0], 16, 512), float("nan"), device="cuda", dtype=dtype)
    mla.mla_attention_fwd(q, kv, page_table, lens, 64, 0.1, 1, out, cu_seqlens_q=cu, max_q_len=max(q_lens))
    ref = ref_paged_attention(q, kv, kv[:, :, :512], page_table, lens, cu, 64, 0.1, CAUSAL)
    assert_close(out, ref, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,group,W", [(256, 4, 4), (128, 8, 4), (64, 1, 4)])
def test_extend_launches_in_every_dtype_gpu(dtype, D, group, W):
    out, ref = run_extend([W] * 3, [W, 900, 4000], 16, 4 * group, 4, D, dtype, "cuda", splits=2, pad_rows=1)
    assert_close(out, ref, 1e-5 if dtype == torch.float32 else 1e-2)
    out, ref = run_extend([300, 1, 77], [300, 500, 2000], 16, 4 * group, 4, D, dtype, "cuda")
    assert_close(out, ref, 1e-5 if dtype == torch.float32 else 1e-2)
