"""A sliding layer group's layout: the step's layout with each request's KV starting at its window.

A request whose first query row sits at position ``first`` (its prefix; a multi-branch draft's
prompt prefix) reads, in a layer of window ``w``, no key before ``first - w + 1`` (later rows,
deeper tree tokens and later draft steps see no earlier). Its first ``skip = max(0, first - w + 1)
// page_size`` pages are dropped: the windowed layout's KV of the request is the step's KV from
token ``skip * page_size`` on, so every length and position in it (``seq_lens_k``,
``prefix_lens``, ``draft_prefix_lens``) is ``skip * page_size`` smaller and relative distances,
the only thing windows, causal rows, tree masks and draft masks compare, are the same. The pages
are the step layout's own, shifted: no page outside the window is listed (issue #42.2), and the
first listed page may hold tokens before the window (the window's mask drops them: pages are the
unit a pool frees, I17).

:func:`window_layout` derives it on the device from the step's layout alone (no host sync; graph
steps pass ``out``, buffers fixed per key, and replay rewrites them); :func:`window_skip_host`
gives the same skip from host lengths, for planners that read the host (FlashInfer's ``plan``).
Layers of one window share one layout (:func:`step_window_layout`: the step's cache).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from .layout import Layout, flatten_pages
from .step.view import LibraryKey
from .validation import LayoutError


def first_positions(lay: Layout) -> torch.Tensor:
    """``[bs]`` the first query row's position of each request (a draft's prompt prefix)."""
    return lay.draft_prefix_lens if lay.draft_prefix_lens is not None else lay.prefix_lens


def window_layout(lay: Layout, window: int, out: Optional[Layout] = None) -> Layout:
    """``lay`` with each request's KV from the first page its first row sees in a window of
    ``window`` keys; into ``out`` (made by :func:`empty_window_layout` for ``lay``) or fresh."""
    if window < 1:
        raise LayoutError(f"window={window} must be >= 1")
    ps = lay.page_size
    out = empty_window_layout(lay) if out is None else out
    if (out.bs, out.width, out.mask, out.kv_indices.shape) != (lay.bs, lay.width, lay.mask, lay.kv_indices.shape):
        raise LayoutError(f"window layout buffers for (bs={out.bs}, W={out.width}, {out.mask.value}, "
                          f"{out.kv_indices.numel()} pages) but the step is (bs={lay.bs}, W={lay.width}, "
                          f"{lay.mask.value}, {lay.kv_indices.numel()} pages)")
    skip = (first_positions(lay) - (window - 1)).clamp(min=0) // ps          # [bs] pages dropped
    drop = skip * ps
    torch.sub(lay.seq_lens_k, drop, out=out.seq_lens_k)
    torch.sub(lay.prefix_lens, drop, out=out.prefix_lens)
    if lay.draft_prefix_lens is not None:
        torch.sub(lay.draft_prefix_lens, drop, out=out.draft_prefix_lens)
    npages = lay.kv_indptr[1:] - lay.kv_indptr[:-1] - skip
    maxp = lay.page_table.shape[1]
    cols = torch.arange(maxp, device=skip.device, dtype=skip.dtype)
    src = (cols[None, :] + skip[:, None]).clamp(max=maxp - 1).long()
    out.page_table.copy_(lay.page_table.gather(1, src).masked_fill_(cols[None, :] >= npages[:, None], 0))
    flatten_pages(out, npages)
    return out


def empty_window_layout(lay: Layout) -> Layout:
    """Buffers for :func:`window_layout` of ``lay``: its own KV fields, the step's query fields
    (``cu_seqlens_q``, ``kv_last_page_len``, masks) shared, as they do not move."""
    z = torch.zeros_like
    return replace(lay, seq_lens_k=z(lay.seq_lens_k), prefix_lens=z(lay.prefix_lens), page_table=z(lay.page_table),
                   kv_indptr=z(lay.kv_indptr), kv_indices=z(lay.kv_indices),
                   draft_prefix_lens=None if lay.draft_prefix_lens is None else z(lay.draft_prefix_lens))


def window_skip_host(kv_lens: np.ndarray, q_lens: np.ndarray, window: int, page_size: int) -> np.ndarray:
    """The tokens :func:`window_layout` drops per request, from host KV and query lengths (rows
    whose first query row is at ``kv_len - q_len``: every mode but multi-branch draft decode)."""
    first = kv_lens.astype(np.int64) - q_lens.astype(np.int64)
    return np.maximum(first - (window - 1), 0) // page_size * page_size


def step_window_layout(view, window: int) -> Layout:
    """The windowed layout of ``view``'s step for ``window``, derived once per step and kept in the
    step's cache (graph steps: buffers fixed per key, for every backend and layer of that window)."""
    owner = LibraryKey(Layout, None, view.key, f"window {window}")
    held = view.cache.get(owner)
    if held is not None and held[0] == view.step_id:
        return held[1]
    # eager: fresh tensors, as the step's own; graph: the key's buffers, rewritten in place
    lay = window_layout(view.layout, window, out=None if held is None or view.key is None else held[1])
    view.cache[owner] = (view.step_id, lay)
    return lay
