"""The FlashInfer family on the CPU, without flashinfer (CI): the registry and its reasons, the
capabilities and select()'s refusals, the per-step library state of the step, and the
plan inputs the FlashInfer backends hand ``plan()`` (host copies from seq_lens_cpu and the key)
against the layout the step built on the device, with FlashInfer's own formulas
(``get_seq_lens``, ``_compute_page_mask_indptr``) restated; the mask packing kernel against a
bit-by-bit reference. The backends themselves run in tests/backends/test_flashinfer_emulated.py (where
flashinfer imports) and tests/backends/test_flashinfer_gpu.py (cuda)."""
import dataclasses
import importlib.util
import random
import sys

import numpy as np
import pytest
import torch

from attn_backends import ForwardMode, GraphKey, ModelConfig, list_backends, select
from attn_backends.backends.flashinfer_common import Planned, eager_host_plan, graph_host_plan
from attn_backends.check.scenarios import (
    Scenario,
    draft_decode_spec,
    draft_extend_spec,
    make_memory,
    materialize,
    verify_spec,
)
from attn_backends.layout import MaskKind
from attn_backends.registry import get_backend_class
from attn_backends.step import Step
from attn_backends_kernels.mask_pack import pack_uniform_mask

HAS_FI = importlib.util.find_spec("flashinfer") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"      # the packing kernel: compiled, or the interpreter
FAMILY = ("flashinfer", "flashinfer_mla", "trtllm_mla", "hybrid")
MHA = ModelConfig(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16)
MLA = ModelConfig(num_layers=1, num_q_heads=16, is_mla=True, page_size=16, dtype=torch.bfloat16)


# --------------------------------------------------------------------------- registry, capabilities

def test_list_names_the_family_with_capabilities_or_reasons():
    infos = {i.name: i for i in list_backends("cpu")}
    assert set(FAMILY) <= set(infos)
    for name in FAMILY:
        assert infos[name].capabilities is not None, name
    if not HAS_FI:
        for name in ("flashinfer", "flashinfer_mla"):
            assert infos[name].reason == "python package 'flashinfer' is not installed " \
                                         "(pip install 'attn-backends[flashinfer]')"
    assert "does not run on cpu" in infos["hybrid"].reason
    assert infos["flashinfer_mla"].capabilities.topk_gt1 is False
    assert infos["trtllm_mla"].capabilities.devices == ("cpu", "cuda")


def test_importing_the_backends_needs_no_flashinfer_and_constructing_names_the_extra(monkeypatch):
    import attn_backends.backends.flashinfer_common as common
    cls = get_backend_class("flashinfer")          # the module imports without flashinfer
    monkeypatch.setitem(sys.modules, "flashinfer", None)   # as if not installed
    mem = make_memory(MHA, num_pages=8, max_reqs=2, max_context_len=64, fill=False)
    ok_on_cpu = type("CpuFlashInfer", (cls,), {"capabilities": dataclasses.replace(cls.capabilities,
                                                                                   devices=("cpu",))})
    with pytest.raises(ImportError, match=r"pip install 'attn-backends\[flashinfer\]'"):
        ok_on_cpu(MHA, mem)
    with pytest.raises(ValueError, match="runs on cuda; the KV memory is on cpu"):
        cls(MHA, mem)
    with pytest.raises(ImportError, match=r"pip install 'attn-backends\[flashinfer\]'"):
        common.import_flashinfer()


@pytest.mark.parametrize("topk", [1, 4])
def test_select_refuses_flashinfer_mla_for_trees_with_the_reason(topk, builtin_registry, monkeypatch):
    from attn_backends import registry
    monkeypatch.setattr(registry, "unavailable_reason", lambda cls, device: None)   # as on an H100 with flashinfer
    monkeypatch.setattr(registry, "device_sm", lambda: 90)
    sel = select(MLA, mode=ForwardMode.TARGET_VERIFY, device="cuda", topk=topk)
    if topk == 1:
        assert sel.name == "flashinfer_mla"
        assert "ranked below flashinfer_mla" in sel.refused["triton_mla"]
    else:
        assert sel.name == "triton_mla"
        assert sel.refused["flashinfer_mla"] == (
            "topk=4 > 1 not supported: tree verify and multi-branch draft decode need a custom mask, "
            "which BatchMLAPagedAttentionWrapper does not take")
    assert sel.refused["flashinfer"] == "MHA/GQA only, model is MLA"
    assert all(sel.refused.values())


def test_refusals_name_value_and_limit():
    fi = get_backend_class("flashinfer").capabilities
    assert fi.refusal(MLA, ForwardMode.DECODE, "cuda", 90) == "MHA/GQA only, model is MLA"
    f32 = ModelConfig(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=128)
    assert fi.refusal(f32, ForwardMode.DECODE, "cuda", 90) == "dtype float32 not in (float16, bfloat16)"
    d96 = ModelConfig(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=96, dtype=torch.bfloat16)
    assert fi.refusal(d96, None, "cuda", 90) == "head_dim=96 not in (64, 128, 256)"
    assert fi.refusal(MHA, ForwardMode.DECODE, "cuda", 75) == "needs sm_80+, device is sm_75"
    assert fi.refusal(MHA, ForwardMode.TARGET_VERIFY, "cuda", 90, topk=8) is None


def test_hybrid_capabilities_are_the_intersection_per_mode():
    from attn_backends.backends.hybrid import compose
    cls = compose({"extend": "torch_native", "decode": ("triton", "trtllm_mla"),
                   "target_verify": ("triton", "trtllm_mla"), "draft_extend": "torch_native"})
    caps = cls.capabilities
    assert caps.modes == frozenset(ForwardMode(m) for m in (1, 2, 3, 4))
    assert caps.mha and caps.mla and caps.topk_gt1 and caps.devices == ("cpu", "cuda")
    fi = compose({"extend": "flashinfer", "decode": "triton"}).capabilities
    assert fi.devices == ("cuda",) and fi.dtypes == (torch.float16, torch.bfloat16) and not fi.mla
    assert fi.modes == frozenset({ForwardMode.EXTEND, ForwardMode.DECODE})
    assert fi.refusal(MHA, ForwardMode.TARGET_VERIFY, "cuda", 90) == "mode TARGET_VERIFY not supported"


# --------------------------------------------------------------------------- the step's library state

def test_library_state_is_kept_per_step_and_planned_once_per_step():
    """Every build, capture and update is a new step id, and every view of a step shares the
    step's cache: a library's state is made once per step and planned by the first layer of each
    step id (FlashInferBase._update), the other layers only run."""
    mem = make_memory(MHA, num_pages=64, max_reqs=8, max_context_len=128, fill=False)
    step = Step(mem, 1, max_bs=4, max_width=1)
    m = materialize(Scenario(ForwardMode.DECODE, 4, [3, 9]), mem, 1)
    key = GraphKey(ForwardMode.DECODE, 4, 1)
    gi = m.batch.graph_inputs()
    views = [step.build(m.batch).step]                                  # an eager step
    step.load(gi, capture=True)
    views.append(step.capture(key, None, gi.raw_bs))
    step.load(gi)
    views += [step.update(key, gi.raw_bs), step.update(key, gi.raw_bs)]
    assert len({v.step_id for v in views}) == len(views)
    assert all(v.cache is step.cache for v in views) and views[1].layout is views[3].layout
    plans = []
    planned = Planned(plans)
    for v in views:
        for _layer in range(3):                                         # what FlashInferBase._update does
            if planned.step_id != v.step_id:
                planned.step_id = v.step_id
                plans.append(v.step_id)
    assert plans == [v.step_id for v in views]                          # once per step, not per layer


# --------------------------------------------------------------------------- plan inputs vs the layout

def _scenarios(rng, bs, ps):
    raw = rng.randint(1, bs)
    pick = lambda lo=0: [rng.randint(lo, 150) for _ in range(raw)]  # noqa: E731
    yield Scenario(ForwardMode.DECODE, bs, pick())
    yield Scenario(ForwardMode.TARGET_VERIFY, bs, pick(), spec=verify_spec(4, bs, rng))
    yield Scenario(ForwardMode.TARGET_VERIFY, bs, pick(), spec=verify_spec(6, bs, rng, topk=4, steps=2))
    yield Scenario(ForwardMode.DRAFT_EXTEND, bs, pick(), spec=draft_extend_spec(3, bs, raw, [1] * raw))
    yield Scenario(ForwardMode.DECODE, bs, pick(8), spec=draft_decode_spec(2, 3, 2))
    yield Scenario(ForwardMode.EXTEND, raw, pick(), extend_lens=[rng.randint(1, 9) for _ in range(raw)])


def _check_host_plan(h, lay):
    """What FlashInfer derives from the host copies == the layout on the device."""
    ps = lay.page_size
    kv_from_pages = (h.kv_indptr[1:] - h.kv_indptr[:-1] - 1) * ps + h.kv_last_page_len   # page.get_seq_lens
    assert torch.equal(kv_from_pages, h.kv_lens)
    assert torch.equal(h.kv_lens, lay.seq_lens_k.cpu())
    assert torch.equal(h.kv_indptr, lay.kv_indptr.cpu())
    assert torch.equal(h.kv_last_page_len, lay.kv_last_page_len.cpu())
    assert torch.equal(h.qo_indptr, lay.cu_seqlens_q.cpu())
    assert h.num_pages == int(lay.kv_indptr[-1]) <= lay.kv_indices.numel()
    assert all(t.dtype == torch.int32 and t.device.type == "cpu" for t in
               (h.qo_indptr, h.kv_indptr, h.kv_last_page_len, h.kv_lens))


@pytest.mark.parametrize("ps", [1, 16, 64])
def test_eager_plan_inputs_equal_the_device_layout(ps):
    rng = random.Random(ps)
    cfg = ModelConfig(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=ps)
    mem = make_memory(cfg, num_pages=4000 // ps + 40, max_reqs=60, max_context_len=256, fill=False)
    for scn in _scenarios(rng, 5, ps):
        m = materialize(scn, mem, 1)
        batch = Step(mem, 1).build(m.batch)
        _check_host_plan(eager_host_plan(batch.step), batch.step.layout)


@pytest.mark.parametrize("ps", [1, 16, 64])
def test_graph_plan_inputs_equal_the_device_layout_after_capture_and_update(ps):
    rng = random.Random(10 + ps)
    cfg = ModelConfig(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=ps)
    mem = make_memory(cfg, num_pages=6000 // ps + 40, max_reqs=90, max_context_len=256, fill=False)
    for scn in (s for s in _scenarios(rng, 6, ps) if s.mode != ForwardMode.EXTEND):
        step = Step(mem, 3, max_bs=6, max_width=6)                # fill 3 > W for some keys
        cap, a = materialize(scn, mem, 3), materialize(scn, mem, 3)
        key = cap.batch.graph_key()
        gi = cap.batch.graph_inputs()
        step.load(gi, capture=True)
        view = step.capture(key, gi.spec_info, gi.raw_bs)
        _check_host_plan(graph_host_plan(view, key, ps, mem.max_context_len), view.layout)
        step.load(a.batch.graph_inputs())
        view = step.update(key, a.batch.raw_bs)
        h = graph_host_plan(view, key, ps, mem.max_context_len)
        _check_host_plan(h, view.layout)
        assert h.max_kv == mem.max_context_len >= int(h.kv_lens.max())


# --------------------------------------------------------------------------- the packed mask

def _reference_bits(lay, i):
    """Request i's ``[W, kv]`` mask as the layout defines it (torch_native.visible)."""
    w, kv = lay.width, int(lay.seq_lens_k[i])
    p, j = torch.arange(kv)[None, :], torch.arange(w)[:, None]
    if lay.mask == MaskKind.TREE:
        pre = kv - w
        tree = lay.custom_mask.view(lay.bs, w, w)[i]
        return (p < pre) | tree[j, (p - pre).clamp(0, w - 1)]
    base = int(lay.draft_prefix_lens[i])
    return (p < base) | ((p - base) % w == j)


@pytest.mark.parametrize("kind", ["tree", "draft"])
def test_packed_mask_is_what_flashinfer_reads(kind):
    """Bits read the way variants.cuh reads them (byte mask_indptr[i], bit j*kv + p, little
    endian), with mask_indptr as FlashInfer's plan computes it for a packed mask
    (prefill._compute_page_mask_indptr: cumsum(q_len * kv_len), in bytes here)."""
    rng = random.Random(7)
    cfg = ModelConfig(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
    mem = make_memory(cfg, num_pages=300, max_reqs=20, max_context_len=256, fill=False, device=DEVICE)
    bs = 5
    spec = verify_spec(6, bs, rng, topk=4, steps=2) if kind == "tree" else draft_decode_spec(4, 3, 2)
    scn = Scenario(ForwardMode.TARGET_VERIFY if kind == "tree" else ForwardMode.DECODE, bs,
                   [rng.randint(8, 120) for _ in range(3)], spec=spec)
    batch = Step(mem, 1).build(materialize(scn, mem, 1).batch)
    lay = batch.step.layout
    h = eager_host_plan(batch.step)
    q_lens = (h.qo_indptr[1:] - h.qo_indptr[:-1]).long()
    kv_lens = (h.kv_indptr[1:] - h.kv_indptr[:-1] - 1).long() * lay.page_size + h.kv_last_page_len
    mask_indptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(q_lens * kv_lens, 0)])
    out = torch.full((int(mask_indptr[-1]) + 8,), 0xA5, dtype=torch.uint8, device=DEVICE)
    pack_uniform_mask(lay.seq_lens_k, lay.width, int(h.kv_lens.max()), out, tree_mask=lay.custom_mask,
                      draft_prefix_lens=lay.draft_prefix_lens)
    out = out.cpu()
    lay = type(lay)(**{k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in vars(lay).items()})
    for i in range(bs):
        kv = int(kv_lens[i])
        e = torch.arange(lay.width * kv)
        got = ((out[int(mask_indptr[i]) + e // 8].long() >> (e % 8)) & 1).bool().view(lay.width, kv)
        assert torch.equal(got, _reference_bits(lay, i)), f"request {i}"


def test_host_plan_is_numpy_only():
    from attn_backends.backends.flashinfer_common import host_plan, indptr
    h = host_plan(np.array([1, 16, 17, 33]), indptr(np.array([1, 1, 1, 1])), 16)
    assert h.kv_indptr.tolist() == [0, 1, 2, 4, 7] and h.kv_last_page_len.tolist() == [1, 16, 1, 1]
    assert h.qo_indptr.tolist() == [0, 1, 2, 3, 4] and h.max_kv == 33


def test_poison_fills_the_uint8_mask_buffer_whatever_its_position():
    """The packed mask buffer is uint8: poisoning it must not overflow (the suites poison every
    graph buffer before each replay)."""
    from attn_backends.check.layout_checks import poison
    bufs = {f"b{i}": torch.zeros(3, dtype=torch.uint8 if i in (1, 2) else torch.int32) for i in range(4)}
    poison(bufs)
    assert bufs["b1"].tolist() == bufs["b2"].tolist() == [255] * 3
    assert bufs["b0"].tolist() == [-7] * 3 and bufs["b3"].tolist() == [2 ** 30] * 3
