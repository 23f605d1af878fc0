"""Bad input gets a clear error, naming the value and the limit, before any kernel runs.

Every batch is built with the scenario helpers on a real KV memory and run through the
``torch_native`` backend; each test asserts the message. "Before any kernel runs" is
checked by making the attention itself explode (``no_kernel``) and by checking that the
KV pool was not written.
"""

import re

import pytest
import torch
from bad_input_common import MHA, MLA, batch_of, qkv, setup

from attn_backends import (
    ForwardMode,
    GraphKey,
    KVCacheFullError,
    LayoutError,
    ModelConfig,
    SpecInfo,
)
from attn_backends.check.scenarios import (
    Scenario,
    draft_decode_spec,
    draft_extend_spec,
    make_memory,
    verify_spec,
)
from attn_backends.step.buffers import LayoutBuffers

# --------------------------------------------------------------------------- bs and graph buffers

def test_bs_over_the_graph_buffers():
    bufs = LayoutBuffers(max_bs=4, max_width=4, max_context_len=128, page_size=1, device="cpu")
    with pytest.raises(LayoutError, match=r"bs=5 exceeds the graph buffers' max_bs=4"):
        bufs.check_capacity(5, 1)
    with pytest.raises(LayoutError, match=r"width W=5 exceeds the graph buffers' max width 4"):
        bufs.check_capacity(4, 5)


def test_capture_of_a_bucket_over_max_bs():
    mem, be = setup()
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=8, prefix_lens=[5, 6]))
    with pytest.raises(LayoutError, match=r"bs=8 exceeds the graph buffers' max_bs=4"):
        be.init_forward_metadata_capture_cuda_graph(batch.graph_inputs())


def test_capture_before_graph_state():
    mem, be = setup()
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    with pytest.raises(LayoutError, match=r"init_cuda_graph_state\(\) must run before capture"):
        be.init_forward_metadata_capture_cuda_graph(batch.graph_inputs())


def test_replay_of_a_key_never_captured():
    mem, be = setup()
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=16)
    small = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    be.init_forward_metadata_capture_cuda_graph(small.graph_inputs())
    big = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=4, prefix_lens=[5, 6, 7]))
    with pytest.raises(LayoutError, match=r"no graph captured for .*bs=4.*; captured: .*bs=2"):
        be.init_forward_metadata_replay_cuda_graph(big.graph_inputs())


def test_raw_bs_over_bs():
    mem, be = setup()
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    batch.raw_bs = 3
    with pytest.raises(LayoutError, match=r"raw_bs=3 outside 1\.\.bs=2"):
        be.init_forward_metadata(batch)
    with pytest.raises(ValueError, match=r"raw_bs=3 exceeds the bucket bs=2"):
        batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6, 7]))


# --------------------------------------------------------------------------- width

def test_q_rows_not_bs_times_w(rng, no_kernel):
    mem, be = setup()
    spec = verify_spec(4, 2, rng)
    batch = batch_of(be, mem, Scenario(ForwardMode.TARGET_VERIFY, bs=2, prefix_lens=[5, 6], spec=spec))
    be.init_forward_metadata(batch)
    before = mem.pool.k[0].clone()
    q, k, v = qkv(MHA, 7)
    with pytest.raises(ValueError, match=r"q has 7 rows, the layout expects bs\*W = 2\*4 = 8"):
        be.forward(q, k, v, MHA.layer(0), batch)
    assert torch.equal(mem.pool.k[0], before)                  # nothing stored either


def test_q_heads_or_dim_wrong(no_kernel):
    mem, be = setup()
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    be.init_forward_metadata(batch)
    _, k, v = qkv(MHA, 2)
    with pytest.raises(ValueError, match=r"q has shape \(2, 3, 16\), expected \[T, 4, 16\]"):
        be.forward(torch.randn(2, 3, 16), k, v, MHA.layer(0), batch)


def test_k_rows_and_out_cache_loc_disagree_with_q(no_kernel):
    mem, be = setup()
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    be.init_forward_metadata(batch)
    q, k, v = qkv(MHA, 2)
    with pytest.raises(ValueError, match=r"save_kv_cache needs k and out_cache_loc with 2 rows, got \(1, 2, 16\)"):
        be.forward(q, k[:1], v[:1], MHA.layer(0), batch)


def test_graph_key_width_differs_from_the_spec(rng):
    mem, be = setup()
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=32)
    spec = verify_spec(4, 2, rng)
    gi = batch_of(be, mem, Scenario(ForwardMode.TARGET_VERIFY, bs=2, prefix_lens=[5, 6], spec=spec)).graph_inputs()
    gi.key = GraphKey(ForwardMode.TARGET_VERIFY, bs=2, width=3)
    with pytest.raises(LayoutError, match=r"W=3.* W=4"):
        be.init_forward_metadata_capture_cuda_graph(gi)


def test_extend_q_rows_not_the_batch_tokens(no_kernel):
    mem, be = setup()
    batch = batch_of(be, mem, Scenario(ForwardMode.EXTEND, bs=2, prefix_lens=[5, 6], extend_lens=[3, 4]))
    be.init_forward_metadata(batch)
    q, k, v = qkv(MHA, 8)                                      # the batch has 7 new tokens
    with pytest.raises(ValueError, match=r"q has 8 rows.* 7"):
        be.forward(q, k, v, MHA.layer(0), batch, save_kv_cache=False)


# --------------------------------------------------------------------------- extents and ranges

@pytest.mark.parametrize("mode", ["decode", "verify", "draft_extend", "draft_decode"])
def test_seq_len_shorter_than_w(mode, rng):
    mem, be = setup()
    spec, m, w = {
        "decode": (None, ForwardMode.DECODE, 1),
        "verify": (verify_spec(4, 2, rng), ForwardMode.TARGET_VERIFY, 4),
        "draft_extend": (draft_extend_spec(4, 2, 2, [1, 4]), ForwardMode.DRAFT_EXTEND, 4),
        "draft_decode": (draft_decode_spec(topk=2, steps=3, step=1), ForwardMode.DECODE, 2),
    }[mode]
    batch = batch_of(be, mem, Scenario(m, bs=2, prefix_lens=[5, 6], spec=spec))
    short = w - 1
    batch.seq_lens_cpu[1] = short
    batch.seq_lens[1] = short
    with pytest.raises(LayoutError, match=rf"request 1: seq_len={short} < {w} query tokens \(W={w}"):
        be.init_forward_metadata(batch)


def test_draft_decode_seq_len_shorter_than_its_branches():
    mem, be = setup()
    spec = draft_decode_spec(topk=2, steps=3, step=3)         # 3 steps of 2 branches: 6 tokens
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6], spec=spec))
    batch.seq_lens_cpu[0] = batch.seq_lens[0] = 5
    with pytest.raises(LayoutError, match=r"request 0: seq_len=5 < 6 query tokens \(W=2, draft_step=3\)"):
        be.init_forward_metadata(batch)


def test_seq_lens_and_host_copy_disagree():
    mem, be = setup()
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    batch.seq_lens = batch.seq_lens.clone()
    batch.seq_lens[0] += 1
    with pytest.raises(LayoutError, match=r"seq_lens and seq_lens_cpu disagree"):
        be.init_forward_metadata(batch)


def test_req_pool_index_beyond_the_table():
    mem, be = setup(max_reqs=8)
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    batch.req_pool_indices[0] = 99
    with pytest.raises(LayoutError, match=r"req_pool_indices \[99, \d+\] outside 0\.\.8"):
        be.init_forward_metadata(batch)


def test_req_pool_index_beyond_the_table_at_capture():
    mem, be = setup(max_reqs=8)
    be.init_cuda_graph_state(max_bs=2, max_num_tokens=2)
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    batch.req_pool_indices[1] = -1
    with pytest.raises(LayoutError, match=r"req_pool_indices \[\d+, -1\] outside 0\.\.8"):
        be.init_forward_metadata_capture_cuda_graph(batch.graph_inputs())


def test_req_to_token_slot_beyond_the_pool():
    mem, be = setup(num_pages=64)
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    row = int(batch.req_pool_indices[0])
    mem.req_to_token[row, 2] = 10_000
    with pytest.raises(LayoutError, match=r"req_to_token.* outside the pool 0\.\.63"):
        be.init_forward_metadata(batch)


@pytest.mark.parametrize("cfg", [MHA, MLA], ids=["mha", "mla"])
def test_seq_len_over_max_context_len(cfg):
    mem, be = setup(cfg, max_context_len=128)
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    batch.seq_lens_cpu[1] = batch.seq_lens[1] = 129
    with pytest.raises(LayoutError, match=r"seq_len=129 exceeds max_context_len=128"):
        be.init_forward_metadata(batch)


# --------------------------------------------------------------------------- KV memory

def test_kv_memory_exhausted_overwrites_nothing():
    cfg = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16)
    mem = make_memory(cfg, num_pages=4, max_reqs=4, max_context_len=128)   # 3 usable pages
    a = mem.new_request()
    mem.extend(a, 40)                                           # 3 pages
    b = mem.new_request()
    table, free = mem.req_to_token.clone(), mem.pages.num_free
    with pytest.raises(KVCacheFullError, match=r"need 1 pages, only 0 of 3 free"):
        mem.extend(b, 1)
    with pytest.raises(KVCacheFullError, match=r"need 1 pages, only 0 of 3 free"):
        mem.extend(a, 9)                                        # 40 + 9 crosses into a 4th page
    assert torch.equal(mem.req_to_token, table)
    assert mem.pages.num_free == free and mem.seq_len(a) == 40 and mem.seq_len(b) == 0
    mem.extend(a, 8)                                            # the last page still has room


def test_kv_request_over_max_context_len_overwrites_nothing():
    mem, _ = setup(num_pages=200, max_context_len=128)
    row = mem.new_request()
    mem.extend(row, 100)
    table = mem.req_to_token.clone()
    with pytest.raises(KVCacheFullError, match=rf"request row {row}: 129 tokens exceed max_context_len=128"):
        mem.extend(row, 29)
    assert torch.equal(mem.req_to_token, table) and mem.seq_len(row) == 100


def test_request_rows_exhausted():
    mem, _ = setup(max_reqs=2)
    mem.new_request(), mem.new_request()
    with pytest.raises(KVCacheFullError, match=r"no free request row: all 2 rows are in use"):
        mem.new_request()


# --------------------------------------------------------------------------- spec inputs

def test_accept_lens_outside_1_to_n(no_kernel):
    mem, be = setup()
    for bad in ([0, 2], [2, 5]):
        spec = draft_extend_spec(4, 2, 2, bad)
        batch = batch_of(be, mem, Scenario(ForwardMode.DRAFT_EXTEND, bs=2, prefix_lens=[5, 6], spec=spec))
        with pytest.raises(LayoutError, match=re.escape(f"accept_lens {bad} outside 1..N=4")):
            be.init_forward_metadata(batch)


def test_tree_mask_of_wrong_shape(rng):
    mem, be = setup()
    spec = verify_spec(4, 2, rng, topk=2)
    spec.tree_mask = spec.tree_mask[:, :3, :3]
    batch = batch_of(be, mem, Scenario(ForwardMode.TARGET_VERIFY, bs=2, prefix_lens=[5, 6], spec=spec))
    with pytest.raises(LayoutError, match=r"tree verify needs tree_mask \[bs, 4, 4\], got \(2, 3, 3\)"):
        be.init_forward_metadata(batch)
    spec.tree_mask = None
    with pytest.raises(LayoutError, match=r"tree verify needs tree_mask \[bs, 4, 4\], got None"):
        be.init_forward_metadata(batch)


def test_tree_mask_without_its_diagonal(rng):
    mem, be = setup()
    spec = verify_spec(4, 2, rng, topk=2)
    spec.tree_mask[1, 2, 2] = False
    batch = batch_of(be, mem, Scenario(ForwardMode.TARGET_VERIFY, bs=2, prefix_lens=[5, 6], spec=spec))
    with pytest.raises(LayoutError, match=r"tree_mask diagonal must be True"):
        be.init_forward_metadata(batch)


def test_spec_stride_beyond_what_the_draft_can_make():
    with pytest.raises(ValueError, match=r"num_draft_tokens=5 exceeds num_steps\+1=4"):
        SpecInfo(num_draft_tokens=5, topk=1, num_steps=3)
    with pytest.raises(ValueError, match=r"num_draft_tokens=8 exceeds num_steps\*topk\+1=7"):
        SpecInfo(num_draft_tokens=8, topk=2, num_steps=3)


def test_verify_without_spec_info():
    mem, be = setup()
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    batch.forward_mode = ForwardMode.TARGET_VERIFY
    with pytest.raises(ValueError, match=r"TARGET_VERIFY needs a SpecInfo \(num_draft_tokens\), got None"):
        be.init_forward_metadata(batch)
