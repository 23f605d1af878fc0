"""Soak: 10,000 replays of random batches over every bucket and mode of
the UniformGraphRunner (decode, verify chain, verify tree), the DraftExtendRunner and the
MultiStepDraftRunner, triton backends in bf16, each bitwise equal to the eager forward of the
same padded batch, no drift, no growth of allocated memory after warm-up. The CPU smoke runs the
same code on torch_native, a few replays per runner."""
import contextlib
import gc
import random

import pytest
import torch

from attn_backends import CaptureHiddenMode as H
from attn_backends_runtime.eagle import SpecConfig
from attn_backends_runtime.engine import Engine, EngineConfig
from attn_backends_runtime.models import TinyConfig
from attn_backends_runtime.request import SamplingParams
from attn_backends_runtime.testing import soak as soak_mod
from attn_backends_runtime.testing.rig import KINDS as RIG_KINDS
from attn_backends_runtime.testing.rig import Rig, RigSpec
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
    """A larger batch after warm-up raises the high-water mark, which is not growth; the probe
    batch, run again at the end, shows nothing was kept."""
    res = _soak_with_simulated_memory(monkeypatch, 0)
    assert res.alloc_max > res.alloc_base and res.growth == 0


def test_soak_growth_catches_a_leak(monkeypatch):
    res = _soak_with_simulated_memory(monkeypatch, 64)
    warm = soak_mod.WARMUP * max(soak_mod.BUCKETS) + 1     # replays up to the baseline (warm-up, then the probe)
    assert res.growth == 64 * (res.replays - warm), res


@contextlib.contextmanager
def cyclic_garbage():
    """Collect what becomes cyclic garbage inside the block (gc off, DEBUG_SAVEALL), into the list
    yielded. A cycle that holds tensors keeps device memory live until Python's cyclic gc happens
    to run, so the soak's live bytes would move between two runs of one batch."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    found: list = []
    try:
        yield found
    finally:
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found += [o for o in gc.garbage if isinstance(o, torch.Tensor)]
        found += [type(o).__name__ for o in gc.garbage if not isinstance(o, torch.Tensor)]
        gc.garbage.clear()
        gc.set_debug(0)
        if enabled:
            gc.enable()


@pytest.mark.parametrize("kind", RIG_KINDS)
def test_runner_steps_make_no_reference_cycles(kind):
    """Replays and eager forwards of every runner kind leave nothing for the cyclic gc (the eager
    step and its batch referred to each other)."""
    rig = Rig(RigSpec(kind, "torch_native", False, (2, 4)))
    rng = random.Random(5)
    reqs = rig.new_requests(3, rng, tokens=5 if kind == "piecewise" else None)
    bucket = rig.bucket(reqs) if kind != "draft_decode" else None
    with cyclic_garbage() as found:
        for _ in range(2):
            rig.runner.run(rig.batch(reqs, bucket, H.FULL))
            rig.expected(reqs, H.FULL)
    assert not found, f"{kind}: {len(found)} objects in reference cycles, e.g. {found[:8]}"


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("spec", [None, SpecConfig("eagle", 2, 3, 4)], ids=["plain", "eagle-tree"])
def test_engine_steps_make_no_reference_cycles(spec, graphs):
    tc = TinyConfig(page_size=16)
    engine = Engine(EngineConfig(tc, "torch_native", spec, "cpu", max_batch=2, max_context_len=64, buckets=(1, 2),
                                 token_buckets=(16, 32), graphs=graphs))
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(3))
    engine.run()                             # warm: the first steps build caches that are kept on purpose
    engine.add_request([5, 4, 3], SamplingParams(6))
    engine.add_request([7, 8, 9, 10], SamplingParams(4))
    with cyclic_garbage() as found:
        engine.run()
    assert not found, f"{len(found)} objects in reference cycles, e.g. {found[:8]}"
