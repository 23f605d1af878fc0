"""Soak: many replays of random batches across every bucket and mode of the graph runners, each
compared with the eager forward of the same padded batch (bitwise on the GPU with the triton
backends in bf16), with the allocated device memory of two runs of one probe batch compared,
after warm-up and at the end.

Runners: UniformGraphRunner (DECODE, TARGET_VERIFY chain and tree), DraftExtendRunner and
MultiStepDraftRunner, on a GQA and an MLA tiny model each. Every replay draws raw_bs in 1..max
bucket (so every bucket replays), a random subset of a fixed pool of requests, a random hidden
mode and, for DRAFT_EXTEND, random accept lengths. Drift: a fixed batch replayed first and last
must give the same bits.

    python -m attn_backends_runtime.testing.soak --replays 10000 [--device cuda] [--seed 0]
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import sys
import time
from dataclasses import dataclass, field

import torch

from attn_backends import CaptureHiddenMode as H

from .rig import Rig, RigSpec
from .runner_suite import compare

KINDS = ("decode", "verify", "verify_tree", "draft_extend", "draft_decode")
BUCKETS = (1, 2, 4, 8)
WARMUP = 2                     # passes over every raw_bs before memory is baselined


@dataclass
class RigResult:
    name: str
    replays: int = 0
    mismatches: list = field(default_factory=list)
    alloc_base: int = 0        # bytes allocated after the probe batch, right after warm-up
    alloc_end: int = 0         # the same, after the probe batch again at the end
    alloc_max: int = 0         # the high-water mark of any replay after warm-up (for the log)
    seconds: float = 0.0

    @property
    def growth(self) -> int:
        """Live bytes gained between two runs of the same probe batch, warm-up and end. Eager
        metadata and outputs of the last batch stay live until the next, so the high-water mark
        rises whenever a larger batch comes by chance; the probe compares like with like, so
        only what is kept (a leak) counts."""
        return self.alloc_end - self.alloc_base


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def _one(rig: Rig, pool: list, rng: random.Random, raw: int, tol: float, exact: bool) -> list:
    reqs = rng.sample(pool, raw)
    if rig.kind == "draft_extend":
        reqs = [dataclasses.replace(q, accept=rng.randint(1, rig.spec.n)) for q in reqs]
    hidden = H(rng.randint(0, 2))
    uniform = rig.kind != "draft_decode"
    out = rig.runner.run(rig.batch(reqs, rig.bucket(reqs) if uniform else None, hidden))
    want = rig.expected(reqs, hidden, padded=exact)
    return compare(out, want, tol, f"raw_bs={raw} hidden={hidden.name}")


def soak_rig(kind: str, mla: bool, replays: int, device: str, seed: int) -> RigResult:
    # The counter is the whole process's: collect what earlier rigs left in reference cycles
    # first, or the cyclic gc freeing an earlier rig's graphs mid-run shows as this rig's drop.
    # Nothing is collected between the two probe measurements, so cycles made by the replays
    # themselves still show as growth.
    gc.collect()
    cuda = device == "cuda"
    spec = RigSpec(kind, "triton" if cuda else "torch_native", mla, BUCKETS, device=device,
                   dtype=torch.bfloat16 if cuda else torch.float32, hidden=H.FULL, seed=seed,
                   n=4, topk=2, steps=2)
    rig = Rig(spec)
    res = RigResult(f"{kind}-{'mla' if mla else 'gqa'}")
    rng = random.Random(seed)
    pool = rig.new_requests(2 * max(BUCKETS), rng)
    tol, exact = (0.0, True) if cuda else (1e-5, False)
    start = time.perf_counter()
    probe = lambda: _one(rig, pool, random.Random(seed + 1), max(BUCKETS) - 1, tol, exact)   # the same batch
    for _ in range(WARMUP):          # every raw_bs, so every bucket
        for raw in range(1, max(BUCKETS) + 1):
            res.mismatches += _one(rig, pool, rng, raw, tol, exact)
    first = probe()                  # the drift probe, and the memory baseline
    res.alloc_base = res.alloc_max = _allocated(device)
    res.replays = 1 + WARMUP * max(BUCKETS)
    while res.replays < replays - 1:
        res.mismatches += _one(rig, pool, rng, rng.randint(1, max(BUCKETS)), tol, exact)
        res.alloc_max = max(res.alloc_max, _allocated(device))
        res.replays += 1
    last = probe()
    res.alloc_end = _allocated(device)
    res.replays += 1
    res.mismatches += [f"drift probe, first: {m}" for m in first] + [f"drift probe, last: {m}" for m in last]
    res.seconds = time.perf_counter() - start
    return res


def soak(replays: int = 10_000, device: str = "cuda", seed: int = 0, kinds=KINDS, models=(False, True),
         log=print) -> list:
    """``replays`` in all, split evenly over every (kind, model); returns one RigResult each."""
    rigs = [(k, m) for k in kinds for m in models]
    per = max(WARMUP * max(BUCKETS) + 2, replays // len(rigs))
    out = []
    for i, (kind, mla) in enumerate(rigs):
        res = soak_rig(kind, mla, per, device, seed + i)
        log(f"{res.name:20s} replays {res.replays:6d}  mismatches {len(res.mismatches):3d}  allocated after warm-up "
            f"{res.alloc_base / 2**20:8.2f} MiB, growth {res.growth} B "
            f"(high-water +{res.alloc_max - res.alloc_base} B) {res.seconds:6.1f} s")
        for m in res.mismatches[:3]:
            log(f"    {m}")
        out.append(res)
    total = sum(r.replays for r in out)
    bad = sum(len(r.mismatches) for r in out)
    log(f"soak: {total} replays on {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), "
        f"{bad} mismatches, max memory growth {max(r.growth for r in out)} B")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replays", type=int, default=10_000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    res = soak(a.replays, a.device, a.seed)
    return 0 if all(not r.mismatches and r.growth == 0 for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
