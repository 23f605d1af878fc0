"""The tiny models' RoPE tables, computed once a step (``rope_angles``) and shared by every layer,
rotate q and k exactly as each layer computing its own from the step's positions did."""
import random

import pytest
import torch

from attn_backends import get_backend
from attn_backends.check.scenarios import make_memory
from attn_backends_runtime.batches import extend_batch
from attn_backends_runtime.models import TinyConfig, TinyModel, apply_rope, rope_angles
from attn_backends_runtime.runner_base import run_eager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mla", [False, True])
def test_shared_rope_tables_equal_each_layers_own(mla, dtype):
    tc = TinyConfig(is_mla=mla, page_size=16, dtype=dtype, rope_theta=5000.0)
    model = TinyModel(tc, "cpu")
    rng = random.Random(0)
    prompts = [[rng.randrange(tc.vocab_size) for _ in range(n)] for n in (37, 5, 20)]
    mem = make_memory(tc.attention(), num_pages=12, max_reqs=3, max_context_len=48, page_order="shuffled",
                      device="cpu", fill=False)
    rows = [mem.new_request() for _ in prompts]
    for r, p in zip(rows, prompts):
        mem.extend(r, len(p))
    batch = extend_batch(mem, rows, [0] * len(prompts), prompts)
    seen = []
    for block in model.layers:
        def spy(h, rope, _block=block, _orig=block.pre_attn):
            seen.append((_block, h.clone(), rope, _orig(h, rope)))
            return seen[-1][3]
        block.pre_attn = spy
    run_eager(model, get_backend("torch_native", tc.attention(), mem), batch, 0)
    assert len(seen) == tc.num_layers and all(isinstance(r, tuple) for _, _, r, _ in seen), "tables not shared"
    for block, h, _, got in seen:
        want = type(block).pre_attn(block, h, batch.positions)      # the layer's own tables
        assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(got, want))


def test_apply_rope_takes_positions_or_their_tables():
    x = torch.randn(6, 3, 8)
    pos = torch.tensor([0, 1, 2, 7, 30, 4])
    assert torch.equal(apply_rope(x, pos, 500.0), apply_rope(x, rope_angles(pos, 8, 500.0), 500.0))
    assert not torch.equal(apply_rope(x, pos, 500.0), apply_rope(x, rope_angles(pos, 8, 10000.0), 500.0))
