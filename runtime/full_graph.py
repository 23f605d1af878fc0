"""The full-graph runner of the uniform modes: DECODE and TARGET_VERIFY (chain and tree); the
DRAFT_EXTEND runner (``draft.DraftExtendRunner``) builds on it."""
from __future__ import annotations

from typing import Optional

import torch

from attn_backends import CaptureHiddenMode, ForwardBatch, ForwardMode, GraphInputs, GraphKey, SpecInfo
from attn_backends.layout import mask_kind
from attn_backends.step import Step

from .runner_base import INT_DTYPES, GraphRunnerBase, RunnerOutput, slice_hidden, tensor_refusal

I32, I64 = torch.int32, torch.int64


# What ``_load`` copies: (field of the batch, one row per token (else per request), on the host)
_COPIED = (("req_pool_indices", False, False), ("seq_lens", False, False), ("seq_lens_cpu", False, True),
           ("input_ids", True, False), ("positions", True, False), ("out_cache_loc", True, False))


class UniformGraphRunner(GraphRunnerBase):
    """One graph per bucket of requests; every request owns W rows. The step owns the static
    inputs (``input_ids``, ``positions``, ``out_cache_loc``, ``req_pool_indices``, ``seq_lens``,
    ``tree_mask``, ``accept_lens`` are views of its buffers) and their padding."""

    modes = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)

    def __init__(self, model, backends, memory, mode: ForwardMode, buckets, spec: Optional[SpecInfo] = None,
                 capture_hidden_mode=CaptureHiddenMode.NULL) -> None:
        super().__init__(model, backends, memory, buckets, capture_hidden_mode)
        if mode not in self.modes:
            raise ValueError(f"{type(self).__name__} runs {[m.name for m in self.modes]}, not {mode.name}")
        if mode != ForwardMode.DECODE and spec is None:
            raise ValueError(f"{mode.name} needs a SpecInfo template (num_draft_tokens, topk)")
        self.mode, self.spec = mode, spec
        self.width = 1 if mode == ForwardMode.DECODE else spec.num_draft_tokens
        self.tree = spec is not None and spec.topk > 1 and mode == ForwardMode.TARGET_VERIFY
        w = self.width
        self.step = p = Step(memory, self.fill, max_bs=self.max_bs, max_width=w, tokens=True, prep=self.prep)
        self.input_ids, self.positions, self.out_cache_loc = p.input_ids, p.positions, p.out_cache_loc
        self.req_pool_indices, self.seq_lens, self.seq_lens_cpu = p.req_pool_indices, p.seq_lens, p.seq_lens_cpu
        self.accept_lens, self.tree_mask = p.accept_lens, p.tree_mask(self.max_bs, w)
        self._rows = {}                 # key -> the step's (req_pool_indices, seq_lens, seq_lens_cpu) of its bucket
        self._by_raw = {}               # raw_bs -> (key, static batch) of its bucket, once captured
        for b in self.backends:
            b.init_cuda_graph_state(self.max_bs, self.max_bs * w)

    def refusal(self, batch: ForwardBatch) -> Optional[str]:
        reason = super().refusal(batch)
        if reason:
            return reason
        if batch.forward_mode != self.mode:
            return f"mode {batch.forward_mode.name} was not captured (captured {self.mode.name})"
        if not 1 <= batch.raw_bs <= self.max_bs:
            return f"bs={batch.raw_bs} outside 1..{self.max_bs}, the largest captured bucket"
        if self.spec is not None and batch.spec_info is not None:
            s = batch.spec_info
            if s.num_draft_tokens != self.spec.num_draft_tokens or \
                    mask_kind(self.mode, s) != mask_kind(self.mode, self.spec):   # chain vs tree verify
                return (f"spec N={s.num_draft_tokens}, topk={s.topk} differs from the captured "
                        f"N={self.spec.num_draft_tokens}, topk={self.spec.topk}")
        if self.mode == ForwardMode.DECODE and batch.spec_info is not None and batch.spec_info.is_draft_decode:
            return "draft decode runs on the multi-step draft runner"
        return self._input_refusal(batch)

    def _input_refusal(self, batch: ForwardBatch) -> Optional[str]:
        """Shapes, dtypes and devices of what ``_load`` copies: a bad tensor is refused before any
        static row is written (a float row index would be copied, converted, without a word)."""
        raw, n, dev = batch.raw_bs, batch.raw_bs * self.width, self.device.type
        cuda = dev == "cuda"
        for name, per_token, host in _COPIED:
            t, rows = getattr(batch, name), n if per_token else raw
            if t is None or t.dtype not in INT_DTYPES or not (t.is_cpu if host or not cuda else t.is_cuda) \
                    or not t.ndim or t.shape[0] < rows:      # the replay's fast path; the message on a miss
                reason = tensor_refusal(name, t, rows, "cpu" if host else dev)
                if reason:
                    return reason
        spec, w = batch.spec_info, self.width
        if self.tree:
            tm = None if spec is None else spec.tree_mask
            if tm is None or tm.dim() != 3 or tuple(tm.shape[1:]) != (w, w) or tm.shape[0] < raw:
                return f"tree_mask has shape {None if tm is None else tuple(tm.shape)}, expected [{raw}, {w}, {w}]"
        if self.mode == ForwardMode.DRAFT_EXTEND and spec is not None and spec.accept_lens is not None:
            return tensor_refusal("accept_lens", spec.accept_lens, raw, dev)
        return None

    def _static_batch(self, bucket: int):
        key = GraphKey(self.mode, bucket, self.width, self.capture_hidden_mode)
        p, n = self.step, bucket * self.width
        self._rows[key] = rows = (p.req_pool_indices[:bucket], p.seq_lens[:bucket], p.seq_lens_cpu[:bucket])
        sb = ForwardBatch(self.mode, bucket, *rows, self.out_cache_loc[:n], self.positions[:n],
                          spec_info=p.spec_view(key, self.spec), capture_hidden_mode=self.capture_hidden_mode,
                          input_ids=self.input_ids[:n], raw_bs=bucket)
        return key, sb

    def _capture_metadata(self, key, static_batch) -> None:
        view = self.step.capture(key, static_batch.spec_info, static_batch.raw_bs)
        for raw in range(1, key.bs + 1):
            if raw not in self._by_raw or self._by_raw[raw][0].bs > key.bs:
                self._by_raw[raw] = (key, static_batch)
        gi = GraphInputs(key, *self._rows[key], view.spec, view.raw_bs, view)
        for b in self.backends:
            b.init_forward_metadata_capture_cuda_graph(gi)

    def _prepare_replay(self, key, raw_bs: int) -> None:
        view = self.step.update(key, raw_bs)
        req, seq, seq_cpu = self._rows[key]              # positional: the replay's hot path
        gi = GraphInputs(key, req, seq, seq_cpu, view.spec, raw_bs, view)
        for b in self.backends:                  # I12: every backend instance, once
            b.init_forward_metadata_replay_cuda_graph(gi)

    def _steps(self) -> list:
        return [self.step]

    def _forward(self, static_batch):
        return self.model.forward(static_batch, self.layer_backends)

    def _load(self, batch: ForwardBatch):
        raw = batch.raw_bs
        key, sb = self._by_raw[raw]
        spec = batch.spec_info
        self.step.load_rows(key, raw, batch.req_pool_indices, batch.seq_lens, batch.seq_lens_cpu,
                            tokens=[batch.input_ids, batch.positions, batch.out_cache_loc],
                            accept_lens=spec.accept_lens if self.mode == ForwardMode.DRAFT_EXTEND else None,
                            tree_mask=spec.tree_mask if self.tree else None)
        return key, sb, raw

    def _slice(self, out, batch: ForwardBatch, static_batch) -> RunnerOutput:
        logits, hidden = out
        n = batch.raw_bs * self.width
        return RunnerOutput(logits[:n].clone(), slice_hidden(hidden, batch.capture_hidden_mode, n, self.width))
