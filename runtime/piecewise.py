"""Piecewise runner for EXTEND: the pieces between attention calls are graphs captured per
token-count bucket; attention runs eagerly with eager metadata of the real (ragged) batch.

Input embeddings pass through: the embedding lookup (or the given embeddings) fills a static
buffer that the first piece reads, and the runner returns them with the hidden states, cut
to the raw token count."""
from __future__ import annotations

from typing import Optional

import torch

from attn_backends import CaptureHiddenMode, ForwardBatch, ForwardMode
from attn_backends.step import Step

from .graphs import make_graph
from .runner_base import GraphRunnerBase, RunnerOutput, slice_hidden


class PiecewiseRunner(GraphRunnerBase):
    accepts_input_embeds = True

    def __init__(self, model, backends, memory, token_buckets, capture_hidden_mode=CaptureHiddenMode.NULL) -> None:
        super().__init__(model, backends, memory, token_buckets, capture_hidden_mode)
        self.step = Step(memory, self.fill)   # eager: EXTEND is ragged
        c, n, dev = model.config, self.max_bs, self.device
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.embeds = torch.zeros(n, c.hidden_size, dtype=c.dtype, device=dev)
        out_dim = c.kv_lora_rank if c.is_mla else c.head_dim
        self.attn_out = [torch.zeros(n, c.num_q_heads, out_dim, dtype=c.dtype, device=dev)
                         for _ in range(c.num_layers)]

    def refusal(self, batch: ForwardBatch) -> Optional[str]:
        reason = super().refusal(batch)
        if reason:
            return reason
        if batch.forward_mode != ForwardMode.EXTEND:
            return f"mode {batch.forward_mode.name}: the piecewise runner runs EXTEND only"
        if batch.num_tokens > self.max_bs:
            return f"{batch.num_tokens} tokens exceed the largest captured token bucket {self.max_bs}"
        return None

    def capture(self) -> None:
        m = self.model
        for t in reversed(self.buckets):
            pieces = []
            for i in range(len(m.layers) + 1):
                fn = self._piece(i, t, [out[0] for _, out in pieces])  # the static residual states so far
                g = make_graph(self.device, self.pool)
                pieces.append((g, g.capture(fn)))
            self.graphs[t] = pieces

    def _piece(self, i: int, t: int, states: list):
        m, pos = self.model, self.positions[:t]
        layers, prev_h = m.layers, states[-1] if states else None

        def first():
            h = self.embeds[:t]
            return (h, *layers[0].pre_attn(h, pos))

        def middle():
            h = layers[i - 1].post_attn(prev_h, self.attn_out[i - 1][:t])
            return (h, *layers[i].pre_attn(h, pos))

        def last():   # the hidden states the model defines (EAGLE-3: aux layers' streams)
            top = layers[i - 1].post_attn(prev_h, self.attn_out[i - 1][:t])
            h = m.norm(top)
            return (m.output_hidden(h, states + [top]), m.lm_head(h).float())

        return first if i == 0 else last if i == len(layers) else middle

    def _run(self, batch: ForwardBatch) -> RunnerOutput:
        raw = batch.num_tokens
        t = self.bucket_for(raw)
        self.positions[:raw].copy_(batch.positions)
        self.positions[raw:t].zero_()
        src = batch.input_embeds if batch.input_embeds is not None else self.model.embed(batch.input_ids)
        self.embeds[:raw].copy_(src)
        self.embeds[raw:t].zero_()
        batch = self.step.build(batch)           # the layout of every layer, once
        for b in self.backends:
            b.init_forward_metadata(batch)
        pieces = self.graphs[t]
        for i, (g, out) in enumerate(pieces):
            g.replay()
            if i < len(self.model.layers):
                _, q, k, v = out
                layer = self.model.layers[i].layer
                o = self.layer_backends[i].forward(q[:raw], k[:raw], None if v is None else v[:raw], layer, batch)
                self.attn_out[i][:raw].copy_(o)
                self.attn_out[i][raw:t].zero_()
        self.replay_count += 1
        h, logits = pieces[-1][1]
        hidden = slice_hidden(h, batch.capture_hidden_mode, raw, 0, batch.extend_seq_lens_cpu[:batch.raw_bs])
        embeds = None if batch.input_embeds is None else self.embeds[:raw].clone()
        return RunnerOutput(logits[:raw].clone(), hidden, embeds)
