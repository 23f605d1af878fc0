"""The ``triton_mla`` backend on an FP8 latent cache (issue #41): stored through ``forward`` by the
store kernel (latent and rope / the layer's one scale: the reference quantization's bytes), read by
the Triton MLA tile (widened on load, the scale in the softmax scale and on the stored output: the
split and the chunk schedules, ragged extend) against float64 over the dequantized cache, NaN in
every unused slot, the graph path equal to eager bitwise; the Gluon kernels refuse FP8 by name."""
import random

import pytest
import torch
from fp8_checks import check_fp8_forward

from attn_backends import ForwardMode, ModelConfig
from attn_backends.backends.triton_mla import TritonMLABackend
from attn_backends.check.scenarios import Scenario, draft_extend_spec, make_memory, verify_spec
from attn_backends_kernels.mla.attention import mla_attention_fwd

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []     # the interpreter on the CPU
MODEL_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
RNG = random.Random(1)
SCALES = ((0.05, 0.05), (0.5, 0.5))
SCENARIOS = {
    "decode": lambda: Scenario(ForwardMode.DECODE, 3, [700, 17, 300]),
    "verify_tree": lambda: Scenario(ForwardMode.TARGET_VERIFY, 3, [600, 33, 200],
                                    spec=verify_spec(6, 3, RNG, topk=4, steps=2)),
    "draft_extend": lambda: Scenario(ForwardMode.DRAFT_EXTEND, 3, [500, 20, 90],
                                     spec=draft_extend_spec(4, 3, 3, [1, 3, 2])),
    "extend": lambda: Scenario(ForwardMode.EXTEND, 3, [150, 0, 40], extend_lens=[20, 33, 7]),
}


def _setup(dtype):
    cfg = ModelConfig(num_layers=2, num_q_heads=16, num_kv_heads=1, is_mla=True, kv_lora_rank=32,
                      qk_rope_head_dim=16, page_size=16, dtype=MODEL_DTYPE, kv_dtype=dtype, kv_scales=SCALES)
    mem = make_memory(cfg, num_pages=2000 // 16 + 64, max_reqs=12, max_context_len=1024, page_order="shuffled",
                      seed=3, device=DEVICE)
    return cfg, mem


# e5m2 differs from e4m3 in the widening alone: every mode on e4m3, decode on both
CASES = [(torch.float8_e4m3fn, name) for name in SCENARIOS] + [(torch.float8_e5m2, "decode")]


@pytest.mark.parametrize("schedule", ["split", "chunks"])
@pytest.mark.parametrize("dtype,name", CASES, ids=[f"{str(d)[13:]}-{n}" for d, n in CASES])
def test_fp8_latent_cache_against_float64_over_the_dequantized_cache(dtype, name, schedule):
    cfg, mem = _setup(dtype)
    be = TritonMLABackend(cfg, mem)
    be.schedule = schedule

    def qkv(n):
        g = torch.Generator().manual_seed(5)
        q = torch.randn(n, 16, cfg.qk_dim, generator=g).to(MODEL_DTYPE).to(DEVICE)
        return q, (torch.randn(n, 1, cfg.qk_dim, generator=g) * 3).to(MODEL_DTYPE).to(DEVICE), None
    check_fp8_forward(be, cfg, mem, SCENARIOS[name], qkv, name == "extend",
                      1e-5 if MODEL_DTYPE == torch.float32 else 2e-2)


def test_the_gluon_kernels_refuse_an_fp8_cache_by_name():
    q = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(64, 1, 576, dtype=torch.float8_e4m3fn)
    pt, lens = torch.arange(4, dtype=torch.int32).view(2, 2), torch.full((2,), 20, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"the wgmma kernel does not read an FP8 cache \(torch.float8_e4m3fn\)"):
        mla_attention_fwd(q, kv, pt, lens, 16, 0.1, 1, torch.zeros(2, 16, 512, dtype=torch.bfloat16), kernel="wgmma",
                          kv_scale=0.5)
    with pytest.raises(ValueError, match=r"k_scale, v_scale = \(0.5, 0.5\) need FP8 KV buffers"):
        mla_attention_fwd(q, kv.to(torch.bfloat16), pt, lens, 16, 0.1, 1, torch.zeros(2, 16, 512, dtype=torch.bfloat16),
                          kv_scale=0.5)


def test_eager_partials_of_an_fp8_cache_are_the_backends_on_hopper(monkeypatch):
    """On sm_90 a bf16 model's 64-row tiles keep 16-bit split partials where a Gluon kernel runs;
    an FP8 cache runs the Triton tile, float32 partials, and the wrapper's own workspace (eager)
    must round as the backend's graph workspace does (sized by the cache's dtype)."""
    import attn_backends_kernels.mla.attention as attention
    import attn_backends_kernels.mla.warpspec as warpspec
    monkeypatch.setattr(warpspec, "hopper_device", lambda device: True)
    seen = []

    def stop(name, out, workspace, splits, part_dtype=None, **kw):
        seen.append(part_dtype)
        raise StopIteration

    monkeypatch.setattr(attention, "split_targets", stop)
    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    pt, lens = torch.arange(4, dtype=torch.int32).view(2, 2), torch.full((2,), 100, dtype=torch.int32)
    for kv_dtype, want in ((torch.bfloat16, torch.bfloat16), (torch.float8_e4m3fn, torch.float32)):
        with pytest.raises(StopIteration):
            mla_attention_fwd(q, torch.zeros(256, 1, 576, dtype=kv_dtype), pt, lens, 64, 0.1, 2,
                              torch.zeros(2, 64, 512, dtype=torch.bfloat16), kernel="triton")
        assert seen[-1] == want == warpspec.partial_dtype(kv_dtype, q.device, 64, 64, 512, 64)
