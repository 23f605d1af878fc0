"""Batch types that every backend consumes.

One meaning of ``seq_lens`` everywhere: the KV tokens request ``i`` attends to *after*
this forward has written its new tokens. In the uniform modes every request owns exactly
``W`` query rows (DECODE 1, TARGET_VERIFY and DRAFT_EXTEND ``N``, draft decode ``topk``)
and ``prefix_lens = seq_lens - W``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from .step import StepView


class ForwardMode(enum.IntEnum):
    EXTEND = 1          # prefill / chunked prefill: ragged query lengths
    DECODE = 2          # one query row per request (or topk rows in draft decode)
    TARGET_VERIFY = 3   # N draft tokens per request, chain (causal) or tree mask
    DRAFT_EXTEND = 4    # uniform width N; rows are selected by accept length afterwards
    IDLE = 5            # no tokens on this rank

    def is_uniform(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)


class CaptureHiddenMode(enum.IntEnum):
    NULL = 0   # no hidden states returned
    LAST = 1   # the last row of each request
    FULL = 2   # every row


@dataclass
class SpecInfo:
    """Speculative-decoding inputs of one forward.

    Attributes
    ----------
    num_draft_tokens : int
        ``N``: the per-request stride in TARGET_VERIFY and DRAFT_EXTEND. The only source
        of that stride (never ``num_steps + 1``: they differ when ``topk > 1``).
    topk : int
        Branches per step. ``topk > 1`` makes TARGET_VERIFY a tree verify and gives draft
        decode ``topk`` rows per request.
    num_steps : int
        Draft steps per round.
    accept_lens : Tensor or None
        ``[bs]`` int32 on the device, DRAFT_EXTEND only: the valid tokens of each request
        (accepted draft tokens plus the bonus token), in ``1..N``. It never changes the
        attention layout; it only selects output rows (``arange(bs)*N + accept_lens - 1``).
    tree_mask : Tensor or None
        ``[bs, N, N]`` bool, TARGET_VERIFY with ``topk > 1``: draft token ``j`` sees draft
        token ``k`` iff ``tree_mask[i, j, k]``. The prefix is always visible.
    draft_step : int
        Draft decode only (DECODE with a SpecInfo): the 1-based step of this forward. Row
        ``j`` of request ``i`` sees the prompt prefix ``seq_lens - topk*draft_step`` plus
        its own branch, whose step-``t`` token sits at position ``prefix + t*topk + j``.
    """

    num_draft_tokens: int
    topk: int = 1
    num_steps: int = 1
    accept_lens: Optional[torch.Tensor] = None
    tree_mask: Optional[torch.Tensor] = None
    draft_step: int = 0

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens} must be >= 1")
        if self.topk < 1:
            raise ValueError(f"topk={self.topk} must be >= 1")
        if self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps} must be >= 1")
        if self.topk == 1 and self.num_draft_tokens > self.num_steps + 1:
            raise ValueError(
                f"num_draft_tokens={self.num_draft_tokens} exceeds num_steps+1="
                f"{self.num_steps + 1}, the chain length possible with topk=1")
        if self.topk > 1 and self.num_draft_tokens > self.num_steps * self.topk + 1:
            raise ValueError(
                f"num_draft_tokens={self.num_draft_tokens} exceeds num_steps*topk+1="
                f"{self.num_steps * self.topk + 1}")

    @property
    def is_draft_decode(self) -> bool:
        return self.draft_step > 0


@dataclass(frozen=True)
class GraphKey:
    """Everything a captured graph is specialised on."""

    forward_mode: ForwardMode
    bs: int
    width: int  # W: query rows per request
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL

    def __post_init__(self) -> None:
        if not self.forward_mode.is_uniform():
            raise ValueError(f"forward_mode={self.forward_mode.name} cannot be graph-captured "
                             "as a uniform batch (DECODE, TARGET_VERIFY, DRAFT_EXTEND only)")
        if self.bs < 1:
            raise ValueError(f"bs={self.bs} must be >= 1")
        if self.width < 1:
            raise ValueError(f"width={self.width} must be >= 1")
        # Keys are looked up on every replay (steps, backends): hash once.
        object.__setattr__(self, "_hash", hash((self.forward_mode, self.bs, self.width, self.capture_hidden_mode)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def num_tokens(self) -> int:
        return self.bs * self.width

    def __str__(self) -> str:
        return f"{self.forward_mode.name} bs={self.bs} W={self.width} hidden={self.capture_hidden_mode.name}"


@dataclass(slots=True)
class GraphInputs:
    """What capture and replay both take, already padded to ``key.bs`` by the runner.

    Attributes
    ----------
    key : GraphKey
    req_pool_indices : Tensor  ``[bs]`` int32, device; pad rows 0.
    seq_lens : Tensor          ``[bs]`` int32, device; pad rows hold the fill value (>= W).
    seq_lens_cpu : Tensor      ``[bs]`` int32, host copy of ``seq_lens`` (no device sync needed).
    spec_info : SpecInfo or None
    raw_bs : int               real requests; rows ``raw_bs..bs-1`` are padding.
    step : StepView or None    the view of the runner's step, already updated for this key: the
                               backend reads the canonical layout from it and derives only its
                               own metadata. None: the backend makes the view from these tensors.
    """

    key: GraphKey
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    spec_info: Optional[SpecInfo] = None
    raw_bs: int = -1
    step: Optional["StepView"] = None

    def __post_init__(self) -> None:
        if self.raw_bs < 0:
            self.raw_bs = self.key.bs


@dataclass
class ForwardBatch:
    """One forward pass of the model, as the backend sees it.

    Attributes
    ----------
    forward_mode : ForwardMode
    batch_size : int              ``bs``: requests given to the backend (padded in graph mode).
    req_pool_indices : Tensor     ``[bs]`` int32, device: rows of the request-to-token table.
    seq_lens : Tensor             ``[bs]`` int32, device: KV tokens after this forward.
    seq_lens_cpu : Tensor         ``[bs]`` int32, host: the same values.
    out_cache_loc : Tensor        ``[num_tokens]`` int64, device: KV slot of each new token.
    positions : Tensor            ``[num_tokens]`` int64, device: position of each new token.
    extend_seq_lens : Tensor      ``[bs]`` int32, device, EXTEND only: new tokens per request.
    extend_seq_lens_cpu : Tensor  ``[bs]`` int32, host, EXTEND only.
    spec_info : SpecInfo or None  TARGET_VERIFY, DRAFT_EXTEND and draft decode.
    capture_hidden_mode : CaptureHiddenMode
    input_ids : Tensor or None    ``[num_tokens]`` int64.
    input_embeds : Tensor or None ``[num_tokens, hidden]``: overrides the embedding lookup.
    raw_bs : int                  real requests (``<= bs``); rows past it are padding.
    step : StepView or None       the view of the step that built this batch's layout once for
                                  every layer and backend (``Step.build`` sets it).
    """

    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: Optional[torch.Tensor] = None
    extend_seq_lens: Optional[torch.Tensor] = None
    extend_seq_lens_cpu: Optional[torch.Tensor] = None
    spec_info: Optional[SpecInfo] = None
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    input_ids: Optional[torch.Tensor] = None
    input_embeds: Optional[torch.Tensor] = None
    raw_bs: int = -1
    step: Optional["StepView"] = None

    def __post_init__(self) -> None:
        if self.raw_bs < 0:
            self.raw_bs = self.batch_size

    @property
    def width(self) -> int:
        """W, the query rows per request of a uniform mode (ValueError for EXTEND)."""
        return query_width(self.forward_mode, self.spec_info)

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.shape[0])

    def graph_key(self) -> GraphKey:
        return GraphKey(self.forward_mode, self.batch_size, self.width, self.capture_hidden_mode)

    def graph_inputs(self) -> GraphInputs:
        return GraphInputs(self.graph_key(), self.req_pool_indices, self.seq_lens,
                           self.seq_lens_cpu, self.spec_info, self.raw_bs)


def query_width(mode: ForwardMode, spec_info: Optional[SpecInfo]) -> int:
    """W for a uniform mode. The stride comes from ``num_draft_tokens`` alone."""
    if mode == ForwardMode.DECODE:
        if spec_info is not None and spec_info.is_draft_decode:
            return spec_info.topk
        return 1
    if mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND):
        if spec_info is None:
            raise ValueError(f"{mode.name} needs a SpecInfo (num_draft_tokens), got None")
        return spec_info.num_draft_tokens
    raise ValueError(f"forward_mode={mode.name} has no uniform query width")
