import pytest
import torch

from kernel_refs import assert_close, make_paged_batch, ref_paged_attention
from kernels.decode_attention import decode_attention_fwd, decode_workspace


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


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode_gpu(dtype, D, group, page_size):
    seq_lens = [1, 17, 700, 4096, 32768, 129]
    out, ref = run_decode(seq_lens, page_size, 4 * group, 4, D, 8, dtype, "cuda", pad_rows=2)
    assert_close(out, ref, 1e-2)
