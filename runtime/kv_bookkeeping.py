"""KV bookkeeping of the engine beside :class:`KVMemory`: slot windows, moving the accepted
path of a tree into consecutive positions, and page reservations for admission.

Moving, not re-indexing: a slot is ``page * page_size + offset`` and the backends rely on
pages being page-aligned per request, so with pages > 1 the accepted K/V must be copied into
the slots of positions ``prefix + 0..accept_len-1``. Each move goes from row ``path[m] >= m`` to
row ``m`` (the verify rows are level-major), so no move overwrites a source still to be read;
the gather of every source happens before any write anyway.
"""
from __future__ import annotations

from typing import Sequence

import torch

from attn_backends import KVMemory


def slots_window(memory: KVMemory, rows: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor:
    """``[bs, width]`` int64: the slots of positions ``starts[i] .. starts[i] + width - 1`` of
    request row ``rows[i]`` (allocated by the caller)."""
    cols = starts.to(torch.int64)[:, None] + torch.arange(width, device=starts.device)
    return memory.req_to_token[rows.long()[:, None], cols].long()


def layer_tensors(memory: KVMemory, layer_ids: Sequence[int]) -> list:
    """The pool tensors of ``layer_ids``: K and V (MHA/GQA) or the latent rows (MLA)."""
    pool = memory.pool
    if memory.is_mla:
        return [pool.kv[i] for i in layer_ids]
    return [t for i in layer_ids for t in (pool.k[i], pool.v[i])]


def move_slots(tensors: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """``t[dst] = t[src]`` for every tensor (rows indexed by slot); ``src == dst`` is a no-op."""
    for t in tensors:
        t[dst] = t[src]


def accepted_moves(verify_slots: torch.Tensor, path: torch.Tensor, accept_lens: torch.Tensor):
    """``(src, dst)`` ``[bs * N]`` int64: the slot of verify row ``path[m]`` goes to the slot of row
    ``m`` for ``m < accept_len``; every other pair is a self-copy (no host sync to filter them)."""
    n = verify_slots.shape[1]
    m = torch.arange(n, device=path.device)
    moving = (m[None, :] < accept_lens[:, None]) & (path != m[None, :])
    src = torch.where(moving, verify_slots.gather(1, path), verify_slots)
    return src.reshape(-1), verify_slots.reshape(-1)


class PageBudget:
    """Admission by worst case: a request is admitted only when the pages it can ever hold fit
    beside the worst cases of the running ones, so no allocation fails mid-generation."""

    def __init__(self, memory: KVMemory) -> None:
        self.page_size = memory.page_size
        self.total = memory.pages.num_pages - 1          # page 0 is reserved
        self.reserved = 0

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def fits(self, pages: int) -> bool:
        return self.reserved + pages <= self.total

    def reserve(self, pages: int) -> None:
        if not self.fits(pages):
            raise RuntimeError(f"reserving {pages} pages: {self.reserved} of {self.total} already reserved")
        self.reserved += pages

    def release(self, pages: int) -> None:
        self.reserved -= pages
