"""The static buffers a backend's captured graphs read, at the largest size.

Capture binds views of them for a GraphKey; replay writes the layout builder's output into the
same storage. The staged inputs (``in_*``) hold what a captured "prep graph" of the builder
reads, so that replay preparation is a few launches (see ``base.LayoutBackend``).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .batch import ForwardMode
from .layout import I32, Layout, LayoutError, LayoutInputs, MaskKind


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
        # staged inputs: what a captured "prep graph" of the builder reads at replay
        self.in_req = z(max_bs, dtype=torch.int64)
        self.in_seq = z(max_bs)
        self.in_raw = z(1)
        self.in_step = z(1)
        self.in_tree = z(max_bs * max_width * max_width, dtype=torch.bool)

    def stage_scalars(self, inp: LayoutInputs) -> None:
        """raw_bs (and draft_step) into their device scalars: fill kernels, no host sync."""
        self.in_raw.fill_(inp.raw_bs)
        if inp.spec_info is not None and inp.spec_info.is_draft_decode:
            self.in_step.fill_(inp.spec_info.draft_step)

    def stage(self, inp: LayoutInputs) -> None:
        """Copy the device inputs into the staged buffers (raw_bs and draft_step as device
        scalars): what a builder run captured on :meth:`staged` inputs reads at replay.
        A few launches, no host sync."""
        bs, raw, spec = inp.bs, inp.raw_bs, inp.spec_info
        self.in_req[:bs].copy_(inp.req_pool_indices)
        self.in_seq[:bs].copy_(inp.seq_lens)
        self.stage_scalars(inp)
        if spec is not None and spec.tree_mask is not None:
            w = spec.tree_mask.shape[1]
            self.in_tree[:raw * w * w].view(raw, w, w).copy_(spec.tree_mask[:raw])

    def direct(self, inp: LayoutInputs) -> LayoutInputs:
        """``inp`` itself with raw_bs / draft_step read from the device scalars: for a builder
        captured on a caller's static inputs (a runner's buffers, refilled in place)."""
        draft = inp.spec_info is not None and inp.spec_info.is_draft_decode
        return replace(inp, raw_bs_dev=self.in_raw, draft_step_dev=self.in_step if draft else None,
                       check_device_values=False)

    def staged(self, inp: LayoutInputs) -> LayoutInputs:
        """Inputs that read the staged buffers: capture the builder on these once, then
        :meth:`stage` + replay serves any batch of the same key."""
        bs, spec = inp.bs, inp.spec_info
        draft = spec is not None and spec.is_draft_decode
        if spec is not None and spec.tree_mask is not None:
            w = spec.tree_mask.shape[1]
            spec = replace(spec, tree_mask=self.in_tree[:bs * w * w].view(bs, w, w))
        return replace(inp, req_pool_indices=self.in_req[:bs], seq_lens=self.in_seq[:bs], spec_info=spec,
                       raw_bs_dev=self.in_raw, draft_step_dev=self.in_step if draft else None,
                       check_device_values=False)

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
