"""The static buffers of the canonical layout, at the largest size, owned by a step.

Capture binds views of them for a GraphKey; replay writes the layout builder's output into the
same storage (see :mod:`attn_backends.step`).
"""
from __future__ import annotations

import torch

from ..batch import ForwardMode
from ..layout import I32, Layout, LayoutError, MaskKind

I64 = torch.int64


class LayoutBuffers:
    """Static buffers at the largest size; every captured graph reads views of them."""

    def __init__(self, max_bs: int, max_width: int, max_context_len: int, page_size: int, device) -> None:
        if max_context_len % page_size:
            raise LayoutError(f"max_context_len={max_context_len} is not a multiple of page_size={page_size}")
        self.max_bs, self.max_width, self.page_size = max_bs, max_width, page_size
        self.max_pages = max_context_len // page_size
        z = lambda *s, dtype=I32: torch.zeros(*s, dtype=dtype, device=device)  # noqa: E731
        self.cu_seqlens_q = z(max_bs + 1)
        self.seq_lens_k = z(max_bs)
        self.prefix_lens = z(max_bs)
        self.page_table = z(max_bs, self.max_pages)
        self.kv_indptr = z(max_bs + 1)
        self.kv_indices = z(max_bs * self.max_pages)       # I6: worst case, every row full
        self.kv_last_page_len = z(max_bs)
        self.custom_mask = z(max_bs * max_width * max_width, dtype=torch.bool)
        self.mask_indptr = z(max_bs + 1)
        self.draft_prefix_lens = z(max_bs)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}

    def check_capacity(self, bs: int, width: int) -> None:
        if bs > self.max_bs:
            raise LayoutError(f"bs={bs} exceeds the graph buffers' max_bs={self.max_bs}")
        if width > self.max_width:
            raise LayoutError(f"width W={width} exceeds the graph buffers' max width {self.max_width}")

    def views(self, mode: ForwardMode, bs: int, width: int, mask: MaskKind, max_seq_len_k: int) -> Layout:
        self.check_capacity(bs, width)
        tree, draft = mask == MaskKind.TREE, mask == MaskKind.DRAFT
        return Layout(mode, bs, width, self.page_size, mask,
                      self.cu_seqlens_q[:bs + 1], self.seq_lens_k[:bs], self.prefix_lens[:bs],
                      self.page_table[:bs], self.kv_indptr[:bs + 1], self.kv_indices[:bs * self.max_pages],
                      self.kv_last_page_len[:bs], width, max_seq_len_k,
                      self.custom_mask[:bs * width * width] if tree else None,
                      self.mask_indptr[:bs + 1] if tree else None,
                      self.draft_prefix_lens[:bs] if draft else None)


class RowCopies:
    """The copies of a step's ``load_rows``: a batch's real rows (request rows, seq_lens and
    the tokens) and the ``raw_bs`` and draft-step scalars (from device constants) into the step's
    inputs, in one ``_foreach_copy_`` launch. The destinations of every ``raw_bs`` are views made
    once. The int64 token rows travel as pairs of int32 words (bitwise the same copy) so that one
    launch takes them all; token sources that are not contiguous int64 take a second launch.
    :meth:`pairs` hands the copies out instead, so that the steps of a multi-step draft join one
    launch (:class:`attn_backends.step.StepGroup`)."""

    def __init__(self, req_pool_indices, seq_lens, raw_bs_dev, draft_step_dev, tokens, width: int) -> None:
        bs, dev = req_pool_indices.shape[0], req_pool_indices.device
        self._consts = list(torch.arange(bs + 65, dtype=I32, device=dev).view(-1, 1).unbind(0))   # [1] views
        self._req = [None] + [[req_pool_indices[:r], seq_lens[:r], raw_bs_dev, draft_step_dev]
                              for r in range(1, bs + 1)]
        self._tok = [None] + ([list(tokens[:, :r * width].unbind(0)) for r in range(1, bs + 1)] if tokens is not None
                              else [])
        self._words = [None] + [[t.view(I32) for t in self._tok[r]] for r in range(1, len(self._tok))]
        self._all = [None] + [self._req[r] + self._words[r] for r in range(1, len(self._tok))]

    def write(self, raw_bs: int, n: int, req_pool_indices, seq_lens, draft_step: int, tokens=None) -> None:
        """``tokens``: ``[input_ids, positions, out_cache_loc]`` (``n`` rows each; None entries are
        left alone); sources longer than the real rows are cut."""
        self.launch(*self.pairs(raw_bs, n, req_pool_indices, seq_lens, draft_step, tokens))

    @staticmethod
    def launch(dst: list, src: list, rest: list) -> None:
        """Run copies as :meth:`pairs` hands them out (those of several steps joined): one
        ``_foreach_copy_``, and one more for ``rest``."""
        if rest:
            torch._foreach_copy_([d for d, _ in rest], [t for _, t in rest])
        torch._foreach_copy_(dst, src)

    def pairs(self, raw_bs: int, n: int, req_pool_indices, seq_lens, draft_step: int, tokens=None):
        """The copies of :meth:`write` without launching them: ``(dst, src, rest)``, where ``dst``
        / ``src`` can join one ``_foreach_copy_`` with other steps' and ``rest`` lists the
        ``(dst, src)`` pairs of token sources that are not contiguous int64. (The replay's hot
        path: int32 request rows and three contiguous int64 token rows take the first branch.)"""
        c = self._consts
        src = [req_pool_indices if req_pool_indices.shape[0] == raw_bs else req_pool_indices[:raw_bs],
               seq_lens if seq_lens.shape[0] == raw_bs else seq_lens[:raw_bs], c[raw_bs], c[draft_step]]
        if tokens is None:
            return self._req[raw_bs], src, []
        words = src[0].dtype is I32 and src[1].dtype is I32
        if words and all(t is not None and t.dtype is I64 and t.is_contiguous() for t in tokens):
            src += [(t if t.shape[0] == n else t[:n]).view(I32) for t in tokens]
            return self._all[raw_bs], src, []
        toks = [None if t is None else _rows(t, n) for t in tokens]
        if words and all(t is None or (t.dtype is I64 and t.is_contiguous()) for t in toks):
            return (self._req[raw_bs] + [w for w, t in zip(self._words[raw_bs], toks) if t is not None],
                    src + [t.view(I32) for t in toks if t is not None], [])
        return self._req[raw_bs], src, [(d, t) for d, t in zip(self._tok[raw_bs], toks) if t is not None]


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if t.shape[0] == n else t[:n]
