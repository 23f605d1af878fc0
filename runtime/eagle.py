"""The EAGLE worker: one speculative step for a batch of running requests.

State of a request between steps: the target's KV holds its first ``T`` tokens, token ``T``
(the last one emitted) is pending, and the draft is one token ahead (its KV holds ``0..T``,
the memory's length is ``T + 1``); the worker keeps the draft's level-1 candidates after the
pending token (top-k of its last row).

One step (positions are per request; ``S`` = num_steps, ``N`` = num_draft_tokens):

1. allocate ``max((S-1)*topk, N)`` positions after ``T``;
2. draft decode (``S - 1`` forwards, one graph): each level-1 candidate is extended greedily,
   branch ``j``'s step-``s`` token in position ``T+1 + s*topk + j``;
3. the tree: the ``N - 1`` best nodes by cumulative draft log-probability (spec_tree.py);
4. TARGET_VERIFY of the root and the tree at positions ``T..T+N-1`` (tree mask); the target's
   hidden states (FULL) become the draft's features of those slots;
5. greedy acceptance: ``accept_len`` tokens (accepted drafts + the bonus token);
6. KV bookkeeping: the accepted path's target K/V and features move to positions
   ``T..T+accept_len-1`` (tree case; a chain is already in place);
7. DRAFT_EXTEND of the emitted tokens at ``T+1..T+N`` (width N; row ``accept_len - 1`` kept):
   the draft's KV catches up, its last valid row gives the next level-1 candidates;
8. truncate to ``T + accept_len + 1``: the rejected positions' pages go back to the allocator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from attn_backends import CaptureHiddenMode, ForwardBatch, ForwardMode, KVMemory, SpecInfo

from .batches import device_rows, extend_batch, uniform_batch
from .draft import MAX_DRAFT_STEPS, DraftInput
from .draft_model import DraftModel, eagle3_layers
from .executor import ModelExecutor
from .kv_bookkeeping import accepted_moves, layer_tensors, move_slots, slots_window
from .limits import ConfigError
from .runner_base import RunnerOutput
from .spec_tree import Acceptance, DraftTree, build_tree, first_level, greedy_accept

I32, I64 = torch.int32, torch.int64
METHODS = ("eagle", "eagle3")
MAX_STEPS = MAX_DRAFT_STEPS + 1          # the level-1 top-k takes no draft forward


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: ``num_steps`` levels of draft tokens (``num_steps - 1`` draft forwards
    after the level-1 top-k), ``topk`` branches, ``num_draft_tokens`` (N) rows verified per request."""

    method: str = "eagle"
    topk: int = 1
    num_steps: int = 3
    num_draft_tokens: int = 4
    noise: float = 0.0                       # the draft's disagreement knob (draft_model.py)
    draft_temperature: float = 0.25          # the draft's confidence (its argmax is unchanged)
    draft_layers: Optional[int] = None       # None: the target's layer count
    aux_layers: Optional[tuple] = None       # EAGLE-3; None: eagle3_layers(num_layers)
    seed: int = 1

    def __post_init__(self) -> None:
        reason = self.refusal()
        if reason is not None:
            raise ConfigError(reason)
        SpecInfo(self.num_draft_tokens, self.topk, self.num_steps)     # the bounds every runner enforces

    def refusal(self):
        """The first rule these settings break, as ``render(names)`` (limits.py), or None."""
        n, k, steps, d = self.num_draft_tokens, self.topk, self.num_steps, self.draft_layers
        if self.method not in METHODS:
            return lambda x: f"{x.set('method', repr(self.method))} is not one of {METHODS}"
        if not 1 <= steps <= MAX_STEPS:     # steps first: a bad N often follows from them
            return lambda x: (f"{x.set('num_steps', steps)} outside 1..{MAX_STEPS}: a round runs at most "
                              f"{MAX_DRAFT_STEPS} draft forwards (runtime/draft.py, MAX_DRAFT_STEPS)")
        if k < 1:
            return lambda x: f"{x.set('topk', k)} must be >= 1"
        if not 2 <= n <= steps * k + 1:     # the root and a draft token .. every drafted node
            most = (lambda x: f"{x('num_steps')}+1") if k == 1 else (lambda x: f"{x('num_steps')}*{x('topk')}+1")
            return lambda x: f"{x.set('num_draft_tokens', n)} outside 2..{most(x)}={steps * k + 1}"
        if d is not None and d < 1:
            return lambda x: f"{x.set('draft_layers', d)} must be >= 1 (None: all the target's layers)"
        return None

    @property
    def headroom(self) -> int:
        """Positions a step allocates past the pending token."""
        return max((self.num_steps - 1) * self.topk, self.num_draft_tokens)

    def verify_spec(self, tree_mask=None) -> SpecInfo:
        return SpecInfo(self.num_draft_tokens, self.topk, self.num_steps, tree_mask=tree_mask)

    def target_aux_layers(self, num_layers: int) -> tuple:
        if self.method != "eagle3":
            return ()
        return tuple(self.aux_layers) if self.aux_layers is not None else eagle3_layers(num_layers)


class EagleWorker:
    def __init__(self, spec: SpecConfig, memory: KVMemory, target: ModelExecutor, draft: ModelExecutor,
                 draft_model: DraftModel, target_layers: int) -> None:
        self.spec, self.memory, self.target, self.draft = spec, memory, target, draft
        self.draft_model = draft_model
        # what moves with an accepted path: the target's K/V and the draft's features
        self.moved = layer_tensors(memory, range(target_layers)) + [draft_model.features]
        # rid -> (level-1 tokens [bs, topk], log-probs [bs, topk], the request's row in them)
        self.candidates: dict = {}

    def release(self, rid: int) -> None:
        self.candidates.pop(rid, None)

    def _keep_candidates(self, reqs: list, logits: torch.Tensor) -> None:
        tokens, logp = first_level(logits, self.spec.topk)                        # [bs, topk] each
        for i, r in enumerate(reqs):
            self.candidates[r.rid] = (tokens, logp, i)

    def _candidates(self, reqs: list) -> tuple:
        """``(tokens, logp)`` ``[bs, topk]`` of ``reqs``: the last step's tensors as they are when
        the batch is the same (no launch), else gathered."""
        got = [self.candidates[r.rid] for r in reqs]
        tokens, logp = got[0][0], got[0][1]
        if tokens.shape[0] == len(reqs) and all(c[0] is tokens and c[2] == i for i, c in enumerate(got)):
            return tokens, logp
        return torch.stack([c[0][c[2]] for c in got]), torch.stack([c[1][c[2]] for c in got])

    # ------------------------------------------------------------------ prefill
    def prefill(self, reqs: list, target_batch: ForwardBatch, target_out: RunnerOutput, first: list) -> None:
        """After the target's EXTEND over the prompts (hidden FULL): store its hidden states as the
        features of the prompt's slots, then run the draft's EXTEND over prompt + first token."""
        self.draft_model.features[target_batch.out_cache_loc] = target_out.hidden.to(self.draft_model.features.dtype)
        tokens = [list(r.prompt) + [t] for r, t in zip(reqs, first)]
        batch = extend_batch(self.memory, [r.row for r in reqs], [0] * len(reqs), tokens)
        batch.input_embeds = self.draft_model.input_embeds(batch)
        out = self.draft.forward(batch)
        ends = torch.tensor([len(t) for t in tokens]).cumsum(0) - 1
        self._keep_candidates(reqs, out.logits[ends.to(out.logits.device)])

    # ------------------------------------------------------------------ one speculative step
    def step(self, reqs: list) -> tuple[list, list]:
        """Emitted tokens per request (``accept_len`` of them) and the accept lengths."""
        sp, mem, dev = self.spec, self.memory, self.memory.device
        starts = [r.num_tokens - 1 for r in reqs]                                 # T: the target's KV length
        for r, t in zip(reqs, starts):
            if mem.seq_len(r.row) != t + 1:
                raise RuntimeError(f"request {r.rid}: KV holds {mem.seq_len(r.row)} tokens, expected {t + 1}")
            mem.extend(r.row, sp.headroom)
        # one host-to-device copy of the step's inputs (and one per request in extend), before the first launch
        host = device_rows([[r.row for r in reqs], starts, [r.output[-1] for r in reqs]], dev)
        rows, roots = host[0].to(I32), host[2]
        at = Positions(host[1], torch.tensor(starts, dtype=I32))
        after = at.shifted(1)                                                    # the draft's KV length
        window = slots_window(mem, rows, at.dev, sp.headroom + 1)                 # [bs, 1 + headroom]: T..
        tree = self._draft_tree(reqs, rows, after, roots, window)
        acc = self._verify(rows, at, tree, window[:, :sp.num_draft_tokens])
        if not tree.chain:                                                       # a chain is in place already
            move_slots(self.moved, *accepted_moves(window[:, :sp.num_draft_tokens], acc.path, acc.accept_lens))
        self._draft_extend(reqs, rows, after, acc, window[:, 1:1 + sp.num_draft_tokens])
        out = torch.cat([acc.accept_lens[:, None], acc.emitted], 1).tolist()      # the step's one sync
        lens, emitted = [h[0] for h in out], [h[1:] for h in out]
        for r, t, a in zip(reqs, starts, lens):
            mem.truncate(r.row, t + a + 1)                                        # draft one ahead of T + a
        return [e[:a] for e, a in zip(emitted, lens)], lens

    def _draft_tree(self, reqs: list, rows: torch.Tensor, prefix: "Positions", roots: torch.Tensor,
                    window: torch.Tensor) -> DraftTree:
        sp = self.spec
        tokens, logp = self._candidates(reqs)                                     # [bs, topk]
        branch_tokens = branch_logp = None
        if sp.num_steps > 1:
            n = (sp.num_steps - 1) * sp.topk
            out = self.draft.draft(DraftInput(rows, prefix.dev.to(I32), prefix.cpu, tokens.reshape(-1),
                                              window[:, 1:1 + n].contiguous()))
            branch_tokens, branch_logp = out.rows, out.scores                     # [bs, steps-1, topk]
        return build_tree(roots, tokens, logp, branch_tokens, branch_logp, sp.num_draft_tokens)

    def _verify(self, rows: torch.Tensor, at: "Positions", tree: DraftTree, loc: torch.Tensor) -> Acceptance:
        sp = self.spec
        spec = sp.verify_spec(None if tree.chain else tree.mask)
        batch = uniform_batch(ForwardMode.TARGET_VERIFY, self.memory, rows, at.dev, at.cpu, tree.tokens.reshape(-1),
                              offsets=None if tree.chain else tree.levels, spec=spec, hidden=CaptureHiddenMode.FULL,
                              loc=loc)
        out = self.target.forward(batch)
        self.draft_model.features[batch.out_cache_loc] = out.hidden.to(self.draft_model.features.dtype)
        return greedy_accept(tree, out.logits.argmax(-1).view(rows.shape[0], sp.num_draft_tokens))

    def _draft_extend(self, reqs: list, rows: torch.Tensor, at: "Positions", acc: Acceptance,
                      loc: torch.Tensor) -> None:
        """The emitted tokens at width N; rows past ``accept_len`` carry the target's other argmaxes
        (valid tokens, their rows and K/V are dropped: truncate frees their positions)."""
        n = self.spec.num_draft_tokens
        spec = SpecInfo(n, 1, n - 1, accept_lens=acc.accept_lens.to(I32))
        batch = uniform_batch(ForwardMode.DRAFT_EXTEND, self.memory, rows, at.dev, at.cpu, acc.emitted.reshape(-1),
                              spec=spec, loc=loc)
        self._keep_candidates(reqs, self.draft.forward(batch).logits)


@dataclass
class Positions:
    """A position per request, on the device (int64) and the host (int32)."""

    dev: torch.Tensor
    cpu: torch.Tensor

    def shifted(self, k: int) -> "Positions":
        return Positions(self.dev + k, self.cpu + k)
