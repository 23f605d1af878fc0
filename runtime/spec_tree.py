"""EAGLE-2 draft trees and greedy acceptance: pure tensor functions, batched over requests.

A round drafts after the *root*, the request's pending token (emitted, not yet in the target's
KV). Level 1 holds ``topk`` candidates, the top-k of the draft's distribution after the root
(top-k expansion). The multi-step draft runner extends each candidate greedily for
``num_steps - 1`` more levels, so branch ``j`` is a chain and there are ``topk * num_steps``
candidate nodes. A node's score is the cumulative draft log-probability of its branch up to
it; the ``N - 1`` best nodes (rerank; ties: shallower first, then lower branch) become the
draft tokens. A child never scores above its parent (log-probabilities are <= 0), so a chosen
node's parent is always chosen too.

The verify layout of a request's ``N`` rows: row 0 is the root, then the chosen nodes level by
level, so a parent's row precedes its children's and row ``r >= level(r)``. Row ``r`` sits at
position ``prefix + level(r)`` and sees exactly its ancestors and itself (``mask``). With
``topk == 1`` the tree is a chain and ``mask`` is causal.

Greedy acceptance: from the root, move to the child whose token equals the target's argmax at
the current row, while one exists. The target's argmaxes along that path are the emitted tokens:
the accepted draft tokens, then the bonus token; ``accept_len`` (1..N) of them in all.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

I64 = torch.int64


class DraftTree:
    """A request's draft tokens (``tokens [bs, N]`` int64: row 0 the root, then the chosen draft
    tokens) and the tree over them: ``levels [bs, N]`` (0 for the root, else 1..num_steps: the
    position offset), ``branch [bs, N]`` (each node's branch, -1 for the root) and ``mask [bs, N,
    N]`` bool (row j sees row k: its ancestors and itself). A chain (topk 1) is built from the
    tokens alone; its levels, branch and causal mask are made only when read."""

    def __init__(self, tokens: torch.Tensor, levels: Optional[torch.Tensor] = None,
                 branch: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None) -> None:
        given = [t is not None for t in (levels, branch, mask)]
        if any(given) and not all(given):
            raise ValueError("a DraftTree takes levels, branch and mask together, or none of them (a chain)")
        self.tokens, self._levels, self._branch, self._mask = tokens, levels, branch, mask
        self.chain = mask is None

    @property
    def num_draft_tokens(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def levels(self) -> torch.Tensor:
        if self._levels is None:
            bs, n = self.tokens.shape
            self._levels = torch.arange(n, device=self.tokens.device).expand(bs, n)
        return self._levels

    @property
    def branch(self) -> torch.Tensor:
        if self._branch is None:
            self._branch = (self.levels > 0).to(I64) - 1
        return self._branch

    @property
    def mask(self) -> torch.Tensor:
        if self._mask is None:
            bs, n = self.tokens.shape
            self._mask = torch.ones(n, n, dtype=torch.bool, device=self.tokens.device).tril().expand(bs, n, n)
        return self._mask


@dataclass
class Acceptance:
    accept_lens: torch.Tensor  # [bs] in 1..N (int64; a chain's int32): accepted draft tokens + the bonus token
    path: torch.Tensor         # [bs, N] int64: verify rows of the accepted path (root first); valid to accept_len
    emitted: torch.Tensor      # [bs, N] int64: the new tokens (drafts, then the bonus); valid to accept_len


def first_level(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expansion after the root: ``(tokens [bs, topk] int64, log-probs [bs, topk] float32)``
    of the draft's distribution ``logits [bs, vocab]``, best first."""
    if topk > logits.shape[-1]:
        raise ValueError(f"topk={topk} exceeds the vocabulary size {logits.shape[-1]}")
    top = torch.log_softmax(logits.float(), -1).topk(topk, dim=-1)
    return top.indices, top.values


def build_tree(root: torch.Tensor, first_tokens: torch.Tensor, first_logp: torch.Tensor,
               branch_tokens: Optional[torch.Tensor], branch_logp: Optional[torch.Tensor],
               num_draft_tokens: int) -> DraftTree:
    """The draft tree of each request.

    root ``[bs]``: the pending token; first_tokens / first_logp ``[bs, topk]``: level 1;
    branch_tokens / branch_logp ``[bs, num_steps - 1, topk]`` (or None when num_steps == 1): the
    greedy continuation of each branch and each token's log-probability (the draft runner's
    ``rows`` and ``scores``).
    """
    bs, k = first_tokens.shape
    if k == 1:
        return _chain(root, first_tokens, branch_tokens, num_draft_tokens)
    return _tree(root, first_tokens, first_logp, branch_tokens, branch_logp, num_draft_tokens)


def _tree(root, first_tokens, first_logp, branch_tokens, branch_logp, num_draft_tokens: int) -> DraftTree:
    """The general case: top-k expansion and rerank (also right for topk 1, in many more launches
    than :func:`_chain`)."""
    bs, k = first_tokens.shape
    toks, lps = first_tokens[:, None], first_logp[:, None].float()
    if branch_tokens is not None:
        toks = torch.cat([toks, branch_tokens.to(I64)], 1)                 # [bs, S, topk]
        lps = torch.cat([lps, branch_logp.float()], 1)
    steps = toks.shape[1]
    n = num_draft_tokens
    if not 2 <= n <= steps * k + 1:
        raise ValueError(f"num_draft_tokens={n} outside 2..num_steps*topk+1={steps * k + 1}")
    score = lps.cumsum(1).reshape(bs, steps * k)       # level-major: node i is level i//k + 1, branch i%k
    best = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :n - 1]
    chosen = best.sort(dim=1).values                   # level-major again: parents before children
    zero = torch.zeros(bs, 1, dtype=I64, device=root.device)
    tokens = torch.cat([root.to(I64)[:, None], toks.reshape(bs, -1).gather(1, chosen)], 1)
    levels = torch.cat([zero, chosen // k + 1], 1)
    branch = torch.cat([zero - 1, chosen % k], 1)
    # row j sees row i iff i is the root, or i lies on j's branch no deeper than j
    same = branch[:, :, None] == branch[:, None, :]
    mask = (same & (levels[:, None, :] <= levels[:, :, None])) | (levels[:, None, :] == 0)
    return DraftTree(tokens, levels, branch, mask)


def _chain(root, first_tokens, branch_tokens, n: int) -> DraftTree:
    """topk 1: the rerank keeps the first ``N - 1`` levels (a child never scores above its parent,
    and ties keep the shallower node), so the tree is the chain itself, in one launch."""
    steps = 1 + (0 if branch_tokens is None else branch_tokens.shape[1])
    if not 2 <= n <= steps + 1:
        raise ValueError(f"num_draft_tokens={n} outside 2..num_steps*topk+1={steps + 1}")
    parts = [root.to(I64)[:, None], first_tokens.to(I64)]
    if n > 2:
        parts.append(branch_tokens[:, :n - 2, 0].to(I64))
    return DraftTree(torch.cat(parts, 1))


def greedy_accept(tree: DraftTree, target_ids: torch.Tensor) -> Acceptance:
    """The longest path from the root whose draft tokens match the target's argmax at their
    parent, and the bonus token. ``target_ids [bs, N]``: the target's argmax at each verify row.
    A chain's accept lengths are int32 (what ``SpecInfo.accept_lens`` takes)."""
    bs, n = tree.tokens.shape
    if tree.chain:                      # row j's token is accepted iff every row before matched
        match = tree.tokens[:, 1:] == target_ids[:, :-1]
        accept_lens = match.cumprod(1).sum(1, dtype=torch.int32) + 1
        return Acceptance(accept_lens, torch.arange(n, device=target_ids.device).expand(bs, n), target_ids)
    rows = torch.arange(n, device=tree.tokens.device)
    lv = tree.levels
    # parent of each row: its deepest strict ancestor (the root has none: it always matches)
    strict = tree.mask & (rows[None, :, None] != rows[None, None, :])
    parent = torch.where(strict, lv[:, None, :], -1).argmax(-1)                  # [bs, N]
    match = (tree.tokens == target_ids.gather(1, parent)) | (lv == 0)
    accepted = ~(tree.mask & ~match[:, None, :]).any(-1)                         # all ancestors match
    depth = torch.where(accepted, lv, -1)
    deepest = depth.argmax(-1)                                                   # [bs]
    accept_lens = depth.max(-1).values + 1
    on_path = tree.mask[torch.arange(bs, device=lv.device), deepest]             # [bs, N]
    path = torch.where(on_path, lv, n).argsort(dim=-1, stable=True)   # by level (< N), root first
    return Acceptance(accept_lens, path, target_ids.gather(1, path))

