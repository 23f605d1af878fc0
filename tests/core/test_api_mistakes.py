"""Mistakes a new user makes with the API (issue #12 item 6) raise a clear error before any write:
forward on a batch that was not prepared, slots outside the pool or in the reserved page, float
seq_lens, a KV memory that does not fit the model; and (issue #38 item 6) q, k, v in another dtype
than the model's, a layer_id outside the model, a real request on the reserved row 0."""
import dataclasses

import pytest
import torch
from bad_input_common import MHA, MLA, batch_of, qkv, setup

from attn_backends import ForwardMode, LayoutError, ModelConfig, get_backend
from attn_backends.check.scenarios import Scenario, make_memory


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


# --------------------------------------------------------------------------- issue #38 item 6

def _prepared(cfg=MHA, bs=2):
    mem, be = setup(cfg)
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=bs, prefix_lens=[5, 6][:bs]))
    be.init_forward_metadata(batch)
    return mem, be, batch


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("model,given", [(torch.float32, torch.float16), (torch.float16, torch.float32)])
def test_q_k_v_in_another_dtype_than_the_model(which, model, given, no_kernel):
    cfg = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=model)
    mem, be, batch = _prepared(cfg)
    t = dict(zip("qkv", (x.to(model) for x in qkv(cfg, 2))))
    t[which] = t[which].to(given)
    before = _pool_copy(mem)
    with pytest.raises(ValueError, match=rf"^{which} dtype {given} differs from the model's dtype {model}$"):
        be.forward(t["q"], t["k"], t["v"], cfg.layer(0), batch)
    assert _unchanged(mem, before), "the pool was written before the error"


def test_mla_latent_k_in_another_dtype_than_the_model(no_kernel):
    mem, be, batch = _prepared(MLA)
    q, k, _ = qkv(MLA, 2)
    with pytest.raises(ValueError, match=r"^k dtype torch.bfloat16 differs from the model's dtype torch.float32$"):
        be.forward(q, k.bfloat16(), None, MLA.layer(0), batch)


@pytest.mark.parametrize("layer_id", [1, 7, -1])
@pytest.mark.parametrize("save", [True, False])
def test_layer_id_outside_the_model(layer_id, save, no_kernel):
    """Refused naming the limit: -1 would index the model's last layer (a Python list index), 1 past
    the end would raise a bare IndexError."""
    mem, be, batch = _prepared()
    q, k, v = qkv(MHA, 2)
    layer = dataclasses.replace(MHA.layer(0), layer_id=layer_id)
    before = _pool_copy(mem)
    with pytest.raises(ValueError, match=rf"^layer_id={layer_id} outside 0\.\.0 \(the model's num_layers=1\)$"):
        be.forward(q, k, v, layer, batch, save_kv_cache=save)
    assert _unchanged(mem, before)


def test_layer_id_beyond_the_model_but_inside_a_larger_memory(no_kernel):
    """The limit is the model's layers, not the KV memory's (which may hold more, e.g. a draft's)."""
    mem = make_memory(ModelConfig(num_layers=3, num_q_heads=4, num_kv_heads=2, head_dim=16),
                      num_pages=64, max_reqs=8, max_context_len=128)
    be = get_backend("torch_native", MHA, mem)
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    be.init_forward_metadata(batch)
    q, k, v = qkv(MHA, 2)
    with pytest.raises(ValueError, match=r"^layer_id=2 outside 0\.\.0 \(the model's num_layers=1\)$"):
        be.forward(q, k, v, dataclasses.replace(MHA.layer(0), layer_id=2), batch)


def test_a_real_request_on_the_reserved_row_0():
    mem, be = setup()
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    batch.req_pool_indices[1] = 0
    with pytest.raises(LayoutError, match=r"^req_pool_indices \[\d+, 0\]: request 1 is on row 0, reserved for "
                                          r"padding \(real requests use rows 1\.\.8\)$"):
        be.init_forward_metadata(batch)


def test_a_real_request_on_the_reserved_row_0_at_capture():
    mem, be = setup()
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=4, prefix_lens=[5, 6, 7]))   # row 3 pads
    assert int(batch.req_pool_indices[3]) == 0
    be.init_forward_metadata_capture_cuda_graph(batch.graph_inputs())   # padding on row 0 is the rule
    batch.req_pool_indices[0] = 0
    with pytest.raises(LayoutError, match=r"request 0 is on row 0, reserved for padding \(real requests use "
                                          r"rows 1\.\.8\)"):
        be.init_forward_metadata_capture_cuda_graph(batch.graph_inputs())
    batch.req_pool_indices.zero_()          # every row on row 0: a stand-in capture batch, as SGLang's
    be.init_forward_metadata_capture_cuda_graph(batch.graph_inputs())


def test_a_runner_plan_still_captures_its_stand_in_batch_on_row_0():
    """A runner captures before any request exists: its step's capture batch points every row at
    row 0 (the replays rewrite them). That is not a user's batch and stays accepted."""
    from attn_backends import GraphKey
    from attn_backends.step import Step
    mem, be = setup()
    step = Step(mem, be.get_cuda_graph_seq_len_fill_value(), max_bs=2, max_width=1)
    key = GraphKey(ForwardMode.DECODE, 2, 1)
    view = step.capture(key, None, raw_bs=2)
    be.init_cuda_graph_state(max_bs=2, max_num_tokens=2)
    be.init_forward_metadata_capture_cuda_graph(step.graph_inputs(key, view))
    assert be.forward_metadata.view is view
