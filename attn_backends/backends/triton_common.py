"""What the ``triton`` and ``triton_mla`` backends share: device facts, the split-KV count
(a host int that depends on the GraphKey alone) and the split-KV workspace."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch
import triton

from attn_backends_kernels.attention_core import decode_workspace
from attn_backends_kernels.device_facts import cuda_index, sm_count
from attn_backends_kernels.launch_record import Recorded, recording
from attn_backends_kernels.schedule import chunk_workspace, many_waves, slots_per_request

from ..base import ForwardMetadata, LayoutBackend
from ..batch import GraphKey
from ..layout import Layout, stream_capturing
from ..step import LibraryKey, StepView

MAX_KV_SPLITS = 32
# Up to 64 splits where a batch has too few programs to fill the GPU at 32: at most 4 x SMs / 64
# programs per split and at most 4 query rows (wider did not pay: 128 lost to 64 for MLA and
# verify, trees lost above 32; bench/RESULTS.md, 'Split counts').
WIDE_MAX_KV_SPLITS = 64
# A split-pass decode of few programs (the backends' ``_deep``) takes this many splits, never more than
# the pages: at one or two KV heads and bs 1-8, 256 ran 1.04-1.4x faster than the chunks and up to 2x
# faster than 64 splits (an FP8 cache's uniform bs 8: 0.82x of 64); 128 was up to
# 2.2 us faster on uniform batches, 3.2-6.3 us slower on long tails (bench/RESULTS.md, 'Ragged batches').
DEEP_MAX_KV_SPLITS = 256


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)      # TRITON_INTERPRET as Triton reads it


def choose_num_kv_splits(programs: int, device: torch.device, max_pages: int, per_sm: int,
                         width: int = 1, floor: int = 1, floor_per_sm: Optional[int] = None,
                         split_pages: int = 1, exact_below: int = 1, deep: bool = False) -> int:
    """Split-KV count so that ``programs * splits`` is about ``per_sm`` programs per SM, rounded down to a power of
    two, at most 32 (up to 64 for a batch of few programs of at most 4 query rows, see ``WIDE_MAX_KV_SPLITS``)
    and never more than the pages (``deep``: ``DEEP_MAX_KV_SPLITS`` so bounded, a power of two; the per-SM,
    floor, width and exact arguments do not apply). Depends only on host facts fixed by the GraphKey.
    ``per_sm`` is each backend's ``_split_rule`` (bench/RESULTS.md, 'Split counts'). ``floor``: the fewest
    splits, lowered (to 1 at least) to keep at most ``floor_per_sm`` programs an SM where that is given.
    ``split_pages``: the fewest pages a split spans, where the splits that leaves still give a quarter of the
    SMs a program (the backends' ``_split_pages``). ``exact_below``: a count below it is taken as it is, not
    rounded down to a power of two (GQA decode: 6 splits at bs 16, not 4)."""
    if device.type != "cuda":
        return 2  # the interpreter: exercise the merge pass at small cost
    if deep:
        return 1 << (max(1, min(DEEP_MAX_KV_SPLITS, max_pages)).bit_length() - 1)
    sms = sm_count(cuda_index(device))
    programs = max(programs, 1)
    if floor_per_sm is not None:
        floor = max(1, min(floor, floor_per_sm * sms // programs))
    cap = MAX_KV_SPLITS
    while width <= 4 and 2 * cap <= WIDE_MAX_KV_SPLITS and programs * 2 * cap <= 4 * sms:
        cap *= 2
    want = max(per_sm * sms // programs, floor)
    most = max_pages
    if split_pages > 1 and programs * (max_pages // split_pages) >= sms // 4:
        most = max_pages // split_pages
    count = max(1, min(want, cap, most))
    return count if count < exact_below else 1 << (count.bit_length() - 1)


@dataclass(eq=False)
class TritonMetadata(ForwardMetadata):
    """The split count, wave fit and whether the count is a budget of several waves (``_split_plan``), and split
    workspace of a key (or an eager step),
    and the launches recorded by graph metadata called outside a capture ((softmax scale, k_scale,
    v_scale[, window, softcap, has sinks]) -> :class:`Recorded`)."""

    num_kv_splits: int = 1
    wave_fit: bool = False
    many_waves: bool = False
    workspace: Optional[tuple] = None
    book: dict = field(default_factory=dict)
    # a step's planned chunk size (``triton_mla``): the plan's state shared by the step's instances, whether it planned
    plan: Optional[dict] = None
    planned: bool = False


class TritonBackendBase(LayoutBackend):
    """Split counts and workspaces: eager and graph paths pick them from (bs, W) alone, so
    replay and eager launch identical kernels on the same padded batch (bitwise equal).

    The eager path validates once per step: the first call of a step (per softmax scale) runs
    the kernel wrapper, with its checks, under :func:`recording`; every later call of the step
    replays the recorded launches with its own q, KV buffers and output
    (:class:`~attn_backends_kernels.launch_record.Recorded`), or runs the wrapper again where
    the tensors differ in a fact the compiled kernels are specialized on. Graph metadata records
    once per key when called outside a capture (the breakable runner's attention) and launches
    directly inside one."""

    # Whether the kernels may merge split partials themselves (``merge_if_last``), which needs the
    # workspace's tile counters; kernels that never do get a (part, lse) workspace.
    fuses_merge: ClassVar[bool] = True
    # The fewest KV tokens a verify or extend split spans where enough programs remain (``_split_pages``).
    SPLIT_TOKENS: ClassVar[int] = 1
    # How a launch that ``_chunked`` names spreads the KV (``kernels/schedule.py``): "chunks" or "invariant".
    schedule: str = "split"
    # How a request's chunks are merged (``kernels/schedule.py``): "last" or "pass".
    chunk_merge: str = "last"
    # Chunked launches take the split rule's count as it is, not rounded down to a power of two (the
    # chunk schedule cuts any count; at bs 13 the rounding left MLA-128 104 of 132 SMs): 1.07-1.19x
    # on GQA 28/4 bs 13 (bench/RESULTS.md, 'Ragged batches'; the sweep's ``*_pow2`` rows: the rule before).
    EXACT_CHUNK_SPLITS: ClassVar[bool] = True

    def __init__(self, config, memory) -> None:
        super().__init__(config, memory)
        self._split_cache: dict = {}

    @classmethod
    def extra_unavailable_reason(cls, device: str) -> Optional[str]:
        if device == "cpu" and not interpreting():
            return "Triton kernels need CUDA, or TRITON_INTERPRET=1 to run on the CPU (slow)"
        return None

    def _programs(self, bs: int, width: int) -> int:
        raise NotImplementedError

    def _split_rule(self, width: int, lay: Optional[Layout] = None) -> tuple:
        """``(per_sm, floor, floor_per_sm)`` of :func:`choose_num_kv_splits` for batches of
        ``width`` query rows a request: programs an SM wanted, the fewest splits (the pages
        permitting), and the programs an SM up to which that floor holds (None: always). ``lay``:
        the batch's layout, for a rule that depends on its mode or mask (None: uniform causal
        rows)."""
        raise NotImplementedError

    def _split_pages(self, width: int) -> int:
        """The fewest pages a split of a batch of ``width`` rows a request spans where enough
        programs remain (``split_pages`` of :func:`choose_num_kv_splits`): ``SPLIT_TOKENS``'
        worth for batches of several rows a request (verify, draft extend, draft decode with
        topk > 1, extend), a page for one row a request (decode)."""
        return 1 if width <= 1 else max(1, -(-self.SPLIT_TOKENS // self.memory.page_size))

    def _out_dim(self) -> int:
        return self.config.out_dim

    def _exact_splits_below(self, width: int) -> int:
        """``exact_below`` of :func:`choose_num_kv_splits` for batches of ``width`` rows a request
        (1: every count a power of two)."""
        return 1

    def _kernel_schedule(self) -> str:
        """The schedule a chunked launch hands its kernel wrapper (``kernels/schedule.py``'s names)."""
        return self.schedule

    def _part_dtype(self, width: int) -> torch.dtype:
        """The dtype of the split partials in a graph's workspace for batches of ``width`` query
        rows a request (the kernel wrapper's own choice where it allocates one)."""
        return torch.float32

    def _splits(self, lay: Layout) -> int:
        return self._split_plan(lay)[0]

    def _waves_allowed(self, lay: Layout) -> bool:
        """Whether a chunked launch of one chunk a request that leaves SMs idle may take a budget of several
        waves (``schedule.many_waves``): where it was measured (``triton_mla``'s decode on the Gluon chunk pass)."""
        return False

    def _split_plan(self, lay: Layout) -> tuple:
        """``(count, fit, many)`` of the split rule for ``lay``, computed once a key: ``fit``, whether a chunked launch
        asks for the wave fit (``chunk_kernels._balanced_per``): its budget of one-an-SM programs fills at least 7/8 of
        the SMs, so chunks past it would run past one wave (a fit to a budget that leaves SMs idle lost 0.75-0.81x:
        bench/RESULTS.md, 'Ragged batches'), or is a budget of several waves, whose last wave the fit keeps; ``many``,
        whether the count is ``schedule.many_waves``' budget of several waves."""
        width = lay.width or max(1, lay.max_seq_len_q)
        # the GraphKey's facts, and the instance's schedule and count rule (a caller may set them after construction)
        key = (lay.bs, width, lay.mode, lay.mask, self.schedule, self.EXACT_CHUNK_SPLITS)
        cache = self._split_cache
        if key not in cache:
            max_pages = -(-self.memory.max_context_len // self.memory.page_size)
            per_sm, floor, floor_per_sm = self._split_rule(width, lay)
            programs, device = self._programs(lay.bs, width), self.memory.device
            exact = self._exact_splits_below(width)
            chunked_exact = self.EXACT_CHUNK_SPLITS and self._chunked(lay)
            if chunked_exact:
                exact = WIDE_MAX_KV_SPLITS + 1
            count = choose_num_kv_splits(programs, device, max_pages, per_sm, width, floor, floor_per_sm,
                                         self._split_pages(width), exact, self._deep(lay))
            sms = sm_count(cuda_index(device)) if device.type == "cuda" else 0
            one_an_sm = chunked_exact and per_sm == 1 and sms > 0
            fit = one_an_sm and count == sms // programs and 8 * count * programs >= 7 * sms
            # a chunk a request because the programs fill more than half the SMs (not a context of one page)
            waves = (many_waves(programs, sms) if one_an_sm and count == 1 and 2 * programs > sms
                     and self._waves_allowed(lay) else 1)
            cache[key] = (waves, True, True) if waves > 1 else (count, fit, False)
        return cache[key]

    def _deep(self, lay: Layout) -> bool:
        """Whether ``lay``'s launch is a split-pass decode of few programs (``DEEP_MAX_KV_SPLITS``)."""
        return False

    def _chunked(self, lay: Layout) -> bool:
        """Whether the launch of ``lay`` balances the batch's KV over chunks on the device
        (``kernels/schedule.py``: its workspace is a chunk workspace, needed at one split too)."""
        return False

    def _kv_buffers(self, layer) -> tuple:
        """The layer's KV buffers, as the kernel wrapper takes them."""
        raise NotImplementedError

    def _launch(self, q: torch.Tensor, kv: tuple, out: torch.Tensor, layer, meta: ForwardMetadata) -> None:
        """The kernel wrapper's call: attention of ``q`` over ``kv`` into ``out``."""
        raise NotImplementedError

    def _run(self, q: torch.Tensor, layer, meta: TritonMetadata) -> torch.Tensor:
        kv = self._kv_buffers(layer)
        shape = q.shape                 # torch.empty with dtype and device: cheaper than new_empty on the host
        out = torch.empty(shape[0], shape[1], self._out_dim(), dtype=q.dtype, device=q.device)
        if meta.key is not None and stream_capturing():   # captured: the graph replays the launch
            self._launch(q, kv, out, layer, meta)
            return out
        sinks = () if layer.sinks is None else (layer.sinks,)      # a layer's weight, passed like its KV
        inputs = (q, *kv, *sinks, out)
        book = meta.book
        scales = (layer.scaling, layer.k_scale, layer.v_scale)     # the launches' host values
        if layer.features:          # a plain layer's key stays three floats (the eager path's every call)
            scales += (layer.window, layer.softcap, bool(sinks))
        rec = book.get(scales)
        if rec is not None and rec.replay(inputs):
            return out
        if rec is not None and not rec.usable:    # the interpreter, or a wrapper that views q
            self._launch(q, kv, out, layer, meta)
            return out
        with recording() as launches:
            self._launch(q, kv, out, layer, meta)
        # the KV buffers are the pool's (their facts checked once each), out is this call's own;
        # kept once a call succeeded: a failed call changes nothing
        book[scales] = Recorded(launches, inputs, kept=tuple(range(1, 1 + len(kv) + len(sinks))),
                                derived=(len(inputs) - 1,))
        return out

    def _step_book(self, view: StepView) -> dict:
        """The recorded launches (the layer's host values -> :class:`Recorded`) of an
        eager step: in the step's cache, shared by every instance of this class over the same config and KV memory
        (they read the step's one layout: with a backend instance per layer the step still
        records once), new with each step id (a new layout). Graph metadata called outside a
        capture (the breakable runner's attention between its graph segments) keeps its own in
        the key's record, whose every tensor but q, KV and out is static and whose host values
        come from the key, so one recording serves every later replay."""
        # the schedule, merge and count rule too: instances that differ in them launch other kernels on one step
        owner = LibraryKey(type(self), (self.config, id(self.memory), self.schedule, self.chunk_merge,
                                        self.EXACT_CHUNK_SPLITS), None, "recorded launches")
        held = view.cache.get(owner)
        if held is None or held[0] != view.step_id:
            held = view.cache[owner] = (view.step_id, {})
        return held[1]

    def _metadata(self, view: StepView, key: Optional[GraphKey]) -> TritonMetadata:
        # I4: the split count is a function of the key alone (a host int), fixed with the record
        splits, chunked = self._splits(view.layout), self._chunked(view.layout)
        ws = None
        if chunked and key is not None:     # _chunked before any chunk workspace: it refuses a bad schedule
            ws = self._chunk_workspace(view.layout, key.bs, key.width, splits)
        elif key is not None and splits > 1:
            ws = decode_workspace(key.bs * key.width, self.config.num_q_heads, self._out_dim(), splits,
                                  self.memory.device, num_counters=None if self.fuses_merge else 0,
                                  part_dtype=self._part_dtype(key.width))
        # the fit and the waves are a chunked launch's alone: other launches skip their lookup
        fit, many = self._split_plan(view.layout)[1:] if chunked else (False, False)
        return TritonMetadata(view, key, num_kv_splits=splits, wave_fit=fit, many_waves=many, workspace=ws,
                              book={} if key is not None else self._step_book(view))

    def _chunk_workspace(self, lay: Layout, bs: int, width: int, splits: int) -> tuple:
        """A chunk launch's workspace for ``bs`` requests of ``width`` rows, as long as ``lay``'s page table allows."""
        tokens = lay.page_table.shape[1] * self.memory.page_size      # the longest request the layout holds
        return chunk_workspace(bs, slots_per_request(self._kernel_schedule(), splits, tokens), width,
                               self.config.num_q_heads, self.config.num_kv_heads, self._out_dim(), self.memory.device,
                               self._part_dtype(width))

    def _extra_graph_buffers(self) -> dict:
        """The split workspaces' partials. Not their counters (the fused merge's, see
        ``merge_if_last``): they hold no batch's data, only zeros between launches, which every
        launch leaves as it found them; what the suite writes into graph buffers would stand for a
        corrupted kernel state, not for stale data."""
        out = {}
        for i, ((key, _), meta) in enumerate(self._graph_meta.items()):
            if meta.workspace is not None:
                tag = f"{key.forward_mode.name}_{key.bs}x{key.width}#{i}"
                out[f"workspace_part_{tag}"], out[f"workspace_lse_{tag}"] = meta.workspace[:2]
        return out
