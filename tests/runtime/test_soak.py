"""Soak (issue #11 deliverable 4): 10,000 replays of random batches over every bucket and mode of
the UniformGraphRunner (decode, verify chain, verify tree), the DraftExtendRunner and the
MultiStepDraftRunner, triton backends in bf16, each bitwise equal to the eager forward of the
same padded batch, no drift, no growth of allocated memory after warm-up. The CPU smoke runs the
same code on torch_native, a few replays per runner."""
import pytest

from attn_backends_runtime.testing import soak as soak_mod
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


def _soak_with_simulated_memory(monkeypatch, leak_per_replay: int):
    """One CPU rig whose 'allocated bytes' are those of a runner that keeps the last batch's
    eager metadata live (1000 B per request of the last batch) plus ``leak_per_replay`` B kept
    for good by every replay."""
    state = {"raw": 0, "kept": 0}
    real = soak_mod._one

    def one(rig, pool, rng, raw, tol, exact):
        state["raw"], state["kept"] = raw, state["kept"] + leak_per_replay
        return real(rig, pool, rng, raw, tol, exact)

    monkeypatch.setattr(soak_mod, "_one", one)
    monkeypatch.setattr(soak_mod, "_allocated", lambda device: 1000 * state["raw"] + state["kept"])
    return soak_mod.soak_rig("decode", False, 40, "cpu", seed=3)


def test_soak_growth_ignores_the_last_batch_high_water_mark(monkeypatch):
    """A larger batch after warm-up raises the high-water mark (the first GPU soak reported that,
    49-204 KB, as growth); the probe batch, run again at the end, shows nothing was kept."""
    res = _soak_with_simulated_memory(monkeypatch, 0)
    assert res.alloc_max > res.alloc_base and res.growth == 0


def test_soak_growth_catches_a_leak(monkeypatch):
    res = _soak_with_simulated_memory(monkeypatch, 64)
    warm = soak_mod.WARMUP * max(soak_mod.BUCKETS) + 1     # replays up to the baseline (warm-up, then the probe)
    assert res.growth == 64 * (res.replays - warm), res
