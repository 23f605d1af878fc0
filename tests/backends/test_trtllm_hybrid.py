"""``trtllm_mla`` and ``hybrid`` on the CPU (Triton kernels in the interpreter): the layout suite and
the runner suite; a hybrid's I12 fan-out sees each sub-backend refreshed (and catches a planted
hybrid that skips one); a tiny model with a different backend per layer replays like eager;
select() picks per mode with a reason for every refusal."""
import random

import pytest
import torch

from attn_backends import ForwardMode, LayoutError, ModelConfig, get_backend, registry
from attn_backends.backends.hybrid import HybridBackend, compose, compose_selected
from attn_backends.check.scenarios import Scenario, make_memory, materialize, verify_spec
from attn_backends.check.suite import declared_modes, run_suite
from attn_backends.registry import get_backend_class, list_backends, register
from attn_backends_runtime.full_graph import UniformGraphRunner
from attn_backends_runtime.models import TinyConfig, TinyModel
from attn_backends_runtime.runner_base import run_eager
from attn_backends_runtime.testing.rig import Rig, RigSpec
from attn_backends_runtime.testing.runner_suite import check_case, run_runner_suite

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UNIFORM = ("decode", "target_verify", "draft_extend")
# Cases: the CPU runs trtllm_mla's Triton kernel in the interpreter (seconds a case), so it takes
# fewer; tests/check/test_layout_suite.py runs trtllm_mla's layout suite per mode.
FEW = 6 if DEVICE == "cuda" else 2
CPU_HYBRID = {"extend": "torch_native", **{m: ("triton", "trtllm_mla") for m in UNIFORM}}


@pytest.fixture
def cpu_hybrid():
    """A hybrid that runs on the CPU: EXTEND on the reference, the uniform modes on Triton."""
    return compose(CPU_HYBRID, name="hybrid_cpu_test")


@pytest.fixture
def light_hybrid(monkeypatch):
    """The suites' hybrid on the CPU: the reference in every mode, under a second name for the uniform modes so
    that a step has two instances to refresh (the interpreted kernels have suites of their own; here the hybrid's
    delegation and fan-out are under test)."""
    monkeypatch.setattr(registry, "_extra", dict(registry._extra))    # both names gone after the test (`list`)
    register("torch_native_twin", "attn_backends.backends.torch_native:TorchNativeBackend")
    return compose({**CPU_HYBRID, **{m: "torch_native_twin" for m in UNIFORM}}, name="hybrid_light_test")


def test_trtllm_mla_layout_suite_covers_every_mode():
    """Its layout suite runs per mode in tests/check/test_layout_suite.py; here, that the modes are all six."""
    caps = get_backend_class("trtllm_mla").capabilities
    assert set(declared_modes(caps)) == {"decode", "draft_decode", "extend", "verify_chain", "verify_tree",
                                         "draft_extend"}


def test_trtllm_mla_runner_suite():
    """The graph runners of trtllm_mla's modes (its metadata per mode); the piecewise and breakable runners,
    the same for every backend, run with the others in tests/runtime/test_runners.py."""
    kinds = None if DEVICE == "cuda" else ("decode", "verify", "verify_tree", "draft_extend", "draft_decode")
    report = run_runner_suite("trtllm_mla", device=DEVICE, cases=FEW // 2, seed=5, kinds=kinds)
    assert {m for _, m in report.cases} >= {f"runner:{k}" for k in kinds or ()}, report.cases
    assert not report.failures, "\n".join(map(str, report.failures[:5]))


def test_hybrid_suites_and_fan_out(light_hybrid):
    report = run_suite("hybrid_light_test", device=DEVICE, cases=FEW // 2, seed=8)
    assert not report.failures, "\n".join(map(str, report.failures[:5]))
    report = run_runner_suite("hybrid_light_test", device=DEVICE, cases=FEW // 2, seed=9)
    assert not report.failures, "\n".join(map(str, report.failures[:5]))
    assert report.counts[("hybrid_light_test", next(m for _, m in report.cases), "I12")][0] > 0


def test_planted_hybrid_that_skips_a_sub_backend_is_caught(cpu_hybrid, monkeypatch):
    """A skipped sub-backend: the delegate of the replayed mode not refreshed (the hybrid refreshes itself only).
    I12 counts the refreshes; where the replay re-runs the forward (the CPU's graph stand-in) the
    delegate's forward also refuses the metadata of another key. Both must report it."""
    monkeypatch.setattr(HybridBackend, "init_forward_metadata_replay_cuda_graph",
                        lambda self, inputs: setattr(self, "_active", self._delegate(inputs.key.forward_mode)))
    found = {}
    rig = Rig(RigSpec("decode", backend="hybrid_cpu_test", buckets=(2, 4), device=DEVICE))
    judge = lambda inv, msgs: found.setdefault(inv, []).extend(msgs)   # noqa: E731
    if DEVICE == "cpu":
        with pytest.raises(LayoutError, match="the graph metadata was prepared for"):
            check_case(rig, random.Random(0), judge, tol=1e-4)
    else:
        check_case(rig, random.Random(0), judge, tol=1e-4)
    assert any("refreshed 0 times" in m for m in found["I12"]), found["I12"]


def test_hybrid_delegates_by_mode_and_reports_the_active_metadata(cpu_hybrid):
    cfg = ModelConfig(num_layers=1, num_q_heads=4, is_mla=True, kv_lora_rank=32, qk_rope_head_dim=16, page_size=16)
    mem = make_memory(cfg, num_pages=64, max_reqs=8, max_context_len=128, device=DEVICE)
    h = get_backend("hybrid_cpu_test", cfg, mem)
    assert [type(d).__name__ for d in h.sub_backends()] == ["TorchNativeBackend", "TrtllmMLABackend"]
    assert h.sub_backends(ForwardMode.DECODE) == h.sub_backends(ForwardMode.TARGET_VERIFY)
    m = materialize(Scenario(ForwardMode.EXTEND, 2, [0, 9], extend_lens=[4, 2]), mem, 1)
    h.init_forward_metadata(m.batch)
    assert h.forward_metadata is h.delegates[ForwardMode.EXTEND].forward_metadata
    with pytest.raises(ValueError, match="cannot serve this model on cpu: MLA only, model is MHA/GQA"):   # memory: cpu
        get_backend(compose({"extend": (None, "torch_native")}, name="mla_only_test").name,
                    ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16),
                    make_memory(ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16),
                                num_pages=8, max_reqs=2, max_context_len=32, fill=False))


def test_default_hybrid_is_listed_with_its_composition_and_reason():
    info = {i.name: i for i in list_backends("cpu")}["hybrid"]
    assert info.capabilities.modes == frozenset(ForwardMode(m) for m in (1, 2, 3, 4))
    if DEVICE == "cpu":
        assert info.reason == "does not run on cpu (runs on cuda)"


def test_compose_selected_picks_per_mode_with_reasons():
    cfg = ModelConfig(num_layers=1, num_q_heads=4, is_mla=True, page_size=16)
    cls, picks = compose_selected(cfg, device=DEVICE, name="selected_test")
    assert set(picks) == {ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}
    for sel in picks.values():
        assert "hybrid" not in sel.refused and all(sel.refused.values())
    assert cls.by_mode[ForwardMode.DECODE] == (None, picks[ForwardMode.DECODE].name)


def test_a_backend_per_layer_replays_like_eager():
    """MLA tiny model, layer 0 on torch_native and layer 1 on trtllm_mla, under the full-graph runner."""
    tc = TinyConfig(num_layers=2, is_mla=True, page_size=16)
    model, cfg = TinyModel(tc, DEVICE), tc.attention()
    mem = make_memory(cfg, num_pages=64, max_reqs=12, max_context_len=128, seed=2, device=DEVICE)
    layers = [get_backend("torch_native", cfg, mem), get_backend("trtllm_mla", cfg, mem)]
    spec = verify_spec(3, 4, random.Random(0))
    runner = UniformGraphRunner(model, layers, mem, ForwardMode.TARGET_VERIFY, [2, 4], spec=spec)
    runner.capture()
    m = materialize(Scenario(ForwardMode.TARGET_VERIFY, 3, [5, 40, 17], spec=verify_spec(3, 3, random.Random(1))),
                    mem, 1)
    m.batch.input_ids = torch.randint(0, tc.vocab_size, (m.batch.num_tokens,), device=DEVICE)
    out = runner.run(m.batch)
    want = run_eager(model, [get_backend("torch_native", cfg, mem), get_backend("trtllm_mla", cfg, mem)], m.batch, 3)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-4)
