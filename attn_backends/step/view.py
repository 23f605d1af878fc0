"""What a backend is handed: a frozen view of one step, and where the step's layout prep runs.

A :class:`StepView` is made by the step (:class:`~attn_backends.step.Step`) at every build,
capture and update, and never changes afterwards: backends read its fields and never call back
into the step. Per-step library state (FlashInfer's planned wrappers, Triton launch records)
lives in ``view.cache``, a dict the step owns, under typed keys (:class:`LibraryKey`); a backend
prepares it once per step by comparing ``view.step_id`` with the step id it last prepared in.

Layer groups (sliding-window layers read another KV extent than full-attention layers of the same
step) get their layout from this view: :func:`attn_backends.window_layout.step_window_layout`
derives it from ``layout`` once per step and window and keeps it in ``cache`` (graph keys: buffers
fixed per key), for every backend and layer of that window. A KV dtype (FP8) is the memory's
(``view.memory``) and the config's, which the records a backend makes per key already see.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from ..batch import GraphKey, SpecInfo
from ..layout import Layout


class Prep(enum.Enum):
    """Where a graph step's layout prep (pad rows, then the layout) runs; the runner sets it once."""

    #: Replayed as a graph of its own before the backends' replay update: the update reads the
    #: current layout (the safe default; a caller without a runner always uses it).
    BEFORE_UPDATE = "before the backends' replay update"
    #: Recorded at the start of the step's own graph (one launch per step): only for backends
    #: whose replay update does no work (they read the layout inside the graph alone).
    IN_STEP_GRAPH = "at the start of the step's graph"


class StepView(NamedTuple):
    """One step as every backend of it reads it (a tuple: made per replay at the cost of a few
    attribute stores, and immutable).

    Attributes
    ----------
    key : GraphKey or None
        The graph key of a captured or replayed step; None for an eager step.
    raw_bs : int
        Real requests; rows ``raw_bs..bs-1`` are padding.
    layout : Layout
        The canonical layout (graph steps: views of the step's static buffers).
    seq_lens_cpu : Tensor
        ``[bs]`` int32 host lengths, canonical pad rows included in graph steps (there a view of
        the step's host buffer: valid for the step the view was made for, like the layout).
    extend_seq_lens_cpu : Tensor or None
        ``[bs]`` int32 host query lengths of an eager EXTEND step.
    spec : SpecInfo or None
        The step's speculative template (graph steps: its tensors are the step's own).
    step_id : int
        Different for every build, capture and update of any step in the process.
    fill : int
        The pad rows' seq_len before raising it to W (``layout.pad_seq_len``).
    memory : KVMemory
        The KV memory the step reads.
    cache : dict
        Library state kept as long as the step, under :class:`LibraryKey` keys.
    origin : int
        Identifies the step that made the view, never reused in the process (graph metadata is
        kept per key and origin).
    prep : Prep
        Where the prep of a graph step runs.
    tensors : dict
        Graph steps: every tensor of the step a captured graph reads, by name (I2, poisoning).
    built_from : tuple
        Eager steps: the batch's tensors the layout was built from (``req_pool_indices``,
        ``seq_lens``, ``seq_lens_cpu``, ``extend_seq_lens_cpu``, ``spec_info``): a batch handed
        with this view must hold these very objects (a copy with other rows gets no stale layout).
    """

    key: Optional[GraphKey]
    raw_bs: int
    layout: Layout
    seq_lens_cpu: torch.Tensor
    extend_seq_lens_cpu: Optional[torch.Tensor]
    spec: Optional[SpecInfo]
    step_id: int
    fill: int
    memory: Any
    cache: dict
    origin: int
    prep: Prep
    tensors: dict
    built_from: tuple = ()


@dataclass(frozen=True)
class LibraryKey:
    """A typed key of ``StepView.cache``: whose state (``owner``: a backend class), for which
    model config, graph key (None: eager) and kind (e.g. a FlashInfer wrapper kind)."""

    owner: type
    config: Any
    key: Optional[GraphKey] = None
    kind: str = ""


def prep_placement(backends) -> Prep:
    """The prep placement a runner over ``backends`` uses: in the step's graph when no backend
    does replay work of its own (``replay_work`` False: a ``LayoutBackend`` that overrides neither
    ``_update`` nor its replay method, or says so itself, as ``triton_mla`` where it plans nothing),
    else before the replay update, so an update that reads the layout reads the current step's."""
    return Prep.IN_STEP_GRAPH if all(getattr(b, "replay_work", True) is False for b in backends) \
        else Prep.BEFORE_UPDATE


def built_from(batch) -> tuple:
    """The batch tensors an eager layout is built from (``StepView.built_from``)."""
    return batch.req_pool_indices, batch.seq_lens, batch.seq_lens_cpu, batch.extend_seq_lens_cpu, batch.spec_info
