"""The static buffers of the canonical layout, at the largest size, owned by a step plan.

Capture binds views of them for a GraphKey; replay writes the layout builder's output into the
same storage (see :mod:`attn_backends.plan`).
"""
from __future__ import annotations

import torch

from .batch import ForwardMode
from .layout import I32, Layout, LayoutError, MaskKind


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
