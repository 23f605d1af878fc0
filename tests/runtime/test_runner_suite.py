"""``run_runner_suite``: the runner invariants over random cases, and a planted bug it must
catch."""
import pytest
import torch

from attn_backends_runtime import full_graph
from attn_backends_runtime.runner_base import RunnerOutput, slice_hidden
from attn_backends_runtime.testing.runner_suite import RUNNER_KINDS, run_runner_suite


def test_suite_passes_on_torch_native():
    rep = run_runner_suite("torch_native", cases=8, seed=0)   # `attn-backends check` runs 60
    assert rep.ok, "\n".join(map(str, rep.failures))
    modes = {m for _, m in rep.cases}
    assert {"runner:decode", "runner:verify", "runner:breakable_decode"} <= modes
    invs = {k[2] for k in rep.counts}
    assert {"I7", "I8", "I9", "I10", "I11", "I12", "I14"} <= invs
    assert {k.label for k in RUNNER_KINDS.values()} | {"runner:executor"} >= modes


def test_suite_catches_aliased_outputs(monkeypatch):
    def aliasing_slice(self, out, batch, static_batch):      # planted: views of the graph outputs
        logits, hidden = out
        n = batch.raw_bs * self.width
        return RunnerOutput(logits[:n], slice_hidden(hidden, batch.capture_hidden_mode, n, self.width))

    monkeypatch.setattr(full_graph.UniformGraphRunner, "_slice", aliasing_slice)
    rep = run_runner_suite("torch_native", cases=6, seed=0)       # every runner kind, the uniform ones too
    assert "I8" in rep.failed_invariants()
    assert all(f.seed >= 0 and "kind=" in f.case for f in rep.failures)


def test_unavailable_backend_is_refused():
    with pytest.raises(ValueError, match="not available on cuda"):
        if torch.cuda.is_available():
            pytest.skip("CUDA present")
        run_runner_suite("torch_native", device="cuda", cases=1)
