"""The ``flashinfer`` and ``flashinfer_mla`` backends through FlashInfer's real wrapper code on the
CPU, its kernel modules emulated (tests/support/fi_emulation.py): where ``import flashinfer`` works
(Python 3.12 with the wheels); skipped elsewhere (CI: Python 3.11, no flashinfer) with the reason.

Eager outputs against torch_native in every mode; the layout suite and the runner suite; one
FlashInfer plan per step whatever the number of per-layer instances; graph-mode replay after
every graph buffer is poisoned equals eager exactly, A, B, A; and two planted faults (a plan
made at capture only, a mask packed for the wrong rows) that these checks catch."""
import random

import pytest
import torch

pytest.importorskip("flashinfer", reason="flashinfer is not importable here (needs Python 3.12 and its wheels)")

import fi_emulation as E  # noqa: E402

from attn_backends import ForwardMode, ModelConfig, register  # noqa: E402
from attn_backends.backends.torch_native import TorchNativeBackend  # noqa: E402
from attn_backends.check.layout_checks import poison  # noqa: E402
from attn_backends.check.scenarios import (  # noqa: E402
    Scenario,
    draft_decode_spec,
    draft_extend_spec,
    make_memory,
    materialize,
    verify_spec,
)
from attn_backends.check.suite import run_suite  # noqa: E402
from attn_backends_runtime.full_graph import UniformGraphRunner  # noqa: E402
from attn_backends_runtime.models import TinyConfig, TinyModel  # noqa: E402
from attn_backends_runtime.runner_base import run_eager  # noqa: E402
from attn_backends_runtime.testing.runner_suite import run_runner_suite  # noqa: E402

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    E.install(monkeypatch)


def _config(mla: bool, group: int = 4):
    if mla:
        return ModelConfig(num_layers=1, num_q_heads=8, is_mla=True, page_size=16, dtype=BF16)
    return ModelConfig(num_layers=1, num_q_heads=2 * group, num_kv_heads=2, head_dim=64, page_size=16, dtype=BF16)


def _scenarios(rng, mla: bool, bs=4):
    pre = lambda lo=0: [rng.randint(lo, 90) for _ in range(3)]  # noqa: E731
    out = [Scenario(ForwardMode.DECODE, bs, pre()),
           Scenario(ForwardMode.TARGET_VERIFY, bs, pre(), spec=verify_spec(3, bs, rng)),
           Scenario(ForwardMode.DRAFT_EXTEND, bs, pre(), spec=draft_extend_spec(3, bs, 3, [1, 3, 2])),
           Scenario(ForwardMode.EXTEND, 3, pre(), extend_lens=[5, 1, 9])]
    if not mla:
        out += [Scenario(ForwardMode.TARGET_VERIFY, bs, pre(), spec=verify_spec(6, bs, rng, topk=4, steps=2)),
                Scenario(ForwardMode.DECODE, bs, pre(8), spec=draft_decode_spec(2, 3, 2))]
    return out


def _q(cfg, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, cfg.num_q_heads, cfg.qk_dim, generator=g).to(cfg.dtype)


def _rows(m):
    s = m.scenario
    return m.batch.raw_bs * s.width if s.width else sum(s.extend_lens)


@pytest.mark.parametrize("mla,group", [(False, 1), (False, 4), (True, 0)], ids=["gqa1-cuda-cores", "gqa4-tc", "mla"])
def test_eager_outputs_equal_torch_native(mla, group):
    cfg = _config(mla, group)
    mem = make_memory(cfg, num_pages=600, max_reqs=40, max_context_len=256, seed=1)
    cls = E.EmulatedFlashInferMLA if mla else E.EmulatedFlashInfer
    be, ref = cls(cfg, mem), TorchNativeBackend(cfg, mem)
    for i, scn in enumerate(_scenarios(random.Random(group), mla)):
        m = materialize(scn, mem, 1)
        q = _q(cfg, m.batch.num_tokens, i)
        be.init_forward_metadata(m.batch)
        ref.init_forward_metadata(m.batch)
        got = be.forward(q, None, None, cfg.layer(0), m.batch, save_kv_cache=False)[:_rows(m)]
        want = ref.forward(q, None, None, cfg.layer(0), m.batch, save_kv_cache=False)[:_rows(m)]
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=scn.describe)


@pytest.mark.parametrize("cls", [E.EmulatedFlashInfer, E.EmulatedFlashInferMLA], ids=["flashinfer", "flashinfer_mla"])
def test_layout_suite(cls):
    report = run_suite(cls, device="cpu", cases=4, seed=11)
    assert not report.failures, "\n".join(map(str, report.failures[:5]))


FP8_CASES = [(E.EmulatedFlashInfer, torch.float8_e4m3fn, 18), (E.EmulatedFlashInfer, torch.float8_e5m2, 18),
             (E.EmulatedFlashInferMLA, torch.float8_e4m3fn, 15)]      # (backend, KV dtype, least cases)


@pytest.mark.parametrize("cls,kv,least", FP8_CASES,
                         ids=["flashinfer-e4m3fn", "flashinfer-e5m2", "flashinfer_mla-e4m3fn"])
def test_layout_suite_on_an_fp8_cache(cls, kv, least):
    """The FP8 pool handed to FlashInfer's Python with its KV dtype and scales (GQA: run() folds
    k_scale into the kernel's sm_scale and multiplies out by v_scale; MLA: the kernel takes
    ckv/kpe scales; the emulated kernels read the cache's values): I9n against torch_native on
    the same FP8 pool."""
    report = run_suite(cls, device="cpu", cases=3, seed=5, kv_dtype=kv)
    assert sum(report.cases.values()) >= least and not report.failures, "\n".join(map(str, report.failures[:5]))


def test_check_of_flashinfer_mla_on_an_fp8_cache(monkeypatch, tmp_path):
    """``attn-backends check --kv-dtype fp8_e4m3`` (layout and runner suites) on the emulated MLA
    backend: every pool e4m3, no failure."""
    import json
    from pathlib import Path

    from attn_backends.check import cli
    from attn_backends.kv_cache import KVMemory
    made, init = [], KVMemory.__init__
    spy = lambda self, *a, **k: (made.append(k.get("dtype")), init(self, *a, **k))[1]  # noqa: E731
    monkeypatch.setattr(KVMemory, "__init__", spy)
    monkeypatch.chdir(Path(__file__).resolve().parents[1] / "support")
    out = tmp_path / "check.json"
    code = cli.main(["check", "--backend", "fi_emulation:EmulatedFlashInferMLA", "--kv-dtype", "fp8_e4m3",
                     "--cases", "2", "--suite-cases", "8", "--progress-every", "0", "--json", str(out)])
    res = json.loads(out.read_text())["backends"][0]
    assert code == 0 and res["ok"] and not res["failures"], res["failures"][:3]
    assert {c["suite"] for c in res["cases"]} == {"layout", "runner"} and set(made) == {torch.float8_e4m3fn}, made


@pytest.mark.parametrize("name", ["fi_emulated", "fi_mla_emulated"])
def test_runner_suite(name):
    register("fi_emulated", "fi_emulation:EmulatedFlashInfer")
    register("fi_mla_emulated", "fi_emulation:EmulatedFlashInferMLA")
    report = run_runner_suite(name, device="cpu", cases=5, seed=2)
    assert not report.failures, "\n".join(map(str, report.failures[:5]))


def test_one_plan_per_step_for_every_layer():
    """4 layers, 4 instances: capture plans each key once, every replay and every eager step once."""
    tc = TinyConfig(num_layers=4, page_size=16, head_dim=64, dtype=BF16)
    model, cfg = TinyModel(tc, "cpu"), tc.attention()
    mem = make_memory(cfg, num_pages=200, max_reqs=16, max_context_len=128, seed=1)
    layers = [E.EmulatedFlashInfer(cfg, mem) for _ in range(4)]
    runner = UniformGraphRunner(model, layers, mem, ForwardMode.DECODE, [2, 4])
    E.PLANS.clear()
    runner.capture()
    assert len(E.PLANS) == 2, E.PLANS                                    # one per bucket
    m = materialize(Scenario(ForwardMode.DECODE, 4, [5, 40, 17]), mem, 1)       # raw 3, padded to 4
    m.batch.input_ids = torch.randint(0, tc.vocab_size, (4,))
    E.PLANS.clear()
    out = runner.run(m.batch)
    assert E.PLANS == [("decode", 4, True)], E.PLANS                     # bucket 4, raw 3: one plan
    E.PLANS.clear()
    want = run_eager(model, layers, m.batch, 1)
    # one plan, in the graph form (FlashInfer plans graphs differently: eager == replay bitwise)
    assert E.PLANS == [("decode", 4, True)], E.PLANS
    assert torch.equal(out.logits, want.logits)


def _graph_case(cls, cfg, mem, scns):
    """Capture C without a runner (a StandaloneStep), then replay A, B, A with every graph buffer poisoned first;
    returns (replayed, eager) outputs of each replay."""
    be, eager_be = cls(cfg, mem), cls(cfg, mem)
    cap, *hist = [materialize(s, mem, 1) for s in scns]
    n = cap.batch.num_tokens
    be.init_cuda_graph_state(cap.batch.batch_size, n)
    be.init_forward_metadata_capture_cuda_graph(cap.batch.graph_inputs())
    layer, pairs = cfg.layer(0), []
    for i, m in enumerate([hist[0], hist[1], hist[0]]):
        poison(be.graph_buffers())
        be.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
        q = _q(cfg, n, i % 2)
        got = be.forward(q, None, None, layer, cap.batch, save_kv_cache=False)   # the captured call: static batch
        eager_be.init_forward_metadata(m.batch)
        want = eager_be.forward(q, None, None, layer, m.batch, save_kv_cache=False)
        pairs.append((got[:_rows(m)], want[:_rows(m)]))
    return pairs


def _graph_scenarios(mla, rng):
    """Capture batch C (full bucket), then A (raw 3) and B (raw 2): chain (MLA) or tree verify."""
    bs = 4
    spec = (lambda: verify_spec(3, bs, rng)) if mla else (lambda: verify_spec(6, bs, rng, topk=4, steps=2))
    return [Scenario(ForwardMode.TARGET_VERIFY, bs, p, spec=spec())
            for p in ([rng.randint(0, 90) for _ in range(bs)], [70, 3, 41], [12, 88])]


def _replay_mismatches(mla):
    """The replays (0, 1, 2 = A, B, A) whose output differs from eager; a crash of the emulated
    kernel on poisoned metadata (an illegal address on the GPU) or its refusal of a plan whose host
    lengths differ from the device's (``fi_emulation._check_host``) is a finding too."""
    cfg = _config(mla)
    mem = make_memory(cfg, num_pages=600, max_reqs=40, max_context_len=256, seed=3)
    cls = E.EmulatedFlashInferMLA if mla else E.EmulatedFlashInfer
    try:
        pairs = _graph_case(cls, cfg, mem, _graph_scenarios(mla, random.Random(5)))
    except (RuntimeError, IndexError, AssertionError) as e:
        return [f"crashed: {e}"[:200]]
    return [i for i, (got, want) in enumerate(pairs) if not torch.equal(got, want)]


@pytest.mark.parametrize("mla", [False, True], ids=["gqa-tree", "mla-verify"])
def test_replay_after_poison_equals_eager_a_b_a(mla):
    assert _replay_mismatches(mla) == []


@pytest.mark.parametrize("mla", [False, True], ids=["gqa-tree", "mla-verify"])
def test_planted_plan_made_at_capture_only_is_caught(mla, monkeypatch):
    """A FlashInfer plan not refreshed before replay (made at capture only): the replays read a stale plan."""
    from attn_backends.backends import flashinfer_common
    real = flashinfer_common.FlashInferBase._update
    seen = set()

    def capture_only(self, meta, view):
        if meta.key is not None:                  # graph records: planned at capture, never again
            if meta.key in seen:
                return
            seen.add(meta.key)
        real(self, meta, view)
    monkeypatch.setattr(flashinfer_common.FlashInferBase, "_update", capture_only)
    assert _replay_mismatches(mla), "a stale FlashInfer plan went unnoticed"


def test_planted_mask_packed_for_the_wrong_rows_is_caught(monkeypatch):
    from attn_backends.backends import flashinfer_backend
    real = flashinfer_backend.pack_uniform_mask

    def off_by_one_row(seq_lens, width, max_kv, out, tree_mask=None, draft_prefix_lens=None):
        w2 = width * width
        shifted = torch.cat([tree_mask[w2:], tree_mask[:w2]]) if tree_mask is not None else None
        return real(seq_lens, width, max_kv, out, tree_mask=shifted, draft_prefix_lens=draft_prefix_lens)
    monkeypatch.setattr(flashinfer_backend, "pack_uniform_mask", off_by_one_row)
    cfg = _config(False)
    mem = make_memory(cfg, num_pages=600, max_reqs=40, max_context_len=256, seed=1)
    be, ref = E.EmulatedFlashInfer(cfg, mem), TorchNativeBackend(cfg, mem)
    scn = _scenarios(random.Random(4), False)[4]
    m = materialize(scn, mem, 1)
    q = _q(cfg, m.batch.num_tokens, 0)
    be.init_forward_metadata(m.batch)
    ref.init_forward_metadata(m.batch)
    got = be.forward(q, None, None, cfg.layer(0), m.batch, save_kv_cache=False)[:_rows(m)]
    want = ref.forward(q, None, None, cfg.layer(0), m.batch, save_kv_cache=False)[:_rows(m)]
    assert (got.float() - want.float()).abs().max() > 0.05
