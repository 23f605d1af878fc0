import pytest
import torch

from attn_backends_kernels.kv_store import store_kv, store_mla_kv


@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
def test_store_kv(loc_dtype):
    torch.manual_seed(0)
    T, Hkv, D, Dv, slots = 5, 3, 16, 8, 40
    qkv = torch.randn(T, Hkv * (D + Dv) + 4)  # strided views of a fused projection
    k = qkv[:, :Hkv * D].view(T, Hkv, D)
    v = qkv[:, Hkv * D:Hkv * (D + Dv)].view(T, Hkv, Dv)
    k_buf = torch.randn(slots, Hkv, D)
    v_buf = torch.randn(slots, Hkv, Dv)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    loc = torch.randperm(slots - 1)[:T].to(loc_dtype) + 1
    store_kv(k, v, k_buf, v_buf, loc)
    k_ref[loc.long()] = k
    v_ref[loc.long()] = v
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)


def test_store_kv_strided_slots():
    """out_cache_loc as a column of a [bs, steps] slot table (the draft runner's eager path):
    a strided view; the kernel must follow its stride (read as contiguous, it writes other slots)."""
    torch.manual_seed(1)
    T, Hkv, D, slots, steps = 6, 2, 8, 64, 3
    table = (torch.randperm(slots - 1)[:T * steps] + 1).view(T, steps)
    loc = table[:, 1]                                  # stride 3
    assert loc.stride(0) == steps
    k, v = torch.randn(T, Hkv, D), torch.randn(T, Hkv, D)
    k_buf, v_buf = torch.randn(slots, Hkv, D), torch.randn(slots, Hkv, D)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    store_kv(k, v, k_buf, v_buf, loc)
    k_ref[loc], v_ref[loc] = k, v
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)


def test_store_mla_kv():
    torch.manual_seed(0)
    T, slots = 4, 20
    latent = torch.randn(T, 1, 512)
    rope = torch.randn(T, 1, 64)
    kv = torch.randn(slots, 1, 576)
    ref = kv.clone()
    loc = torch.tensor([7, 0, 19, 3], dtype=torch.int64)
    store_mla_kv(latent, rope, kv, loc)
    ref[loc] = torch.cat([latent, rope], -1)
    assert torch.equal(kv, ref)


def test_store_kv_rejects_dtype_mismatch():
    with pytest.raises(ValueError, match="buffer is torch.float16"):
        store_kv(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(3, 1, 4).half(),
                 torch.zeros(3, 1, 4).half(), torch.zeros(1, dtype=torch.int32))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_kv_gpu(dtype):
    T, Hkv, D, slots = 300, 8, 128, 4096
    k = torch.randn(T, Hkv, D, device="cuda").to(dtype)
    v = torch.randn(T, Hkv, D, device="cuda").to(dtype)
    k_buf = torch.zeros(slots, Hkv, D, device="cuda", dtype=dtype)
    v_buf = torch.zeros_like(k_buf)
    loc = torch.randperm(slots - 1, device="cuda")[:T] + 1
    store_kv(k, v, k_buf, v_buf, loc)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
