"""Eager steps over a set of backends (one, or one per layer)."""
from __future__ import annotations

from ..batch import ForwardBatch
from .step import Step


def fill_of(backends) -> int:
    """The pad rows' seq_len a step over ``backends`` uses: the largest fill value of them."""
    return max(b.get_cuda_graph_seq_len_fill_value() for b in backends)


def eager_steps_of(backends) -> Step:
    """An eager step over ``backends``, to keep across batches with its library state
    (FlashInfer's eager wrappers, Triton's launch book)."""
    return Step(backends[0].memory, fill_of(backends))


def eager_step(batch: ForwardBatch, backends) -> ForwardBatch:
    """Eager: one step for ``batch`` over ``backends``; returns the batch to hand to them and to
    the model (``batch.step`` set)."""
    return eager_steps_of(backends).build(batch)
