"""The full-graph runner of the uniform modes: DECODE and TARGET_VERIFY (chain and tree); the
DRAFT_EXTEND runner (``draft.DraftExtendRunner``) builds on it."""
from __future__ import annotations

from typing import Optional

import torch

from attn_backends import CaptureHiddenMode, ForwardBatch, ForwardMode, GraphKey, SpecInfo

from .runner_base import GraphRunnerBase, RunnerOutput, slice_hidden

I32, I64 = torch.int32, torch.int64


class UniformGraphRunner(GraphRunnerBase):
    """One graph per bucket of requests; every request owns W rows."""

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
        w, n, dev = self.width, self.max_bs * self.width, self.device
        # packed so that loading a batch is a few launches: rows of one buffer per dtype
        self._tokens = torch.zeros(3, n, dtype=I64, device=dev)          # ids, positions, slots
        self.input_ids, self.positions, self.out_cache_loc = self._tokens.unbind(0)
        self._reqs = torch.zeros(2, self.max_bs, dtype=I32, device=dev)  # request rows, seq_lens
        self.req_pool_indices, self.seq_lens = self._reqs.unbind(0)
        self.seq_lens.fill_(max(self.fill, w))
        self.seq_lens_cpu = torch.full((self.max_bs,), max(self.fill, w), dtype=I32)
        self.accept_lens = torch.ones(self.max_bs, dtype=I32, device=dev)
        self._tril = torch.tril(torch.ones(w, w, dtype=torch.bool, device=dev))
        self.tree_mask = self._tril.repeat(self.max_bs, 1, 1)
        for b in self.backends:
            b.init_cuda_graph_state(self.max_bs, n)

    def refusal(self, batch: ForwardBatch) -> Optional[str]:
        reason = super().refusal(batch)
        if reason:
            return reason
        if batch.forward_mode != self.mode:
            return f"mode {batch.forward_mode.name} was not captured (captured {self.mode.name})"
        if batch.raw_bs > self.max_bs:
            return f"bs={batch.raw_bs} exceeds the largest captured bucket {self.max_bs}"
        if self.spec is not None and batch.spec_info is not None:
            s = batch.spec_info
            if s.num_draft_tokens != self.spec.num_draft_tokens or (s.topk > 1) != self.tree:
                return (f"spec N={s.num_draft_tokens}, topk={s.topk} differs from the captured "
                        f"N={self.spec.num_draft_tokens}, topk={self.spec.topk}")
        if self.mode == ForwardMode.DECODE and batch.spec_info is not None and batch.spec_info.is_draft_decode:
            return "draft decode runs on the multi-step draft runner"
        return None

    def _static_spec(self, bs: int) -> Optional[SpecInfo]:
        if self.spec is None:
            return None
        s = self.spec
        return SpecInfo(s.num_draft_tokens, s.topk, s.num_steps, accept_lens=self.accept_lens[:bs],
                        tree_mask=self.tree_mask[:bs] if self.tree else None)

    def _static_batch(self, bucket: int):
        n = bucket * self.width
        sb = ForwardBatch(self.mode, bucket, self.req_pool_indices[:bucket], self.seq_lens[:bucket],
                          self.seq_lens_cpu[:bucket], self.out_cache_loc[:n], self.positions[:n],
                          spec_info=self._static_spec(bucket), capture_hidden_mode=self.capture_hidden_mode,
                          input_ids=self.input_ids[:n], raw_bs=bucket)
        return sb.graph_key(), sb

    def _forward(self, static_batch):
        return self.model.forward(static_batch, self.layer_backends)

    def _load(self, batch: ForwardBatch):
        raw, w = batch.raw_bs, self.width
        bs = self.bucket_for(raw)
        key = GraphKey(self.mode, bs, w, self.capture_hidden_mode)
        graph, out, sb = self.graphs[key]
        nr, n = raw * w, bs * w
        pad = max(self.fill, w)
        self._tokens[:, :nr].copy_(torch.stack([batch.input_ids[:nr], batch.positions[:nr],
                                                batch.out_cache_loc[:nr]]))
        self._reqs[:, :raw].copy_(torch.stack([batch.req_pool_indices[:raw].to(I32), batch.seq_lens[:raw].to(I32)]))
        self.seq_lens_cpu[:raw].copy_(batch.seq_lens_cpu[:raw])
        if raw < bs:                          # pad rows: token 0, slot 0, request row 0, seq_len = fill
            self._tokens[:, nr:n].zero_()
            self.req_pool_indices[raw:bs].zero_()
            self.seq_lens[raw:bs].fill_(pad)
            self.seq_lens_cpu[raw:bs].fill_(pad)
        spec = batch.spec_info
        if self.mode == ForwardMode.DRAFT_EXTEND:
            self.accept_lens[:raw].copy_(spec.accept_lens[:raw])
            self.accept_lens[raw:bs].fill_(1)
        if self.tree:
            self.tree_mask[:raw].copy_(spec.tree_mask[:raw])
            self.tree_mask[raw:bs] = self._tril
        sb.raw_bs = raw
        return key, graph, out, sb

    def _slice(self, out, batch: ForwardBatch, static_batch) -> RunnerOutput:
        logits, hidden = out
        n = batch.raw_bs * self.width
        return RunnerOutput(logits[:n].clone(), slice_hidden(hidden, batch.capture_hidden_mode, n, self.width))
