"""The ``flashinfer_mla`` backend on an FP8 latent cache (issue #41): FlashInfer's MLA reads e4m3
with a bf16 query on SM90 (``plan(kv_data_type=e4m3, scale_mode="kv-per-tensor")``,
``run(ckv_scale=, kpe_scale=)``); e5m2, an fp16 model and other GPUs are refused with the reason.

One forward per mode (stored by ``forward``, NaN bytes in every unread slot) against float64 over
the dequantized cache, the graph form equal to eager bitwise (tests/support/fp8_checks.py): on the
CPU through FlashInfer's Python over the emulated kernels (tests/support/fi_emulation.py: the
module built for the plan's KV dtype, the scales as ``run()`` hands them to the kernel), where
``import flashinfer`` works; on a GPU (marked ``cuda``) the real fa3 kernels. A scale handed as 1
(the value dropped) is caught."""
import importlib.util
import random

import fi_emulation as E
import pytest
import torch
from fp8_checks import check_fp8_forward

from attn_backends import ForwardMode, ModelConfig
from attn_backends.backends.flashinfer_mla import FlashInferMLABackend, MLACall
from attn_backends.check.scenarios import Scenario, draft_extend_spec, make_memory, verify_spec

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16
SCALES = ((0.5, 0.5), (0.0372, 0.0372))      # layer 1's is not a bf16 value: the kernel rounds it
RNG = random.Random(1)
SCENARIOS = {
    "decode": lambda: Scenario(ForwardMode.DECODE, 3, [700, 17, 300]),
    "verify_chain": lambda: Scenario(ForwardMode.TARGET_VERIFY, 3, [600, 33, 200], spec=verify_spec(4, 3, RNG)),
    "draft_extend": lambda: Scenario(ForwardMode.DRAFT_EXTEND, 3, [500, 20, 90],
                                     spec=draft_extend_spec(4, 3, 3, [1, 3, 2])),
    "extend": lambda: Scenario(ForwardMode.EXTEND, 3, [150, 0, 40], extend_lens=[20, 33, 7]),
}
needs_fi = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                              reason="flashinfer is not importable here (needs Python 3.12 and its wheels)")


def _config(dtype=BF16, kv=E4M3):
    return ModelConfig(num_layers=2, num_q_heads=16, is_mla=True, page_size=16, dtype=dtype, kv_dtype=kv,
                       kv_scales=SCALES)


def _check(cls, name, device):
    cfg = _config()
    mem = make_memory(cfg, num_pages=2000 // 16 + 64, max_reqs=12, max_context_len=1024, page_order="shuffled",
                      seed=3, device=device)

    def qkv(n):
        g = torch.Generator().manual_seed(5)
        q = torch.randn(n, 16, cfg.qk_dim, generator=g).to(BF16).to(device)
        return q, (torch.randn(n, 1, cfg.qk_dim, generator=g) * 3).to(BF16).to(device), None
    check_fp8_forward(cls(cfg, mem), cfg, mem, SCENARIOS[name], qkv, name == "extend", 2e-2)


@pytest.fixture
def emulated(monkeypatch):
    E.install(monkeypatch)
    return E.EmulatedFlashInferMLA


@pytest.mark.parametrize("name", SCENARIOS)
def test_emulated_fp8_latent_cache_against_float64_over_the_dequantized_cache(emulated, name):
    _check(emulated, name, "cpu")


def test_emulated_a_dropped_scale_is_caught(emulated, monkeypatch):
    """ckv/kpe scales handed as 1: FlashInfer takes them, only the values show it."""
    monkeypatch.setattr(MLACall, "run", lambda self, q, pages, layer: self.wrapper.run(
        query=q, kv_cache=pages, ckv_scale=1.0, kpe_scale=1.0))
    with pytest.raises(AssertionError, match="relative error"):
        _check(emulated, "decode", "cpu")


@pytest.mark.cuda
@needs_fi
@pytest.mark.parametrize("name", SCENARIOS)
def test_gpu_fp8_latent_cache_against_float64_over_the_dequantized_cache(name):
    """The real kernels (fa3 on sm_90; other GPUs refuse FP8 in the constructor)."""
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        pytest.skip(f"FlashInfer's MLA reads FP8 on sm_90 only, this GPU is sm_{cap[0]}{cap[1]}")
    _check(FlashInferMLABackend, name, "cuda")


def test_what_flashinfer_mla_does_not_read_is_refused_with_the_reason():
    caps = FlashInferMLABackend.capabilities
    assert caps.refusal(_config(), ForwardMode.DECODE, "cuda", 90) is None
    assert caps.refusal(_config(kv=torch.float8_e5m2), ForwardMode.DECODE, "cuda", 90) == \
        "KV dtype float8_e5m2 not read (the model's dtype, float8_e4m3fn)"
    assert caps.refusal(_config(), ForwardMode.DECODE, "cuda", 89) == \
        "an FP8 KV cache needs sm_90+ (FP8 conversions), device is sm_89"
    assert caps.refusal(_config(dtype=torch.float16), ForwardMode.DECODE, "cuda", 90) == \
        "an FP8 KV cache is read with a bfloat16 model only, model is float16"
    assert caps.refusal(_config(), ForwardMode.DECODE, "cuda", 100) == \
        "an FP8 KV cache is read below sm_100 only, device is sm_100"
    plain = ModelConfig(num_layers=2, num_q_heads=16, is_mla=True, page_size=16, dtype=torch.float16)
    assert caps.refusal(plain, ForwardMode.DECODE, "cuda", 100) is None
    # what select asks: the model's reason before this machine's (flashinfer may be missing here)
    from attn_backends import registry
    assert registry.refusal("flashinfer_mla", _config(dtype=torch.float16), ForwardMode.DECODE, "cuda") == \
        "an FP8 KV cache is read with a bfloat16 model only, model is float16"
    mem = lambda cfg: make_memory(cfg, num_pages=8, max_reqs=2, max_context_len=64)  # noqa: E731
    fp16 = _config(dtype=torch.float16)
    want = "^backend fi_mla_emulated: an FP8 KV cache is read with a bfloat16 model only, model is float16$"
    with pytest.raises(ValueError, match=want):
        E.EmulatedFlashInferMLA(fp16, mem(fp16))
    e5m2 = _config(kv=torch.float8_e5m2)
    with pytest.raises(ValueError, match=r"reads KV in the model's dtype, float8_e4m3fn, not torch.float8_e5m2"):
        E.EmulatedFlashInferMLA(e5m2, mem(e5m2))


def test_a_scale_on_a_cache_of_the_models_dtype_is_refused_not_dropped():
    from types import SimpleNamespace
    call = SimpleNamespace(fp8=False, cfg=SimpleNamespace(cache_dtype=BF16), wrapper=None)
    with pytest.raises(ValueError, match=r"^flashinfer_mla: k_scale 2.0 on a torch.bfloat16 cache \(FP8 alone\)$"):
        MLACall.run(call, None, None, SimpleNamespace(k_scale=2.0, v_scale=2.0))
