"""The executor's eager fallback (sgl #22832), in every mode it serves: a batch the runner refuses
is run eagerly, and its outputs come from that eager forward, never from the graph's static
buffers of an earlier replay. The refused batch has the replayed batch's shape, so stale static
outputs would have the right shape too: only their values can tell (issue #38 item 10). And the
executors build graph runners for what the backend's capabilities declare, nothing else."""
import dataclasses

import pytest
import torch

from attn_backends import ForwardMode, GraphKey, GraphSupport, registry
from attn_backends.backends.torch_native import TorchNativeBackend
from attn_backends_runtime import executor
from attn_backends_runtime.draft import MultiStepDraftRunner
from attn_backends_runtime.eagle import SpecConfig
from attn_backends_runtime.engine import Engine, EngineConfig
from attn_backends_runtime.models import TinyConfig
from attn_backends_runtime.piecewise import PiecewiseRunner
from attn_backends_runtime.runner_base import RunnerOutput, slice_hidden
from attn_backends_runtime.testing.runner_checks import FALLBACK_KINDS, executor_graph_messages, fallback_messages


def static_outputs(runner, batch) -> RunnerOutput:
    """What the graph of ``batch``'s bucket last wrote, cut to ``batch``'s rows as a replay
    would cut them, without running anything: the stale outputs of sgl #22832."""
    if isinstance(runner, PiecewiseRunner):
        raw = batch.num_tokens
        h, logits = runner.graphs[runner.bucket_for(raw)][-1][1]
        lens = batch.extend_seq_lens_cpu[:batch.raw_bs]
        return RunnerOutput(logits[:raw].clone(), slice_hidden(h, batch.capture_hidden_mode, raw, 0, lens))
    if isinstance(runner, MultiStepDraftRunner):
        key = GraphKey(batch.forward_mode, runner.bucket_for(batch.raw_bs), runner.topk, runner.capture_hidden_mode)
        _, out, sbs = runner.graphs[key]
        return runner._slice(out, batch, sbs)
    key, sb = runner._by_raw[batch.raw_bs]
    return runner._slice(runner.graphs[key][1], batch, sb)


def plant_stale_fallback(mp) -> None:
    """Planted: where the runner refuses a batch of a size it captured, the executor returns the
    graph's static outputs (counted as eager) instead of running the eager forward."""
    forward, draft = executor.ModelExecutor.forward, executor.ModelExecutor.draft

    def stale(self, runner, key, batch):
        if runner is None or runner.can_run(batch) or batch.raw_bs > runner.max_bs:
            return None
        self._count(key, False)
        return static_outputs(runner, batch)

    def forward_bug(self, batch):
        key = executor.MODE_KEYS[batch.forward_mode]
        out = stale(self, self.runners.get(key), key, batch)
        return forward(self, batch) if out is None else out

    def draft_bug(self, inp):
        out = stale(self, self.multi_step, "draft_decode", inp)
        return draft(self, inp) if out is None else out
    mp.setattr(executor.ModelExecutor, "forward", forward_bug)
    mp.setattr(executor.ModelExecutor, "draft", draft_bug)


@pytest.mark.parametrize("kind", FALLBACK_KINDS)
def test_eager_fallback_returns_the_eager_outputs(kind):
    msgs = fallback_messages([kind])
    assert not msgs, "\n".join(msgs)


@pytest.mark.parametrize("kind", FALLBACK_KINDS)
def test_stale_static_outputs_are_caught_by_value(kind, monkeypatch):
    plant_stale_fallback(monkeypatch)
    msgs = fallback_messages([kind])
    assert msgs, f"{kind}: the stale static outputs passed"
    # the shapes agree (no shape, missing-field or crash message): the values alone caught it
    assert any("relative error" in m for m in msgs), msgs
    assert not any(w in m for m in msgs for w in (" has shape ", " is missing", " is unexpected", "crashed")), msgs


class DraftExtendNeverGraphed(TorchNativeBackend):
    """Declares no graph support for DRAFT_EXTEND (every other mode as torch_native)."""
    capabilities = dataclasses.replace(TorchNativeBackend.capabilities,
                                       mode_graph=((ForwardMode.DRAFT_EXTEND, GraphSupport.NEVER),))


def test_executors_capture_what_the_capabilities_declare(monkeypatch):
    """A mode the backend declares no graph support for gets no graph runner (its forwards run
    eagerly, counted); the others keep theirs, and `check`'s I11 of the executors agrees."""
    monkeypatch.setitem(registry._extra, "never_de", f"{__name__}:DraftExtendNeverGraphed")
    eng = Engine(EngineConfig(TinyConfig(), "never_de", SpecConfig("eagle", 1, 3, 4), "cpu", max_batch=2,
                              max_context_len=64, max_prefill_tokens=16), capture=False)
    assert {ex.name: sorted(ex.runners) for ex in eng.executors} == {
        "target": ["extend", "verify"], "draft": ["draft_decode", "extend"]}
    assert executor_graph_messages("never_de") == []
    assert executor_graph_messages("torch_native") == []


class SixteenBitOnly(TorchNativeBackend):
    """Declares what the FlashInfer family does: 16-bit dtypes and head dims 64/128 only."""
    capabilities = dataclasses.replace(TorchNativeBackend.capabilities, dtypes=(torch.float16, torch.bfloat16),
                                       head_dims=(64, 128), mla=False)


def test_executor_check_builds_a_model_the_backend_serves(monkeypatch):
    """The executor check's tiny engine takes the backend's dtype and head dims (a float32 model of
    head dim 16 made it crash on every FlashInfer-family backend)."""
    monkeypatch.setitem(registry._extra, "sixteen_bit", f"{__name__}:SixteenBitOnly")
    assert executor_graph_messages("sixteen_bit") == []
