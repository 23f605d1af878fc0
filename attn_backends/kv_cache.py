"""KV memory: the request-to-token table, the paged KV pools and the page allocator.

Layout (part of the backend contract):

* ``req_to_token [max_reqs + 1, max_context_len]`` int32 maps (request row, token position)
  to a KV slot. Row 0 is reserved: all zeros, the row every padded request points at.
* A slot is ``page_id * page_size + offset``. Page 0 (slots ``0..page_size-1``) is reserved:
  padding reads it, nothing real is ever stored there. Pages are page-aligned per request:
  the slot of position ``t`` is ``page_of(t // page_size) * page_size + t % page_size``.
* MHA/GQA pool, per layer: ``k [num_slots, Hkv, D]`` and ``v [num_slots, Hkv, Dv]``.
* MLA pool, per layer: ``kv [num_slots, 1, kv_lora_rank + rope_dim]`` (latent 512 then rope 64).
"""
from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch

from .config import FP8_KV

SUPPORTED_PAGE_SIZES = (1, 16, 64)


class KVCacheFullError(RuntimeError):
    """Raised when an allocation does not fit; nothing has been overwritten."""


class ReqToTokenPool:
    def __init__(self, max_reqs: int, max_context_len: int, device="cpu") -> None:
        if max_reqs < 1 or max_context_len < 1:
            raise ValueError(f"max_reqs={max_reqs} and max_context_len={max_context_len} must be >= 1")
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros(max_reqs + 1, max_context_len, dtype=torch.int32, device=device)
        self._free = list(range(1, max_reqs + 1))

    def alloc(self) -> int:
        if not self._free:
            raise KVCacheFullError(f"no free request row: all {self.max_reqs} rows are in use")
        return self._free.pop(0)

    def free(self, row: int) -> None:
        if not 1 <= row <= self.max_reqs or row in self._free:
            raise ValueError(f"request row {row} is not allocated")
        self.req_to_token[row].zero_()
        self._free.append(row)


class PageAllocator:
    """Hands out page ids ``1..num_pages-1``; page 0 is reserved for padding.

    ``order`` shapes the layouts tests need: "contiguous" (ascending), "shuffled" (seeded
    permutation), "reversed" (non-monotonic, descending).
    """

    def __init__(self, num_pages: int, order: str = "shuffled", seed: int = 0) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is reserved)")
        pages = list(range(1, num_pages))
        if order == "shuffled":
            random.Random(seed).shuffle(pages)
        elif order == "reversed":
            pages.reverse()
        elif order != "contiguous":
            raise ValueError(f"order={order!r} is not one of contiguous, shuffled, reversed")
        self.num_pages = num_pages
        self._free = pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheFullError(f"need {n} pages, only {len(self._free)} of {self.num_pages - 1} free")
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as the cache holds it: an FP8 cache ``x / scale`` saturated to the format's finite range
    and rounded to nearest even (a value past it would become NaN or inf); others a cast."""
    if dtype in FP8_KV:
        top = torch.finfo(dtype).max
        return (x.double() / scale).float().clamp(-top, top).to(dtype)   # the float32 quotient exactly rounded
    return x.to(dtype)


class MHAPool:
    def __init__(self, num_layers, num_slots, num_kv_heads, head_dim, v_head_dim, dtype, device) -> None:
        self.k = [torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
                  for _ in range(num_layers)]
        self.v = [torch.zeros(num_slots, num_kv_heads, v_head_dim, dtype=dtype, device=device)
                  for _ in range(num_layers)]

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: float = 1.0,
              v_scale: float = 1.0) -> None:
        self.k[layer_id][loc] = to_cache(k, self.k[layer_id].dtype, k_scale)
        self.v[layer_id][loc] = to_cache(v, self.v[layer_id].dtype, v_scale)


class MLAPool:
    def __init__(self, num_layers, num_slots, kv_lora_rank, rope_dim, dtype, device) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.kv = [torch.zeros(num_slots, 1, kv_lora_rank + rope_dim, dtype=dtype, device=device)
                   for _ in range(num_layers)]

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor] = None,
              k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """``k``: ``[T, 1, latent+rope]``; ``v`` (the latent part) is implied by ``k``."""
        self.kv[layer_id][loc] = to_cache(k, self.kv[layer_id].dtype, k_scale)


class KVMemory:
    """Request rows, pages and the pool of one model, with host-side bookkeeping.

    ``extend(row, n)`` allocates slots for the next ``n`` positions of a request (continuing
    its last page), writes ``req_to_token`` and returns the new slots. Running out raises
    :class:`KVCacheFullError` before anything is written.
    """

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, max_reqs: int,
                 max_context_len: int, is_mla: bool, num_kv_heads: int = 1, head_dim: int = 0,
                 v_head_dim: int = 0, kv_lora_rank: int = 512, rope_dim: int = 64,
                 dtype=torch.float32, device="cpu", page_order: str = "shuffled", seed: int = 0) -> None:
        if page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(f"page_size={page_size} is not one of {SUPPORTED_PAGE_SIZES}")
        if max_context_len % page_size:
            raise ValueError(f"max_context_len={max_context_len} is not a multiple of page_size={page_size}")
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.device = torch.device(device)
        self.is_mla = is_mla
        self.req_pool = ReqToTokenPool(max_reqs, max_context_len, device)
        self.pages = PageAllocator(num_pages, page_order, seed)
        self.library_buffers: dict = {}   # tag -> a library's workspace over this memory (FlashInfer's)
        if is_mla:
            self.pool = MLAPool(num_layers, self.num_slots, kv_lora_rank, rope_dim, dtype, device)
        else:
            self.pool = MHAPool(num_layers, self.num_slots, num_kv_heads, head_dim,
                                v_head_dim or head_dim, dtype, device)
        self._lens: dict[int, int] = {}
        self._pages: dict[int, list[int]] = {}

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_pool.req_to_token

    @property
    def max_context_len(self) -> int:
        return self.req_pool.max_context_len

    def new_request(self) -> int:
        row = self.req_pool.alloc()
        self._lens[row], self._pages[row] = 0, []
        return row

    def seq_len(self, row: int) -> int:
        return self._lens[row]

    def extend(self, row: int, n: int) -> torch.Tensor:
        """Slots ``[n]`` int64 for positions ``len..len+n-1`` of request ``row``."""
        if row not in self._lens:
            raise ValueError(f"request row {row} is not allocated")
        old = self._lens[row]
        new = old + n
        if new > self.max_context_len:
            raise KVCacheFullError(f"request row {row}: {new} tokens exceed max_context_len={self.max_context_len}")
        ps = self.page_size
        need = -(-new // ps) - len(self._pages[row])
        if need > 0:
            try:
                self._pages[row] += self.pages.alloc(need)
            except KVCacheFullError as e:
                raise KVCacheFullError(f"request row {row}, extending {old} -> {new} tokens: {e}") from None
        pos = np.arange(old, new)
        slots = torch.from_numpy(np.asarray(self._pages[row], dtype=np.int64)[pos // ps] * ps + pos % ps)
        slots = slots.to(self.device)                    # one host-to-device copy
        self.req_to_token[row, old:new] = slots
        self._lens[row] = new
        return slots

    def truncate(self, row: int, new_len: int) -> None:
        """Drop positions ``new_len..`` (rejected draft tokens); frees whole pages only."""
        if not 0 <= new_len <= self._lens[row]:
            raise ValueError(f"new_len={new_len} outside 0..{self._lens[row]}")
        keep = -(-new_len // self.page_size)
        self.pages.free(self._pages[row][keep:])
        self._pages[row] = self._pages[row][:keep]
        self.req_to_token[row, new_len:self._lens[row]] = 0
        self._lens[row] = new_len

    def check_fits(self, config) -> None:
        """Raise ValueError unless the pool holds what ``config`` (a ModelConfig) reads and writes."""
        pool, c = self.pool, config
        if c.is_mla != self.is_mla:
            raise ValueError(f"the model is {'MLA' if c.is_mla else 'MHA/GQA'} but the KV memory holds an "
                             f"{'MLA' if self.is_mla else 'MHA'} pool")
        bufs = pool.kv if self.is_mla else pool.k
        if c.num_layers > len(bufs):
            raise ValueError(f"num_layers={c.num_layers} exceeds the KV memory's {len(bufs)} layers")
        want = ((1, c.kv_lora_rank + c.qk_rope_head_dim),) if self.is_mla else \
            ((c.num_kv_heads, c.head_dim), (c.num_kv_heads, c.v_head_dim))
        have = tuple(tuple(b[0].shape[1:]) for b in ((pool.kv,) if self.is_mla else (pool.k, pool.v)))
        if have != want:
            raise ValueError(f"the model's KV rows {want} (heads, dim) differ from the KV memory's {have}")
        if bufs[0].dtype != c.cache_dtype:
            raise ValueError(f"the model's KV dtype {c.cache_dtype} differs from the KV memory's {bufs[0].dtype}")

    def check_slots(self, loc: torch.Tensor, n_real: int) -> None:
        """Before any write: the first ``n_real`` entries of ``out_cache_loc`` are real tokens'
        slots (outside the reserved page 0), the rest padding (the reserved slot 0). Checked
        where the values are on the host; device values are not read (it would sync)."""
        if loc.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"out_cache_loc dtype {loc.dtype} is not int32/int64")
        if loc.device.type != "cpu":
            return
        real, pad = loc[:n_real], loc[n_real:]
        bad = (real < self.page_size) | (real >= self.num_slots)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"out_cache_loc[{i}]={int(real[i])}: a real token's slot must lie in "
                             f"{self.page_size}..{self.num_slots - 1} (page 0 is reserved for padding)")
        if bool(pad.ne(0).any()):
            i = int(pad.ne(0).nonzero()[0])
            raise ValueError(f"out_cache_loc[{n_real + i}]={int(pad[i])}: a padding token must write the "
                             "reserved slot 0")

    def free_request(self, row: int) -> None:
        self.pages.free(self._pages.pop(row))
        del self._lens[row]
        self.req_pool.free(row)
