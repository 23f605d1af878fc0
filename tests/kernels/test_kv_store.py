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


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _fp8_probe_values(dtype):
    """Every finite value of the format, the midpoints between neighbours (ties: nearest even),
    one float32 step either side of them, signed zeros and infinities, just past the largest,
    and random values over seven magnitudes (float32 subnormals to past the range)."""
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    every = every[every.isfinite()].unique()
    mids = (every[1:] + every[:-1]) / 2
    up, down = mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(-float("inf")))
    top = torch.finfo(dtype).max
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), top * 1.01, -top * 1.01, 1e-40, -1e-40])
    g = torch.Generator().manual_seed(0)
    rand = torch.cat([torch.randn(256, generator=g) * s for s in (1e-6, 1e-3, 0.05, 1, 30, 1e3, 1e6)])
    return torch.cat([every, mids, up, down, edges, rand])


@pytest.mark.parametrize("scale", [1.0, 0.05, 3.7])
@pytest.mark.parametrize("dtype", FP8)
def test_fp8_store_is_the_references_quantization_bit_for_bit(dtype, scale):
    """The store kernel's FP8 bytes equal ``kv_cache.to_cache``'s (value / scale exactly rounded,
    saturated, nearest even) on every probe value. NaN is left out: under the interpreter its
    float-to-FP8 cast turns NaN into a finite byte (the GPU's cast keeps NaN)."""
    from attn_backends.kv_cache import to_cache
    x = _fp8_probe_values(dtype)
    x = torch.cat([x, torch.zeros((-x.numel()) % 16)]).view(-1, 1, 16)
    T = x.shape[0]
    kb, vb = torch.zeros(T + 1, 1, 16, dtype=dtype), torch.zeros(T + 1, 1, 16, dtype=dtype)
    store_kv(x, x * 2, kb, vb, torch.arange(1, T + 1), scale, 2 * scale)
    for buf, src, s in ((kb, x, scale), (vb, x * 2, 2 * scale)):
        got, want = buf[1:].view(torch.uint8), to_cache(src, dtype, s).view(torch.uint8)
        bad = (got != want).nonzero()
        assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at value {src[tuple(bad[0])].item()!r}"


def test_fp8_scales_are_refused_where_they_cannot_apply():
    k = torch.randn(2, 1, 16)
    loc = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="scale=2.0: .* only for an FP8 buffer"):
        store_kv(k, k, torch.zeros(4, 1, 16), torch.zeros(4, 1, 16), loc, 2.0, 1.0)
    with pytest.raises(ValueError, match="scale=0.0"):
        store_kv(k, k, torch.zeros(4, 1, 16, dtype=FP8[0]), torch.zeros(4, 1, 16, dtype=FP8[0]), loc, 0.0, 1.0)
    with pytest.raises(ValueError, match="store_mla_kv: scale=2.0: .* only for an FP8 buffer"):
        store_mla_kv(torch.randn(2, 1, 8), torch.randn(2, 1, 8), torch.zeros(4, 1, 16), loc, 2.0)
    from attn_backends_kernels.decode_attention import decode_attention_fwd
    with pytest.raises(ValueError, match=r"k_scale, v_scale = \(0.5, 1.0\) need FP8 KV buffers"):
        decode_attention_fwd(torch.randn(1, 2, 16), torch.zeros(16, 1, 16), torch.zeros(16, 1, 16),
                             torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 16, 0.25, 1,
                             torch.empty(1, 2, 16), k_scale=0.5)
