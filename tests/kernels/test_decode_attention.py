import pytest
import torch
from kernel_refs import assert_close, make_paged_batch, ref_paged_attention

from attn_backends_kernels.attention_core import decode_workspace
from attn_backends_kernels.decode_attention import decode_attention_fwd


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
