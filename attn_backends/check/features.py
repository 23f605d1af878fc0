"""The attention features the suites draw (sliding windows, sinks, softcap: ``config.FEATURES``),
for the backends whose :class:`~attn_backends.capabilities.Capabilities` declare them, and the
window's poison invariant (I17).

A case's draw is fixed by its seed: the window kind cycles with the seed over
:data:`WINDOW_KINDS` (so any run of as many cases per mode draws every kind: 1, smaller than the
query width W, not a multiple of the page size, larger than the sequence, none), the cap
(0.5-2, small enough to bind on scores of a few units) and the sinks (one head at +-12, the
others within +-12) each on two seeds of four (cap: even seeds, sinks: seeds 2, 3 mod 4), so that
any four consecutive seeds meet every combination of the two and twenty every combination with a
window kind. A feature the backend does not declare is never drawn.

I17: the KV pages wholly before each request's window start (the first position any of its rows
can see) may hold NaN, and the outputs stay bitwise unchanged: a kernel that reads them (or
multiplies their values by a zero probability) shows NaN. Pages, as a pool frees them (a page
still partly in the window keeps the request's own tokens); on pages of 1, every token before the
window. A sliding layer's layout starts at that page (:mod:`attn_backends.window_layout`); the
Triton kernels start at the token (their kernel tests poison every token before the window).
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Optional

import torch

from ..batch import ForwardMode
from ..config import FP8_KV
from .numbers import batch_spans, mismatch

WINDOW_KINDS = ("w=1", "w<W", "w%page", "w>seq", None)
CAPS = (0.5, 1.0, 2.0)
SINK_PEAK = 12.0
NAN_FP8 = 0x7F          # the NaN byte of both float8_e4m3fn and float8_e5m2


@dataclass(frozen=True)
class Features:
    """What one case's layers use: ``window`` (``window_kind`` its kind of :data:`WINDOW_KINDS`),
    ``softcap``, ``sinks`` (one logit per query head); None: not used."""

    window: Optional[int] = None
    window_kind: Optional[str] = None
    softcap: Optional[float] = None
    sinks: Optional[tuple] = None

    def labels(self) -> list:
        """The feature cases this case counts in (``SuiteReport.feature_cases``)."""
        out = [f"window {self.window_kind}"] if self.window is not None else []
        return out + (["softcap"] if self.softcap is not None else []) + (["sinks"] if self.sinks else [])

    def config_kwargs(self) -> dict:
        """``ModelConfig`` fields of a model whose every layer uses them (Mistral's layer types)."""
        return dict(sliding_window=self.window, logit_softcap=self.softcap, sinks=self.sinks is not None)

    def sinks_tensor(self, device="cpu") -> Optional[torch.Tensor]:
        """The sink logits as a model holds them: a weight on the model's device (a kernel reads it
        where it runs; the Triton wrappers refuse one elsewhere)."""
        return None if self.sinks is None else torch.tensor(self.sinks, dtype=torch.float32, device=device)

    def describe(self) -> str:
        parts = ([f"window={self.window} ({self.window_kind})"] if self.window is not None else []) + \
            ([f"softcap={self.softcap}"] if self.softcap is not None else []) + \
            ([f"sinks={list(self.sinks)}"] if self.sinks else [])
        return " ".join(parts)


def window_of(kind: str, rng: random.Random, width: int, page_size: int, max_ctx: int) -> int:
    """A window of ``kind`` for rows ``width`` wide, pages of ``page_size``, sequences up to ``max_ctx``."""
    if kind == "w=1":
        return 1
    if kind == "w<W":                                   # W = 1 (decode): 1 is the only window below 2
        return rng.randint(1, max(1, width - 1))
    if kind == "w%page":                                # k pages and a part of one (any size on pages of 1)
        return rng.randint(0, 2) * page_size + rng.randint(1, max(1, page_size - 1)) + (page_size == 1)
    return max_ctx + rng.randint(1, 64)                 # w>seq


def draw_features(caps, seed: int, rng: random.Random, heads: int, width: int, page_size: int,
                  max_ctx: int, topk: int = 1) -> Features:
    """The features of the case of seed ``seed``: only those ``caps`` declares, and of those only
    what it serves at ``topk`` (``topk_gt1_features``) and together (``apart``: the pair's second
    dropped), as ``refusal`` would say (module docstring)."""
    served = set(caps.features())
    if topk > 1 and caps.topk_gt1_features is not None:
        served &= set(caps.topk_gt1_features)
    kind = WINDOW_KINDS[seed % len(WINDOW_KINDS)] if "windows" in served else None
    window = None if kind is None else window_of(kind, rng, width, page_size, max_ctx)
    cap = rng.choice(CAPS) if "softcap" in served and seed % 2 == 0 else None
    sinks = None
    if "sinks" in served and (seed // 2) % 2 == 1:
        vals = [rng.uniform(-SINK_PEAK, SINK_PEAK) for _ in range(heads)]
        vals[rng.randrange(heads)] = rng.choice((-SINK_PEAK, SINK_PEAK))
        sinks = tuple(vals)
    used = {"windows": window is not None, "softcap": cap is not None, "sinks": sinks is not None}
    for a, b in caps.apart:
        if used[a] and used[b]:
            used[b] = False
            window, kind = (None, None) if b == "windows" else (window, kind)
            cap = None if b == "softcap" else cap
            sinks = None if b == "sinks" else sinks
    return Features(window, kind, cap, sinks)


def window_starts(batch) -> list:
    """``[(request row, base, first row position)]`` of each real request, as the batch defines
    them: its KV entries ``0..base-1`` are its prefix (entry index == position), and no row of it
    sits before ``first row position``."""
    spec, mode = batch.spec_info, batch.forward_mode
    seqs = batch.seq_lens_cpu.tolist()
    out = []
    for i, (_, rows) in enumerate(batch_spans(batch)):
        if mode == ForwardMode.DECODE and spec is not None and spec.is_draft_decode:
            base = seqs[i] - spec.topk * spec.draft_step        # the prefix before the branches
            first_row = base + spec.draft_step - 1              # every branch row sits at its step
        else:
            base = first_row = seqs[i] - rows                   # the first row (a tree's root: depth 0)
        out.append((int(batch.req_pool_indices[i]), base, first_row))
    return out


@contextlib.contextmanager
def poisoned(pools: list, slots: torch.Tensor):
    """NaN in ``slots`` of every KV pool tensor of ``pools`` inside the block, restored after."""
    raw = [p.view(torch.uint8) if p.dtype in FP8_KV else p for p in pools]   # FP8: its bytes
    saved = [p[slots].clone() for p in raw]
    try:
        for p in raw:
            p[slots] = NAN_FP8 if p.dtype == torch.uint8 else float("nan")
        yield
    finally:
        for p, s in zip(raw, saved):
            p[slots] = s


def layer_pools(mem, layers) -> list:
    """The KV pool tensors of ``layers`` (MLA: the latent rows; GQA: K and V)."""
    pool = mem.pool
    return [t for i in layers for t in ([pool.kv[i]] if mem.is_mla else [pool.k[i], pool.v[i]])]


def slots_before_window(mem, row: int, lo: int) -> torch.Tensor:
    """The KV slots I17 poisons in request row ``row`` whose first visible position is ``lo``: its
    whole pages before ``lo`` (what a pool frees; on pages of 1 every token)."""
    return mem.req_to_token[row, :max(0, lo) // mem.page_size * mem.page_size].long()


def window_poison(backend, layer, batch, mem, q: torch.Tensor) -> list:
    """I17 messages: ``backend``'s output on ``batch`` (its metadata current) with NaN in the KV of
    ``layer`` before every request's window start, against its output without; the pool restored."""
    if layer.window is None:
        return []
    slots = torch.cat([slots_before_window(mem, row, min(base, first_row - layer.window + 1))
                       for row, base, first_row in window_starts(batch)])
    if not slots.numel():
        return []
    clean = backend.forward(q, None, None, layer, batch, save_kv_cache=False).clone()
    with poisoned(layer_pools(mem, [layer.layer_id]), slots):
        dirty = backend.forward(q, None, None, layer, batch, save_kv_cache=False)
    spans = batch_spans(batch)
    real = sum(c for _, c in spans)
    msg = mismatch(dirty[:real], clean[:real], 0, spans)
    return [f"NaN in {slots.numel()} KV slots before the windows (w={layer.window}) changed the output: {msg}"] \
        if msg else []
