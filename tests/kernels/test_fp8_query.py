"""A bf16 query over an FP8 cache (issue #41): the GQA passes move each row of q by a power of
two into float16's range and run the tile dots in float16 (``kv_walk.fp8_query``). The
rows' magnitudes here sit far outside float16's (1e-7 underflows it, 3e5 overflows it), with
``sm_scale`` chosen to keep the scores of order 1; float64 over the dequantized cache is the
reference. Float16 dots run in the interpreter too, so this runs on the CPU (a bf16 dot there does
not)."""
import pytest
import torch
import triton
import triton.language as tl
from kernel_refs import assert_close, make_paged_batch, ref_paged_attention

from attn_backends.kv_cache import to_cache
from attn_backends_kernels.attention_core import decode_workspace
from attn_backends_kernels.decode_attention import decode_attention_fwd
from attn_backends_kernels.extend_attention import extend_attention_fwd
from attn_backends_kernels.kv_walk import widen_fp8
from attn_backends_kernels.schedule import chunk_workspace, slots_per_request

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []
SCALES = (0.05, 2.0)


def _inputs(seq_lens, W, magnitude, kv_dtype, H=8, Hkv=2, D=32, page=16, scales=SCALES):
    pt, lens, num_pages = make_paged_batch(seq_lens, page, pad_rows=1, device=DEVICE, seed=1)
    g = torch.Generator().manual_seed(2)
    kv = [to_cache(torch.randn(num_pages * page, Hkv, D, generator=g) * 3 * s, kv_dtype, s).to(DEVICE)
          for s in scales]                      # values of about 3 / scale stored
    q = (torch.randn(lens.shape[0] * W, H, D, generator=g) * magnitude).to(torch.bfloat16).to(DEVICE)
    q[::3, 1] *= 1e-3                           # rows of one program with other magnitudes
    deq = [c.double() * s for c, s in zip(kv, scales)]
    return pt, lens, kv, deq, q, (D ** -0.5) / magnitude


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("magnitude", [1e-7, 1.0, 3e5])
@pytest.mark.parametrize("schedule", ["split", "chunks"])
def test_decode_bf16_query_over_fp8_cache_of_any_magnitude(kv_dtype, magnitude, schedule):
    pt, lens, (kc, vc), (kd, vd), q, sm = _inputs([70, 5, 300], 1, magnitude, kv_dtype)
    bs, H, D = q.shape
    out = torch.full_like(q, float("nan"))
    ws = (decode_workspace(bs, H, D, 3, DEVICE) if schedule == "split" else
          chunk_workspace(bs, slots_per_request("chunks", 3, pt.shape[1] * 16), 1, H, 2, D, DEVICE))
    decode_attention_fwd(q, kc, vc, pt, lens, 16, sm, 3, out, ws, schedule=schedule,
                         merge="last" if schedule == "split" else "pass", k_scale=SCALES[0], v_scale=SCALES[1])
    ref = ref_paged_attention(q.double(), kd, vd, pt, lens, torch.arange(bs + 1, dtype=torch.int32), 16, sm)
    assert_close(out, ref, 1e-2)


@pytest.mark.parametrize("magnitude", [1e-7, 3e5])
def test_verify_bf16_query_over_fp8_cache_of_any_magnitude(magnitude):
    W = 4
    pt, lens, (kc, vc), (kd, vd), q, sm = _inputs([70, 9, 200], W, magnitude, torch.float8_e4m3fn)
    bs = lens.shape[0]
    cu = torch.arange(0, bs * W + 1, W, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    extend_attention_fwd(q, kc, vc, pt, lens, cu, 16, sm, W, out, num_kv_splits=2, k_scale=SCALES[0],
                         v_scale=SCALES[1])
    ref = ref_paged_attention(q.double(), kd, vd, pt, lens, cu, 16, sm)
    assert_close(out, ref, 1e-2)


@pytest.mark.parametrize("kv_dtype,v_scale,stored", [(torch.float8_e4m3fn, 300.0, 1000.0),
                                                     (torch.float8_e5m2, 8.0, 20000.0),
                                                     (torch.float8_e4m3fn, 1e-6, 0.05)])
def test_v_times_its_scale_past_float16s_range(kv_dtype, v_scale, stored):
    """V's stored values (about ``stored``, saturated) times its scale above float16's largest
    finite (65504) or below its least subnormal (2**-24): the cache is widened exactly and the
    scale taken in float32 (V rounded to float16 after its scale gave inf, then NaN, or zeros)."""
    pt, lens, (kc, vc), (kd, _), q, sm = _inputs([70, 5, 300], 1, 1.0, kv_dtype, scales=(0.05, v_scale))
    bs, H, D = q.shape
    g = torch.Generator().manual_seed(7)
    vc.copy_(to_cache(torch.randn(vc.shape, generator=g) * stored * v_scale, kv_dtype, v_scale).to(DEVICE))
    out = torch.full_like(q, float("nan"))
    decode_attention_fwd(q, kc, vc, pt, lens, 16, sm, 3, out, decode_workspace(bs, H, D, 3, DEVICE),
                         k_scale=SCALES[0], v_scale=v_scale)
    ref = ref_paged_attention(q.double(), kd, vc.double() * v_scale, pt, lens,
                              torch.arange(bs + 1, dtype=torch.int32), 16, sm)
    assert_close(out, ref, 1e-2)


@triton.jit
def _widen(x_ptr, y_ptr, R: tl.constexpr, C: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    tl.store(y_ptr + offs, widen_fp8(tl.load(x_ptr + offs)))


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", [(256,), (8, 32)])
def test_widen_fp8_is_torch_cast_on_every_code(kv_dtype, shape):
    """``kv_walk.widen_fp8`` (inline PTX where compiled, Triton's cast in the interpreter) against
    PyTorch's cast for all 256 codes: zeros, subnormals, the largest, infinities and NaN (as NaN),
    in 1-D and 2-D tiles (the PTX converts the bytes of a 32-bit register in order)."""
    codes = torch.arange(256, dtype=torch.uint8).view(kv_dtype)
    x = codes[torch.randperm(256, generator=torch.Generator().manual_seed(0))].reshape(shape).to(DEVICE)
    y = torch.empty(shape, dtype=torch.float16, device=DEVICE)
    R, C = (1, shape[0]) if len(shape) == 1 else shape
    _widen[(1,)](x, y, R, C)
    want = x.cpu().to(torch.float16)
    got = y.cpu()
    if DEVICE == "cpu":     # Triton 3.6's interpreter widens e4m3's NaN codes to +-480, e5m2's subnormals to 0
        normal = want.isfinite() & (want.abs() >= torch.finfo(kv_dtype).smallest_normal)
        got, want = got[normal], want[normal]
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))


@pytest.mark.parametrize("cap,q_dtype,refused", [((8, 0), torch.bfloat16, True), ((8, 6), torch.float16, True),
                                                 ((8, 9), torch.bfloat16, False), ((9, 0), torch.float16, False),
                                                 ((8, 0), torch.float32, False)])
def test_fp8_widening_below_sm89_is_one_line(monkeypatch, cap, q_dtype, refused):
    """The GQA launchers refuse an FP8 cache for a 16-bit query below sm_89 (its PTX conversions),
    before ptxas would; a float32 query widens by Triton's cast anywhere. Host logic: the device is
    an object, the capability patched."""
    from types import SimpleNamespace

    from attn_backends_kernels import attention_core as ac
    monkeypatch.setattr(ac, "capability", lambda index: cap)
    q = SimpleNamespace(device=torch.device("cuda", 0), dtype=q_dtype)
    kv = SimpleNamespace(dtype=torch.float8_e4m3fn)
    if refused:
        want = f"^decode_attention_fwd: an FP8 KV cache with a {str(q_dtype)[6:]} query needs sm_89\\+"
        with pytest.raises(ValueError, match=want):
            ac.check_fp8_widening("decode_attention_fwd", q, kv)
    else:
        ac.check_fp8_widening("decode_attention_fwd", q, kv)
    ac.check_fp8_widening("decode_attention_fwd", q, SimpleNamespace(dtype=q_dtype))     # no FP8: no check
