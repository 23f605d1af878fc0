"""An FP8 KV cache (issue #41), the contract: the config's KV dtype and per-layer scales, the
store's quantization (value / scale, saturated, round to nearest even), backends declaring the KV
dtypes they read (refusals with the reason, ``select``), and the reference ``torch_native``
reading an FP8 pool against float64 over the dequantized cache."""
import math

import pytest
import torch
from reference import dense_reference

from attn_backends import ForwardMode, ModelConfig, get_backend, select
from attn_backends.backends.trtllm_mla import TrtllmMLABackend
from attn_backends.check.scenarios import Scenario, make_memory, materialize
from attn_backends.config import FP8_KV
from attn_backends.kv_cache import to_cache

E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("kw,msg", [
    (dict(kv_dtype=torch.int8), "kv_dtype=torch.int8"),
    (dict(kv_scales=((1.0, 1.0),) * 2), "need an FP8 kv_dtype"),
    (dict(kv_dtype=E4M3, kv_scales=((1.0, 1.0),)), r"1 \(k, v\) pairs, the model 2 layers"),
    (dict(kv_dtype=E4M3, kv_scales=((1.0, 0.0), (1.0, 1.0))), r"kv_scales\[0\] = \(1.0, 0.0\)"),
    (dict(kv_dtype=E4M3, kv_scales=((1.0, 1.0), (math.inf, 1.0))), r"kv_scales\[1\]"),
    (dict(kv_dtype=E4M3, kv_scales=((2.0, 1.0), (1.0, 1.0)), is_mla=True, num_kv_heads=1), "one scale"),
])
def test_the_config_refuses_kv_settings_it_cannot_mean(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ModelConfig(num_layers=2, num_q_heads=4, **{"num_kv_heads": 2, **kw})


def test_the_layer_record_carries_its_scales_and_the_cache_dtype_defaults_to_the_models():
    plain = ModelConfig(num_layers=2, num_q_heads=4, num_kv_heads=2, dtype=torch.float16)
    assert plain.cache_dtype == torch.float16 and (plain.layer(1).k_scale, plain.layer(1).v_scale) == (1.0, 1.0)
    fp8 = ModelConfig(num_layers=2, num_q_heads=4, num_kv_heads=2, kv_dtype=E4M3, kv_scales=((0.5, 2.0), (3.0, 0.25)))
    assert fp8.cache_dtype == E4M3 and (fp8.layer(1).k_scale, fp8.layer(1).v_scale) == (3.0, 0.25)


@pytest.mark.parametrize("dtype", FP8_KV)
def test_the_store_divides_by_the_scale_saturates_and_rounds_to_nearest_even(dtype):
    top = torch.finfo(dtype).max
    x = torch.tensor([0.0, 1.0, -3.3, 1e9, -1e9, top * 2 * 0.5, float("nan")])
    got = to_cache(x, dtype, 0.5).float()
    assert got[3] == top and got[4] == -top, f"not saturated: {got[3:5]}"
    assert got[6].isnan()
    want = (x[:3] / 0.5).to(dtype).float()          # torch's cast rounds to nearest even
    assert torch.equal(got[:3], want) and got[1] == 2.0
    assert to_cache(torch.tensor([1.5]), torch.bfloat16, 4.0).item() == 1.5, "a non-FP8 cache is a plain cast"


def test_backends_declare_the_kv_dtypes_they_read():
    """triton and triton_mla read FP8 KV (select takes them); trtllm_mla does not yet: refused with
    the reason by name and by construction."""
    mla = ModelConfig(num_layers=1, num_q_heads=16, num_kv_heads=1, is_mla=True, page_size=16, kv_dtype=E4M3)
    mem = make_memory(mla, num_pages=8, max_reqs=2, max_context_len=64, fill=False)
    with pytest.raises(ValueError, match=r"'trtllm_mla' cannot serve .*: KV dtype float8_e4m3fn not read"):
        get_backend("trtllm_mla", mla, mem)
    with pytest.raises(ValueError, match="backend trtllm_mla reads KV in the model's dtype, not torch.float8_e4m3fn"):
        TrtllmMLABackend(mla, mem)
    assert select(mla, ForwardMode.DECODE, "cpu").name == "triton_mla"
    gqa = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16, kv_dtype=E4M3)
    assert select(gqa, ForwardMode.DECODE, "cpu").name == "triton"
    plain = make_memory(ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16),
                        num_pages=8, max_reqs=2, max_context_len=64)
    with pytest.raises(ValueError, match="KV dtype torch.float8_e4m3fn differs from the KV memory's torch.float32"):
        get_backend("torch_native", gqa, plain)


def test_an_fp8_cache_is_refused_below_sm89_and_flashinfer_declares_it():
    """FP8 conversions in kernels need sm_89+: a CUDA device of sm_80 is refused with the reason,
    whatever the backend's own floor, but by torch_native (PyTorch casts FP8 on any GPU); the
    ``flashinfer`` GQA backend reads FP8 (its run() takes the scales)."""
    from attn_backends.backends.flashinfer_backend import FlashInferBackend
    from attn_backends.backends.torch_native import TorchNativeBackend
    gqa = ModelConfig(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, kv_dtype=E4M3,
                      dtype=torch.bfloat16)
    from attn_backends.backends.triton_backend import TritonBackend
    for caps in (TritonBackend.capabilities, FlashInferBackend.capabilities):
        assert caps.refusal(gqa, ForwardMode.DECODE, "cuda", sm=80) == \
            "an FP8 KV cache needs sm_89+ (FP8 conversions), device is sm_80"
        assert caps.refusal(gqa, ForwardMode.DECODE, "cuda", sm=90) is None
    assert TorchNativeBackend.capabilities.refusal(gqa, ForwardMode.DECODE, "cuda", sm=80) is None   # torch's casts
    assert caps.refusal(ModelConfig(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                                    dtype=torch.bfloat16), ForwardMode.DECODE, "cuda", sm=80) is None


def test_select_and_get_backend_apply_this_gpus_fp8_floor(monkeypatch):
    """``refusal`` (which ``select`` and ``get_backend`` ask) checks the FP8 floor against this GPU's
    compute capability, not only against the backend's own: an sm_80 GPU is refused for triton on
    an e4m3 cache, sm_90 is not, and a bf16 cache on sm_80 is not."""
    from attn_backends import registry
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gqa = ModelConfig(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, kv_dtype=E4M3,
                      dtype=torch.bfloat16)
    for sm, want in ((80, "an FP8 KV cache needs sm_89+ (FP8 conversions), device is sm_80"), (90, None)):
        monkeypatch.setattr(registry, "device_sm", lambda sm=sm: sm)
        assert registry.refusal("triton", gqa, ForwardMode.DECODE, "cuda") == want
    bf16 = ModelConfig(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16)
    assert registry.refusal("triton", bf16, ForwardMode.DECODE, "cuda") is None


@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("dtype", FP8_KV)
def test_torch_native_reads_an_fp8_pool_against_float64_over_the_dequantized_cache(mla, dtype):
    """Stored through forward (scales of each layer), then read: equal to float64 attention over the
    cache as dequantized, and within FP8's error of the unquantized K/V (a relative error, so a
    wrong scale on either side shows); unused slots NaN."""
    scales = ((0.05, 0.05), (0.5, 0.5)) if mla else ((0.05, 2.0), (0.5, 0.125))
    dims = dict(num_kv_heads=1, is_mla=True, kv_lora_rank=32, qk_rope_head_dim=16) if mla else \
        dict(num_kv_heads=2, head_dim=16)
    cfg = ModelConfig(num_layers=2, num_q_heads=4, page_size=16, kv_dtype=dtype, kv_scales=scales, **dims)
    mem = make_memory(cfg, num_pages=40, max_reqs=4, max_context_len=256, seed=2)
    for b in (mem.pool.kv if mla else mem.pool.k + mem.pool.v):
        b.fill_(float("nan"))                       # every slot the batch does not write
    be = get_backend("torch_native", cfg, mem)
    m = materialize(Scenario(ForwardMode.EXTEND, 3, [0, 0, 0], extend_lens=[37, 5, 20]), mem,
                    be.get_cuda_graph_seq_len_fill_value())
    g = torch.Generator().manual_seed(4)
    n = m.batch.num_tokens
    q = torch.randn(n, 4, cfg.qk_dim, generator=g)
    k = torch.randn(n, cfg.num_kv_heads, cfg.qk_dim, generator=g) * 3
    v = None if mla else torch.randn(n, cfg.num_kv_heads, cfg.v_head_dim, generator=g) * 3
    layer = cfg.layer(1)
    be.init_forward_metadata(m.batch)
    out = be.forward(q, k, v, layer, m.batch)
    ref = dense_reference(m.batch, mem, 1, q, layer.scaling, cfg.kv_lora_rank, layer.k_scale, layer.v_scale)
    assert not out.isnan().any()
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 1e-6, f"against the dequantized cache: {err:.2e}"
    exact = ModelConfig(num_layers=2, num_q_heads=4, page_size=16, **dims)
    mem32 = make_memory(exact, num_pages=40, max_reqs=4, max_context_len=256, seed=2)
    be32 = get_backend("torch_native", exact, mem32)
    m32 = materialize(Scenario(ForwardMode.EXTEND, 3, [0, 0, 0], extend_lens=[37, 5, 20]), mem32, 1)
    be32.init_forward_metadata(m32.batch)
    full = be32.forward(q, k, v, exact.layer(1), m32.batch)
    rel = float((out - full).norm() / full.norm())
    # rounding to 3 (e4m3) or 2 (e5m2) mantissa bits: measured 0.039-0.044 and 0.070-0.095 here
    assert rel < (0.07 if dtype == E4M3 else 0.14), f"FP8 against float32 K/V: relative error {rel:.4f}"


def test_a_composition_reads_fp8_only_where_every_member_does():
    from attn_backends.backends.hybrid import compose_capabilities
    both = compose_capabilities({ForwardMode.EXTEND: ("torch_native", None), ForwardMode.DECODE: ("triton", None)})
    assert set(both.kv_dtypes) == set(FP8_KV)
    mixed = compose_capabilities({ForwardMode.EXTEND: ("torch_native", "torch_native"),
                                  ForwardMode.DECODE: ("triton", "trtllm_mla")})
    assert mixed.kv_dtypes == (), "trtllm_mla reads no FP8: the composition must not claim it"


def test_an_mla_layer_of_two_scales_is_refused():
    """One latent cache has one scale: a layer record whose k and v scales differ (ModelConfig never
    makes one) is refused where it is made, so no backend reads the cache with either."""
    import dataclasses
    cfg = ModelConfig(num_layers=1, num_q_heads=16, num_kv_heads=1, is_mla=True, kv_lora_rank=32,
                      qk_rope_head_dim=16, page_size=16, kv_dtype=E4M3, kv_scales=((0.5, 0.5),))
    with pytest.raises(ValueError, match=r"MLA layer 0: k_scale 0.5 != v_scale 0.25 \(the latent cache has one"):
        dataclasses.replace(cfg.layer(0), v_scale=0.25)
    gqa = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16, kv_dtype=E4M3,
                      kv_scales=((0.5, 0.25),))
    assert (gqa.layer(0).k_scale, gqa.layer(0).v_scale) == (0.5, 0.25)
