"""The draft model's runners: DRAFT_EXTEND at uniform width N (rows selected by accept length
afterwards) and multi-step draft decode.

Multi-step draft decode: ``num_steps`` forwards of ``topk`` branch rows per request in one
graph, each step with its own backend (its own metadata), greedy within each branch.

Request ``i`` with prompt prefix ``P_i`` writes the step-``t`` token of branch ``j`` at
position ``P_i + t*topk + j`` (step-major), so step ``s`` sees ``seq_lens = P_i + s*topk``
and each forward appends ``topk`` contiguous positions, as every uniform mode does.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from attn_backends import CaptureHiddenMode, ForwardBatch, ForwardMode, GraphInputs, GraphKey, SpecInfo, select_rows
from attn_backends.layout import pad_seq_len
from attn_backends.step import Step, StepGroup, fill_of, prep_placement

from .full_graph import UniformGraphRunner
from .runner_base import GraphRunnerBase, RunnerOutput, slice_hidden, tensor_refusal

I32, I64 = torch.int32, torch.int64
# Draft forwards a multi-step runner chains: a step loads each draft step's number from device
# constants 0..max_bs+64 (step.buffers.RowCopies), so 64 holds whatever the buckets.
MAX_DRAFT_STEPS = 64


@dataclass
class DraftInput:
    req_pool_indices: torch.Tensor   # [raw_bs] int32, device
    prefix_lens: torch.Tensor        # [raw_bs] int32, device: P_i, the tokens before drafting
    prefix_lens_cpu: torch.Tensor    # [raw_bs] int32, host
    input_ids: torch.Tensor          # [raw_bs * topk] int64: the first token of each branch
    out_cache_loc: torch.Tensor      # [raw_bs, num_steps * topk] int64: slots, step-major
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    input_embeds: Optional[torch.Tensor] = None
    forward_mode: ForwardMode = ForwardMode.DECODE
    # trailing rows that are padding (row 0, prefix 0) in an eager reference of a padded batch: its
    # layout pads them by the pad rule (their tokens are not a replay's; real rows never read them).
    # ``run_eager`` alone: the graph path pads by itself and refuses them.
    pad_rows: int = 0

    @property
    def raw_bs(self) -> int:
        return int(self.req_pool_indices.shape[0])


def greedy_logprob(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[rows]`` float32: log-probability of the greedy token ``ids`` under ``logits [rows, vocab]``
    (an EAGLE-2 tree ranks its nodes by the sum of these along a branch)."""
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None])[:, 0]


class DraftExtendRunner(UniformGraphRunner):
    """DRAFT_EXTEND at uniform width N; after the forward, row ``i*N + accept_len - 1`` of each
    request is kept (logits and hidden), so acceptance never changes the attention layout."""

    modes = (ForwardMode.DRAFT_EXTEND,)

    def refusal(self, batch: ForwardBatch) -> Optional[str]:
        reason = super().refusal(batch)
        if reason is None and (batch.spec_info is None or batch.spec_info.accept_lens is None):
            return "DRAFT_EXTEND needs spec_info.accept_lens to select rows"
        return reason

    def _slice(self, out, batch: ForwardBatch, static_batch) -> RunnerOutput:
        logits, hidden = out
        acc = self.accept_lens[:batch.raw_bs]
        rows = select_rows(batch.raw_bs, self.width, acc)
        h = slice_hidden(hidden, batch.capture_hidden_mode, batch.raw_bs * self.width, self.width, acc)
        return RunnerOutput(logits[rows].clone(), h, rows=rows)


class MultiStepDraftRunner(GraphRunnerBase):
    """``num_steps`` draft-decode forwards in one graph, each with its own backends and its own
    step of the runner's :class:`StepGroup` (draft step ``s`` sees ``seq_lens = prefix + s*topk``)."""

    def __init__(self, model, step_backends: list, memory, topk: int, num_steps: int, buckets,
                 capture_hidden_mode=CaptureHiddenMode.NULL) -> None:
        if not 1 <= num_steps <= MAX_DRAFT_STEPS:
            raise ValueError(f"num_steps={num_steps} draft steps outside 1..{MAX_DRAFT_STEPS} (MAX_DRAFT_STEPS)")
        if len(step_backends) != num_steps:
            raise ValueError(f"{len(step_backends)} step backends for num_steps={num_steps}")
        super().__init__(model, step_backends[0], memory, buckets, capture_hidden_mode)
        self.step_backends = [model.backends_per_layer(s) for s in step_backends]
        self.backends = list({id(b): b for s in self.step_backends for b in s}.values())
        self._step_instances = [list({id(b): b for b in s}.values()) for s in self.step_backends]   # I12: each once
        self.fill = fill_of(self.backends)
        owners = {}
        for step, bes in enumerate(self.step_backends):
            for b in bes:
                if owners.setdefault(id(b), step) != step:
                    raise ValueError(f"steps {owners[id(b)] + 1} and {step + 1} share a backend instance; "
                                     "each draft step needs its own (its own metadata)")
        self.topk, self.num_steps, self.width = topk, num_steps, topk
        self.prep = prep_placement(self.backends)
        self.steps = StepGroup(memory, self.fill, num_steps, max_bs=self.max_bs, max_width=topk, tokens=True,
                               prep=self.prep)
        self._eager_steps = [Step(memory, self.fill) for _ in range(num_steps)]
        self.input_ids = self.steps[0].input_ids          # the first token of each branch
        offsets = torch.arange(num_steps, device=memory.device)[:, None]
        self._seq_offsets = ((offsets + 1) * topk).to(I32)          # step s: seq_lens = prefix + (s+1)*topk
        self._pos_offsets = offsets                                 # step s: positions = prefix + s (int64)
        self._seq_offsets_np = self._seq_offsets.cpu().numpy()
        self._rows = {}                 # (key, draft step) -> the step's (req_pool_indices, seq_lens, seq_lens_cpu)
        for b in self.backends:
            b.init_cuda_graph_state(self.max_bs, self.max_bs * topk)

    def spec(self, step: int) -> SpecInfo:
        return SpecInfo(num_draft_tokens=self.num_steps * self.topk + 1, topk=self.topk,
                        num_steps=self.num_steps, draft_step=step)

    def refusal(self, inp) -> Optional[str]:
        reason = super().refusal(inp)
        if reason:
            return reason
        if inp.forward_mode != ForwardMode.DECODE:
            return f"mode {inp.forward_mode.name} was not captured (captured DECODE draft steps)"
        if inp.raw_bs > self.max_bs:
            return f"bs={inp.raw_bs} exceeds the largest captured bucket {self.max_bs}"
        if tuple(inp.out_cache_loc.shape) != (inp.raw_bs, self.num_steps * self.topk):
            return (f"out_cache_loc {tuple(inp.out_cache_loc.shape)} != (bs, num_steps*topk) = "
                    f"({inp.raw_bs}, {self.num_steps * self.topk})")
        dev, raw = self.device.type, inp.raw_bs
        for name, rows, where in (("req_pool_indices", raw, dev), ("prefix_lens", raw, dev),
                                  ("prefix_lens_cpu", raw, "cpu"), ("input_ids", raw * self.topk, dev),
                                  ("out_cache_loc", raw, dev)):
            reason = tensor_refusal(name, getattr(inp, name), rows, where)
            if reason:
                return reason
        top = int(inp.prefix_lens_cpu.max()) + self.num_steps * self.topk    # the last step's seq_len
        if top > self.memory.max_context_len:   # refused before any step is written
            return (f"prefix {top - self.num_steps * self.topk} + num_steps*topk={self.num_steps * self.topk} "
                    f"exceeds max_context_len={self.memory.max_context_len}")
        return None

    def _static_batch(self, bucket: int):
        key = GraphKey(ForwardMode.DECODE, bucket, self.topk, self.capture_hidden_mode)
        n, k, batches = bucket * self.topk, self.topk, []
        for s, p in enumerate(self.steps):
            # a valid capture batch: request row 0 with a prefix of 0 (seq_len >= W * step)
            seq = max(pad_seq_len(self.fill, k), k * (s + 1))
            p.seq_lens[:bucket].fill_(seq)
            p.seq_lens_cpu[:bucket] = seq
            self._rows[(key, s)] = rows = (p.req_pool_indices[:bucket], p.seq_lens[:bucket], p.seq_lens_cpu[:bucket])
            batches.append(ForwardBatch(ForwardMode.DECODE, bucket, *rows, p.out_cache_loc[:n], p.positions[:n],
                                        spec_info=p.spec_view(key, self.spec(s + 1)),
                                        capture_hidden_mode=self.capture_hidden_mode, raw_bs=bucket))
        return key, batches

    def _steps(self) -> list:
        return list(self.steps)

    def _capture_metadata(self, key, static_batches) -> None:
        for s, (p, sb) in enumerate(zip(self.steps, static_batches)):
            view = p.capture(key, sb.spec_info, key.bs)
            gi = GraphInputs(key, *self._rows[(key, s)], view.spec, view.raw_bs, view)
            for b in self._step_instances[s]:
                b.init_forward_metadata_capture_cuda_graph(gi)

    def _prepare_replay(self, key, raw_bs: int) -> None:
        for s, p in enumerate(self.steps):
            view = p.update(key, raw_bs)
            req, seq, seq_cpu = self._rows[(key, s)]
            gi = GraphInputs(key, req, seq, seq_cpu, view.spec, raw_bs, view)
            for b in self._step_instances[s]:
                b.init_forward_metadata_replay_cuda_graph(gi)

    def _forward(self, static_batches):
        ids = self.input_ids[:static_batches[0].batch_size * self.topk]
        tokens, scores, logits, hidden = [], [], None, None
        for s, sb in enumerate(static_batches):
            # the graph's own step input: the previous step's tokens (a batch of this capture only)
            logits, hidden = self.model.forward(dataclasses.replace(sb, input_ids=ids), self.step_backends[s])
            ids = logits.argmax(-1)                                     # greedy within each branch
            tokens.append(ids)
            scores.append(greedy_logprob(logits, ids))
        return torch.stack(tokens), torch.stack(scores), logits, hidden  # [steps, bs*topk] x2, ...

    def _load(self, inp: DraftInput):
        """Every step's rows from the step-1 inputs in two to four launches (step ``s`` sees
        seq_lens ``prefix + (s+1)*topk``, positions ``prefix + s`` and the slots of column ``s``),
        then one copy launch into all the steps."""
        raw, k, steps = inp.raw_bs, self.topk, self.num_steps
        if inp.pad_rows:
            raise ValueError(f"DraftInput with pad_rows={inp.pad_rows}: the graph path pads by itself (0)")
        key = GraphKey(ForwardMode.DECODE, self.bucket_for(raw), k, self.capture_hidden_mode)
        sbs = self.graphs[key][2]
        seq = inp.prefix_lens[None, :] + self._seq_offsets                                    # [steps, raw] int32
        pos = inp.prefix_lens[None, :] + self._pos_offsets                                    # [steps, raw] int64
        if k > 1:
            pos = pos.repeat_interleave(k, dim=1, output_size=raw * k)
        loc = inp.out_cache_loc.view(raw, steps, k).transpose(0, 1).reshape(steps, raw * k)
        seq_np = inp.prefix_lens_cpu.numpy()[None, :raw] + self._seq_offsets_np
        self.steps.load_rows(key, raw, inp.req_pool_indices, seq, seq_np,
                             [[inp.input_ids if s == 0 else None, pos[s], loc[s]] for s in range(steps)])
        return key, sbs, raw

    def _slice(self, out, inp: DraftInput, static_batches) -> RunnerOutput:
        tokens, scores, logits, hidden = out
        n, k = inp.raw_bs * self.topk, self.topk
        toks = tokens[:, :n].reshape(self.num_steps, inp.raw_bs, k).permute(1, 0, 2).clone()  # [bs, steps, topk]
        sc = scores[:, :n].reshape(self.num_steps, inp.raw_bs, k).permute(1, 0, 2).clone()   # [bs, steps, topk]
        h = slice_hidden(hidden, inp.capture_hidden_mode, n, k)             # the last step's branch rows
        return RunnerOutput(logits[:n].clone(), h, rows=toks, scores=sc)

    def run_eager(self, inp: DraftInput) -> RunnerOutput:
        """The same steps with eager metadata on the unpadded batch (the reference path)."""
        raw, k = inp.raw_bs, self.topk
        ids, tokens, scores = inp.input_ids, [], []
        loc = inp.out_cache_loc.view(raw, self.num_steps, k)
        for s in range(self.num_steps):
            seq_cpu = inp.prefix_lens_cpu + (s + 1) * k
            b = ForwardBatch(ForwardMode.DECODE, raw, inp.req_pool_indices, inp.prefix_lens + (s + 1) * k, seq_cpu,
                             loc[:, s].reshape(-1), (inp.prefix_lens.to(I64) + s).repeat_interleave(k),
                             spec_info=self.spec(s + 1), capture_hidden_mode=inp.capture_hidden_mode,
                             input_ids=ids, raw_bs=raw - inp.pad_rows)
            b = self._eager_steps[s].build(b)
            for be in self._step_instances[s]:
                be.init_forward_metadata(b)
            logits, hidden = self.model.forward(b, self.step_backends[s])
            ids = logits.argmax(-1)
            tokens.append(ids)
            scores.append(greedy_logprob(logits, ids))
        toks = torch.stack(tokens).reshape(self.num_steps, raw, k).permute(1, 0, 2)
        sc = torch.stack(scores).reshape(self.num_steps, raw, k).permute(1, 0, 2)
        return RunnerOutput(logits, slice_hidden(hidden, inp.capture_hidden_mode, raw * k, k), rows=toks, scores=sc)
