"""Mistakes a new user makes with the API (issue #12 item 6) raise a clear error before any write:
forward on a batch that was not prepared, slots outside the pool or in the reserved page, float
seq_lens, a KV memory that does not fit the model."""
import pytest
import torch
from bad_input_common import MHA, MLA, batch_of, qkv, setup

from attn_backends import ForwardMode, LayoutError, ModelConfig, get_backend
from attn_backends.testing.scenarios import Scenario, make_memory


def _pool_copy(mem):
    return [t.clone() for t in (mem.pool.kv if mem.is_mla else mem.pool.k + mem.pool.v)]


def _unchanged(mem, before) -> bool:
    now = mem.pool.kv if mem.is_mla else mem.pool.k + mem.pool.v
    return all(torch.equal(a, b) for a, b in zip(now, before))


def test_forward_on_a_batch_that_was_not_prepared():
    mem, be = setup()
    a = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    b = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[9, 3]))
    be.init_forward_metadata(a)
    q, k, v = qkv(MHA, 2)
    before = _pool_copy(mem)
    with pytest.raises(LayoutError, match="another batch than the one init_forward_metadata"):
        be.forward(q, k, v, MHA.layer(0), b)
    assert _unchanged(mem, before)
    be.init_forward_metadata(b)
    assert be.forward(q, k, v, MHA.layer(0), b).shape == (2, MHA.num_q_heads, MHA.v_head_dim)


@pytest.mark.parametrize("bad,where", [(-1, "real"), (0, "real"), (10 ** 6, "real"), (5, "pad")])
def test_out_cache_loc_outside_the_pool_or_in_the_reserved_page(bad, where):
    mem, be = setup(MHA)
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=3, prefix_lens=[5, 6]))   # row 2 pads
    i = 0 if where == "real" else 2
    batch.out_cache_loc[i] = bad
    be.init_forward_metadata(batch)
    q, k, v = qkv(MHA, 3)
    before = _pool_copy(mem)
    want = (r"a real token's slot must lie in 1\.\.63" if where == "real"
            else "a padding token must write the reserved slot 0")
    with pytest.raises(ValueError, match=rf"out_cache_loc\[{i}\]={bad}: {want}"):
        be.forward(q, k, v, MHA.layer(0), batch)
    assert _unchanged(mem, before), "the pool was written before the error"


def test_float_seq_lens():
    mem, be = setup()
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    batch.seq_lens = batch.seq_lens.float()
    with pytest.raises(LayoutError, match="seq_lens dtype torch.float32 is not int32/int64"):
        be.init_forward_metadata(batch)
    batch.seq_lens, batch.seq_lens_cpu = batch.seq_lens_cpu.int(), batch.seq_lens_cpu.double()
    with pytest.raises(LayoutError, match="seq_lens_cpu dtype torch.float64 is not int32/int64"):
        be.init_forward_metadata(batch)


@pytest.mark.parametrize("change,msg", [
    (dict(num_kv_heads=1), r"KV rows \(\(1, 16\), \(1, 16\)\) \(heads, dim\) differ from the KV memory's \(\(2, 16\)"),
    (dict(head_dim=32), r"differ from the KV memory's"),
    (dict(num_layers=3), "num_layers=3 exceeds the KV memory's 1 layers"),
    (dict(dtype=torch.float16), "dtype torch.float16 differs from the KV memory's torch.float32"),
])
def test_memory_that_does_not_fit_the_model(change, msg):
    mem = make_memory(MHA, num_pages=8, max_reqs=2, max_context_len=64)
    cfg = ModelConfig(**{**dict(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16), **change})
    with pytest.raises(ValueError, match=msg):
        get_backend("torch_native", cfg, mem)


def test_mla_model_on_an_mha_memory_and_back():
    with pytest.raises(ValueError, match="the model is MLA but the KV memory holds an MHA pool"):
        get_backend("torch_native", MLA, make_memory(MHA, num_pages=8, max_reqs=2, max_context_len=64))
    mla = ModelConfig(num_layers=1, num_q_heads=4, is_mla=True, kv_lora_rank=16, qk_rope_head_dim=8)
    with pytest.raises(ValueError, match=r"KV rows \(\(1, 24\),\) .* differ from the KV memory's \(\(1, 40\),\)"):
        get_backend("torch_native", mla, make_memory(MLA, num_pages=8, max_reqs=2, max_context_len=64))


def test_a_real_token_in_the_reserved_page():
    cfg = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16)
    mem = make_memory(cfg, num_pages=16, max_reqs=4, max_context_len=64)
    be = get_backend("torch_native", cfg, mem)
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 20]))
    batch.out_cache_loc[1] = 7                                   # inside page 0: slots 0..15
    be.init_forward_metadata(batch)
    q, k, v = qkv(cfg, 2)
    with pytest.raises(ValueError, match=r"out_cache_loc\[1\]=7: a real token's slot must lie in 16\.\.255"):
        be.forward(q, k, v, cfg.layer(0), batch)
