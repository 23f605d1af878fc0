"""The ``triton`` backend on an FP8 KV cache (issue #41): stored through ``forward`` by the store
kernel (value / scale, saturated, nearest even: equal to the reference quantization bit for bit),
read by every GQA pass (decode and the uniform modes on the chunk schedule, ragged extend on
splits, the split schedule too) against float64 over the dequantized cache, NaN in every unused
slot, the graph path equal to eager bitwise, and layers of other scales on one eager step."""
import random

import pytest
import torch
from fp8_checks import check_fp8_forward, poison_unread
from reference import dense_reference

from attn_backends import ForwardMode, ModelConfig
from attn_backends.backends.triton_backend import TritonBackend
from attn_backends.check.scenarios import Scenario, draft_extend_spec, make_memory, materialize, verify_spec
from attn_backends.config import FP8_KV
from attn_backends.step.eager import eager_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter on the CPU; on a GPU these are GPU tests (`pytest -m cuda` picks them)
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []
MODEL_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
RNG = random.Random(0)
SCALES = ((0.05, 2.0), (0.5, 0.125))
SCENARIOS = {
    "decode": lambda: Scenario(ForwardMode.DECODE, 5, [2000, 17, 0, 600]),
    "verify_tree": lambda: Scenario(ForwardMode.TARGET_VERIFY, 4, [1900, 33, 700],
                                    spec=verify_spec(6, 4, RNG, topk=4, steps=2)),
    "draft_extend": lambda: Scenario(ForwardMode.DRAFT_EXTEND, 4, [1900, 20, 700],
                                     spec=draft_extend_spec(4, 4, 3, [1, 3, 2])),
    "extend": lambda: Scenario(ForwardMode.EXTEND, 3, [300, 0, 40], extend_lens=[20, 33, 7]),
}


def _setup(dtype):
    cfg = ModelConfig(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16, dtype=MODEL_DTYPE,
                      kv_dtype=dtype, kv_scales=SCALES)
    mem = make_memory(cfg, num_pages=9000 // 16 + 64, max_reqs=12, max_context_len=3072, page_order="shuffled",
                      seed=1, device=DEVICE)
    return cfg, mem


def _qkv(cfg, n, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h, d, s=1.0: (torch.randn(n, h, d, generator=g) * s).to(MODEL_DTYPE).to(DEVICE)  # noqa: E731
    return mk(cfg.num_q_heads, 16), mk(cfg.num_kv_heads, 16, 3.0), mk(cfg.num_kv_heads, 16, 3.0)


@pytest.mark.parametrize("schedule", ["chunks", "split"])
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("dtype", FP8_KV)
def test_fp8_cache_against_float64_over_the_dequantized_cache(dtype, name, schedule):
    cfg, mem = _setup(dtype)
    be = TritonBackend(cfg, mem)
    be.schedule = schedule
    check_fp8_forward(be, cfg, mem, SCENARIOS[name], lambda n: _qkv(cfg, n, 3), name == "extend",
                      1e-5 if MODEL_DTYPE == torch.float32 else 2e-2)


def test_layers_of_other_scales_on_one_eager_step_each_read_with_their_own():
    """Two layers, one backend instance, one eager step: the second layer's call must not replay
    the first's recorded launch (its scales are the launch's host floats)."""
    cfg, mem = _setup(torch.float8_e4m3fn)
    be = TritonBackend(cfg, mem)
    m = materialize(SCENARIOS["decode"](), mem, be.get_cuda_graph_seq_len_fill_value())
    batch = eager_step(m.batch, [be])
    poison_unread(mem, batch)
    be.init_forward_metadata(batch)
    q, k, v = _qkv(cfg, batch.num_tokens, 5)
    for lid in (0, 1, 0):
        layer = cfg.layer(lid)
        out = be.forward(q, k, v, layer, batch)
        ref = dense_reference(batch, mem, lid, q.cpu(), layer.scaling, None, layer.k_scale, layer.v_scale)
        ok = ~ref[:, 0, 0].isnan()
        assert int(ok.sum()) == batch.raw_bs, "rows left out of the check"
        err = float((out.cpu()[ok].double() - ref[ok]).norm() / ref[ok].norm())
        assert err < (1e-5 if MODEL_DTYPE == torch.float32 else 2e-2), f"layer {lid}: relative error {err:.2e}"
