"""MLA decode's budget of several waves (``schedule.many_waves``, ``triton_common._split_plan``,
``triton_mla._waves_allowed``): where one chunk a request leaves SMs idle, the count of at most three waves whose last
wave is fullest, on the launches it was measured on. Host logic, as ``test_split_count.py``: no GPU."""
from types import SimpleNamespace

import pytest
import torch

CUDA0 = torch.device("cuda", 0)


@pytest.mark.parametrize("programs,want", [
    (96, 4),      # MLA-128 decode bs 48: 73 % at a chunk a request, 4 fill three waves to 97 %
    (80, 3),      # bs 40: 61 % -> 91 %
    (112, 1),     # bs 56: 85 % at every count of at most three waves
    (120, 1),     # 91 %: full enough
    (160, 2),     # bs 80: two waves at 61 %, three at 81 %
    (400, 1),     # more programs than three waves
])
def test_many_waves_fills_the_last_wave(programs, want):
    """``schedule.many_waves``: the count of at most MANY_WAVES waves whose last wave is fullest, where it fills
    1/16 more of the SMs than a chunk a request (the rows of 132 SMs named)."""
    from attn_backends_kernels.schedule import MANY_WAVES, many_waves
    assert many_waves(programs, 132) == want
    if want > 1:
        assert -(-want * programs // 132) <= MANY_WAVES


def test_a_budget_of_waves_only_where_it_was_measured(h200, monkeypatch):
    """``_waves_allowed`` / ``_split_plan``: MLA-128 decode at bs 48 on a 16-bit cache of the 512 + 64 layout on sm_90
    takes 4 chunks a request, 64 heads at bs 80 3, 16 heads at bs 80 3 on the transposed kernel (one program an SM),
    not on the Triton tile (two an SM); not width-1 verify, not a float32 cache, not off sm_90 (the Triton tile: no
    cap, both asked for with ``schedule="chunks"``, which "auto" would not chunk), not other latent dims, not 32 heads
    (not measured) and not a context of one page (a chunk a request there at any batch)."""
    from attn_backends import ModelConfig, get_backend
    from attn_backends.backends import triton_mla
    from attn_backends.batch import ForwardMode
    from attn_backends.check.scenarios import make_memory
    from attn_backends.layout import MaskKind

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    hopper = {"on": True}
    monkeypatch.setattr(triton_mla, "hopper_device", lambda device: hopper["on"])

    def plan(bs=48, mode=ForwardMode.DECODE, dtype=torch.float16, rank=512, context=16384, heads=128, schedule="auto",
             transposed=True):
        cfg = ModelConfig(num_layers=1, num_q_heads=heads, num_kv_heads=1, head_dim=16, is_mla=True,
                          kv_lora_rank=rank, qk_rope_head_dim=64, page_size=64, dtype=dtype)
        mem = make_memory(cfg, num_pages=4, max_reqs=2, max_context_len=context)
        be = get_backend("triton_mla", cfg, mem)
        be.schedule = schedule          # "chunks": chunked where "auto" would not (a float32 cache, off sm_90)
        monkeypatch.setattr(be, "_decodes_transposed", lambda: transposed, raising=False)
        monkeypatch.setattr(mem, "device", CUDA0)
        lay = SimpleNamespace(bs=bs, width=1, max_seq_len_q=1, mode=mode, mask=MaskKind.CAUSAL)
        return be._split_plan(lay)

    assert plan() == (4, True, True)
    assert plan(bs=1, context=64) == (1, False, False)                 # one page: the count is 1 at any batch
    assert plan(mode=ForwardMode.TARGET_VERIFY)[2] is False
    assert plan(rank=256)[2] is False
    assert plan(bs=80, heads=64) == (3, True, True)                    # one 64-head tile a request
    assert plan(bs=80, heads=16) == (3, True, True)                    # the transposed kernel: one program an SM
    assert plan(bs=150, heads=64) == (2, True, True)                   # 150 programs: two waves of 2 a request
    assert plan(bs=80, heads=16, transposed=False) == (3, False, False)     # the Triton tile: two an SM, no waves
    assert plan(bs=48, heads=16)[2] is False                            # 2 chunks a request: no budget of waves
    assert plan(bs=80, heads=32)[2] is False                            # two 16-head tiles a request: not measured
    assert plan(dtype=torch.float32, schedule="chunks")[2] is False     # the Triton tile: no cap
    hopper["on"] = False
    assert plan(schedule="chunks")[2] is False
