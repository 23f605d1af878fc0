"""What the runner suite draws: the runner kinds a backend declares, and one random case.

The count rule (:func:`plan_cases`): a run of ``cases`` cases from ``seed`` runs
``max(cases, K)`` cases, K being the runner kinds the backend declares (``kinds_for``), with the
case seeds ``seed, seed + 1, ...``. Case seed ``s`` draws the kind ``kinds[s % K]``, so any K
consecutive seeds, hence every run, draw each kind at least once (a small run cannot pass a bug
in a kind it never drew), and a case is fully determined by its seed: its replay
(``--seed s --suite-cases 1``) runs it first. The model kind alternates so that each kind meets
both MHA and MLA within two rounds; everything else of a case (buckets, page size and layout,
hidden mode, widths, the requests) is random from its seed, and so are the attention features
it draws where the backend declares them (``attn_backends.check.features``: the window kinds
cycle with the seed; the rig's model alternates sliding and full layers).
"""
from __future__ import annotations

import random

from attn_backends import CaptureHiddenMode as H
from attn_backends.check.features import draw_features
from attn_backends.check.scenarios import PAGE_ORDERS
from attn_backends.kinds import BATCH_KINDS

from .rig import RUNNER_KINDS, RigSpec


def kinds_for(caps) -> list:
    """The runner kinds whose batch kind the backend serves (draft decode also draws topk > 1)."""
    return [k.name for k in RUNNER_KINDS.values() if BATCH_KINDS[k.batch].served_by(caps)
            and (k.batch != "draft_decode" or caps.topk_gt1)]


def plan_cases(caps, cases: int, seed: int, only=None) -> list:
    """``[(case seed, runner kind, mla)]`` of a run, by the count rule of the module docstring; ``only``:
    those of the declared kinds alone."""
    kinds = [k for k in kinds_for(caps) if only is None or k in only]
    if not kinds:
        raise ValueError(f"runner kinds {only}: none of them declared ({', '.join(kinds_for(caps))})")
    models = [mla for mla, ok in ((False, caps.mha), (True, caps.mla)) if ok]
    k = len(kinds)
    return [(s, kinds[s % k], models[(s % k + s // k) % len(models)]) for s in range(seed, seed + max(cases, k))]


def random_spec(rng: random.Random, kind: str, backend: str, caps, mla: bool, device: str, seed: int) -> RigSpec:
    """One case of runner kind ``kind``, everything else drawn from ``rng``."""
    pool = list(range(1, 9)) if kind != "piecewise" else [4, 8, 12, 16, 24, 32]
    buckets = tuple(sorted(rng.sample(pool, rng.randint(1, 3))))
    if max(buckets) < 2:
        buckets = buckets + (rng.randint(2, 8),)
    s = RigSpec(kind, backend, mla, buckets, page_size=rng.choice(caps.page_sizes),
                page_order=rng.choice(PAGE_ORDERS), hidden=H(rng.randint(0, 2)),
                per_layer=rng.random() < 0.8, device=device, seed=seed)
    if kind in ("verify", "breakable_verify", "draft_extend"):
        s.n = rng.randint(2, 5)
        if kind == "draft_extend":    # topk > 1 (N above num_steps + 1) where the backend declares it
            s.topk, s.steps = rng.choice([(1, s.n - 1)] + ([(2, 1), (2, 2)] if caps.topk_gt1 else []))
            s.n = s.steps + 2 if s.topk > 1 else s.n
    elif kind == "verify_tree":
        s.topk, s.steps = rng.choice([2, 4]), rng.randint(1, 3)
        s.n = rng.randint(s.steps + 1, min(s.steps * s.topk + 1, 6))
    elif kind == "draft_decode":
        s.topk, s.steps = rng.choice([1, 2, 4]), rng.randint(1, 3)
    width = {"decode": 1, "breakable_decode": 1, "draft_decode": s.topk, "piecewise": 8}.get(kind, s.n)
    s.features = draw_features(caps, seed // len(kinds_for(caps)), rng, 4, width, s.page_size, s.max_ctx, s.topk)
    return s
