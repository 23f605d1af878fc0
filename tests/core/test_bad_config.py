"""Bad modes and configurations get a clear error before any kernel runs (see test_bad_input.py)."""

from dataclasses import replace

import pytest
from bad_input_common import MHA, MLA, batch_of, setup

from attn_backends import (
    Capabilities,
    ForwardMode,
    GraphKey,
    LayoutError,
    ModelConfig,
    get_backend,
)
from attn_backends.backends.torch_native import TorchNativeBackend
from attn_backends.check.scenarios import (
    Scenario,
    draft_decode_spec,
    make_memory,
    verify_spec,
)
from attn_backends.layout import build_layout, inputs_from_batch

# --------------------------------------------------------------------------- modes

def test_extend_without_extend_seq_lens():
    mem, be = setup()
    batch = batch_of(be, mem, Scenario(ForwardMode.EXTEND, bs=2, prefix_lens=[5, 6], extend_lens=[3, 4]))
    batch.extend_seq_lens = batch.extend_seq_lens_cpu = None
    with pytest.raises(LayoutError, match=r"EXTEND needs extend_seq_lens and extend_seq_lens_cpu"):
        be.init_forward_metadata(batch)


def test_extend_len_longer_than_the_sequence():
    mem, be = setup()
    batch = batch_of(be, mem, Scenario(ForwardMode.EXTEND, bs=2, prefix_lens=[5, 6], extend_lens=[3, 4]))
    batch.extend_seq_lens_cpu[1] = batch.extend_seq_lens[1] = 11
    with pytest.raises(LayoutError, match=r"request 1: extend_seq_len=11 outside 1\.\.seq_len=10"):
        be.init_forward_metadata(batch)


def test_idle_mode():
    mem, be = setup()
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6]))
    batch.forward_mode = ForwardMode.IDLE
    with pytest.raises(LayoutError, match=r"IDLE batches carry no tokens"):
        be.init_forward_metadata(batch)
    with pytest.raises(LayoutError, match=r"IDLE batches carry no tokens"):
        build_layout(inputs_from_batch(batch, mem, 1))
    with pytest.raises(ValueError, match=r"forward_mode=IDLE cannot be graph-captured"):
        GraphKey(ForwardMode.IDLE, bs=2, width=1)


def test_extend_cannot_be_captured():
    with pytest.raises(ValueError, match=r"forward_mode=EXTEND cannot be graph-captured as a uniform batch"):
        GraphKey(ForwardMode.EXTEND, bs=2, width=1)


class DecodeOnly(TorchNativeBackend):
    name = "decode_only"
    capabilities = Capabilities(modes=frozenset({ForwardMode.DECODE}), mla=True, topk_gt1=False,
                                draft_decode=False)


def test_mode_not_supported_by_the_backend(rng):
    mem, _ = setup()
    be = DecodeOnly(MHA, mem)
    spec = verify_spec(4, 2, rng)
    batch = batch_of(be, mem, Scenario(ForwardMode.TARGET_VERIFY, bs=2, prefix_lens=[5, 6], spec=spec))
    with pytest.raises(LayoutError, match=r"backend decode_only does not run mode TARGET_VERIFY; it runs \['DECODE'\]"):
        be.init_forward_metadata(batch)
    be.init_cuda_graph_state(max_bs=2, max_num_tokens=8)
    with pytest.raises(LayoutError, match=r"backend decode_only does not run mode TARGET_VERIFY"):
        be.init_forward_metadata_capture_cuda_graph(batch.graph_inputs())


def test_topk_and_draft_decode_not_supported_by_the_backend():
    mem, _ = setup()
    be = DecodeOnly(MHA, mem)
    spec = draft_decode_spec(topk=2, steps=3, step=1)
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6], spec=spec))
    with pytest.raises(LayoutError, match=r"backend decode_only does not support topk=2 > 1"):
        be.init_forward_metadata(batch)
    spec1 = draft_decode_spec(topk=1, steps=3, step=1)
    batch = batch_of(be, mem, Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[5, 6], spec=spec1))
    with pytest.raises(LayoutError, match=r"backend decode_only does not support draft decode"):
        be.init_forward_metadata(batch)


def test_select_refuses_a_mode_with_the_reason(builtin_registry):
    from attn_backends.registry import select
    with pytest.raises(ValueError, match=r"no backend can serve this model in IDLE on cpu"):
        select(MHA, mode=ForwardMode.IDLE, device="cpu")


# --------------------------------------------------------------------------- configuration

@pytest.mark.parametrize("page_size", [2, 8, 32, 128])
def test_page_size_not_supported(page_size):
    with pytest.raises(ValueError, match=rf"page_size={page_size} is not one of \(1, 16, 64\)"):
        make_memory(ModelConfig(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=page_size),
                    num_pages=4, max_reqs=1, max_context_len=256)
    cfg = ModelConfig(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=page_size)
    mem = make_memory(ModelConfig(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8),
                      num_pages=4, max_reqs=1, max_context_len=256)
    want = rf"cannot serve this model on cpu: page_size={page_size} not in \(1, 16, 64\)"
    with pytest.raises(ValueError, match=want):
        get_backend("torch_native", cfg, mem)


def test_config_and_memory_page_sizes_differ():
    cfg16 = ModelConfig(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=16)
    mem1 = make_memory(ModelConfig(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8),
                       num_pages=4, max_reqs=1, max_context_len=64)
    with pytest.raises(ValueError, match=r"config page_size=16 != memory page_size=1"):
        get_backend("torch_native", cfg16, mem1)


def test_max_context_len_not_a_page_multiple():
    with pytest.raises(ValueError, match=r"max_context_len=100 is not a multiple of page_size=16"):
        make_memory(ModelConfig(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=16),
                    num_pages=4, max_reqs=1, max_context_len=100)


def test_mla_with_more_than_one_kv_head():
    with pytest.raises(ValueError, match=r"MLA has one latent KV head, got num_kv_heads=2"):
        ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, is_mla=True)


def test_gqa_heads_not_divisible():
    with pytest.raises(ValueError, match=r"num_q_heads=6 is not a multiple of num_kv_heads=4"):
        ModelConfig(num_layers=1, num_q_heads=6, num_kv_heads=4)


def test_unknown_backend_name():
    mem, _ = setup()
    with pytest.raises(ValueError, match=r"backend 'no_such_backend' is neither a registered name nor 'module:Class'"):
        get_backend("no_such_backend", MHA, mem)
    with pytest.raises(ValueError, match=r"cannot load backend class 'no_such_mod:Backend'"):
        get_backend("no_such_mod:Backend", MHA, mem)


def test_mla_model_on_an_mha_only_backend(monkeypatch):
    monkeypatch.setattr(TorchNativeBackend, "capabilities", replace(TorchNativeBackend.capabilities, mla=False))
    mem = make_memory(MLA, num_pages=8, max_reqs=1, max_context_len=16)
    with pytest.raises(ValueError, match=r"backend 'torch_native' cannot serve this model on cpu: "
                                         r"MHA/GQA only, model is MLA"):
        get_backend("torch_native", MLA, mem)


def test_any_layout_backend_refuses_a_device_or_dtype_outside_its_capabilities():
    """Direct construction (as the suite and third parties do) checks what get_backend's
    capability refusal checks: the KV memory's device and the model's dtype."""
    import torch
    cuda_only = type("CudaOnly", (TorchNativeBackend,), {"capabilities": replace(
        TorchNativeBackend.capabilities, devices=("cuda",))})
    half_only = type("HalfOnly", (TorchNativeBackend,), {"capabilities": replace(
        TorchNativeBackend.capabilities, dtypes=(torch.float16, torch.bfloat16))})
    mem = make_memory(MHA, num_pages=8, max_reqs=2, max_context_len=64, fill=False)
    with pytest.raises(ValueError, match="runs on cuda; the KV memory is on cpu"):
        cuda_only(MHA, mem)
    with pytest.raises(ValueError, match="runs dtypes .*, model is torch.float32"):
        half_only(replace(MHA, dtype=torch.float32), mem)
