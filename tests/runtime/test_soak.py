"""Soak (issue #11 deliverable 4): 10,000 replays of random batches over every bucket and mode of
the UniformGraphRunner (decode, verify chain, verify tree), the DraftExtendRunner and the
MultiStepDraftRunner, triton backends in bf16, each bitwise equal to the eager forward of the
same padded batch, no drift, no growth of allocated memory after warm-up. The CPU smoke runs the
same code on torch_native, a few replays per runner."""
import pytest

from attn_backends_runtime.testing.soak import KINDS, soak


@pytest.mark.cuda
def test_soak_10000_replays_cuda():
    res = soak(10_000, "cuda", seed=0)
    assert sum(r.replays for r in res) >= 10_000
    bad = [f"{r.name}: {m}" for r in res for m in r.mismatches[:3]]
    assert not bad, "\n".join(bad)
    grew = {r.name: r.growth for r in res if r.growth}
    assert not grew, f"allocated memory grew after warm-up (bytes): {grew}"


def test_soak_smoke_cpu():
    res = soak(len(KINDS) * 22, "cpu", seed=1, models=(False,), log=lambda *_: None)
    assert [r.name for r in res] == [f"{k}-gqa" for k in KINDS]
    assert all(r.replays >= 18 for r in res)
    bad = [f"{r.name}: {m}" for r in res for m in r.mismatches[:3]]
    assert not bad, "\n".join(bad)
