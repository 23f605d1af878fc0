"""Named batch scenarios on a real KV memory: the test data of the suite and of ``check``.

A :class:`Scenario` describes one forward (mode, bucket, raw_bs, prefixes, spec, page
layout); :func:`materialize` allocates its requests in a :class:`KVMemory` (shuffled,
reversed or interleaved pages), fills the pool with random data (never zeros) and returns
the padded :class:`ForwardBatch`. Padding follows the pad rule (layout.canonical_rows,
write_canonical_pad): request row 0, out_cache_loc 0, seq_len = fill (>= W).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..batch import CaptureHiddenMode, ForwardBatch, ForwardMode, SpecInfo, query_width
from ..config import ModelConfig
from ..kv_cache import KVMemory
from ..layout import pad_seq_len

PAGE_ORDERS = ("contiguous", "shuffled", "reversed", "interleaved")


@dataclass
class Scenario:
    mode: ForwardMode
    bs: int                               # the bucket (padded size)
    prefix_lens: list                     # [raw_bs] cached tokens before this forward
    spec: Optional[SpecInfo] = None
    extend_lens: Optional[list] = None    # EXTEND: new tokens per request
    name: str = ""
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL

    @property
    def raw_bs(self) -> int:
        return len(self.prefix_lens)

    @property
    def width(self) -> int:
        return 0 if self.mode == ForwardMode.EXTEND else query_width(self.mode, self.spec)

    def new_tokens(self, i: int) -> int:
        return self.extend_lens[i] if self.mode == ForwardMode.EXTEND else self.width

    def describe(self) -> str:
        spec = ""
        if self.spec is not None:
            spec = f" N={self.spec.num_draft_tokens} topk={self.spec.topk} steps={self.spec.num_steps}"
            if self.spec.is_draft_decode:
                spec += f" draft_step={self.spec.draft_step}"
            if self.spec.accept_lens is not None:
                spec += f" accept={self.spec.accept_lens[:self.raw_bs].tolist()}"
        ext = f" extend={self.extend_lens}" if self.extend_lens else ""
        return f"{self.name or self.mode.name} bs={self.bs} raw_bs={self.raw_bs} prefixes={self.prefix_lens}{ext}{spec}"


@dataclass
class Materialized:
    scenario: Scenario
    batch: ForwardBatch
    rows: list                       # request rows of the real requests
    fill: int
    extras: dict = field(default_factory=dict)


def dims_for(caps, mla: bool) -> dict:
    """Model sizes a backend accepts (its ``head_dims``): MLA latent 512 + rope 64 where it needs
    576; MHA/GQA the allowed head dim nearest 100 (128 where allowed, the GPU tests' size).
    Empty when the backend takes any."""
    if caps.head_dims is None:
        return {}
    if mla:
        return dict(kv_lora_rank=512, qk_rope_head_dim=64) if 576 in caps.head_dims else {}
    return dict(head_dim=min(caps.head_dims, key=lambda d: abs(d - 100)))


def make_memory(cfg: ModelConfig, *, num_pages: int, max_reqs: int, max_context_len: int,
                page_order: str = "shuffled", seed: int = 0, device="cpu", fill: bool = True) -> KVMemory:
    alloc_order = "shuffled" if page_order == "interleaved" else page_order
    mem = KVMemory(num_layers=cfg.num_layers, num_pages=num_pages, page_size=cfg.page_size,
                   max_reqs=max_reqs, max_context_len=max_context_len, is_mla=cfg.is_mla,
                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, v_head_dim=cfg.v_head_dim,
                   kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim, dtype=cfg.cache_dtype,
                   device=device, page_order=alloc_order, seed=seed)
    mem.page_order = page_order
    if fill:  # metadata-only checks need no KV data
        fill_pool_random(mem, seed)
    return mem


def fill_pool_random(mem: KVMemory, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    bufs = mem.pool.kv if mem.is_mla else mem.pool.k + mem.pool.v
    for b in bufs:
        b.copy_(torch.randn(b.shape, generator=g, dtype=torch.float32).to(b.dtype))


def random_tree_mask(n: int, rng: random.Random) -> torch.Tensor:
    """``[n, n]`` bool ancestor-or-self mask of a random tree rooted at draft token 0."""
    parent = [-1] + [rng.randrange(0, j) for j in range(1, n)]
    m = torch.zeros(n, n, dtype=torch.bool)
    for j in range(n):
        k = j
        while k >= 0:
            m[j, k] = True
            k = parent[k]
    return m


def _allocate_prefixes(mem: KVMemory, rows: list, lens: list, interleaved: bool) -> None:
    if not interleaved:
        for r, n in zip(rows, lens):
            if n:
                mem.extend(r, n)
        return
    # one page at a time, round robin: the pages of different requests interleave
    left = list(lens)
    while any(left):
        for i, r in enumerate(rows):
            step = min(left[i], mem.page_size)
            if step:
                mem.extend(r, step)
                left[i] -= step


def materialize(scn: Scenario, mem: KVMemory, fill: int, device=None) -> Materialized:
    """Allocate the scenario's requests and return the padded batch (fill: backend's value)."""
    device = device or mem.device
    if scn.raw_bs > scn.bs:
        raise ValueError(f"raw_bs={scn.raw_bs} exceeds the bucket bs={scn.bs}")
    rows = [mem.new_request() for _ in range(scn.raw_bs)]
    _allocate_prefixes(mem, rows, scn.prefix_lens, getattr(mem, "page_order", "") == "interleaved")
    locs, positions, seq = [], [], []
    for i, r in enumerate(rows):
        n = scn.new_tokens(i)
        locs.append(mem.extend(r, n).cpu())
        positions.append(torch.arange(scn.prefix_lens[i], scn.prefix_lens[i] + n))
        seq.append(scn.prefix_lens[i] + n)
    pad = scn.bs - scn.raw_bs
    w = scn.width
    pad_seq = pad_seq_len(fill, w)
    if pad:
        n_pad = pad * (w or 1)
        locs.append(torch.zeros(n_pad, dtype=torch.int64))
        positions.append(torch.zeros(n_pad, dtype=torch.int64))
    seq_cpu = torch.tensor(seq + [pad_seq] * pad, dtype=torch.int32)
    ext_cpu = None
    if scn.mode == ForwardMode.EXTEND:
        ext_cpu = torch.tensor(list(scn.extend_lens) + [1] * pad, dtype=torch.int32)
    batch = ForwardBatch(
        forward_mode=scn.mode, batch_size=scn.bs,
        req_pool_indices=torch.tensor(rows + [0] * pad, dtype=torch.int32, device=device),
        seq_lens=seq_cpu.to(device), seq_lens_cpu=seq_cpu,
        out_cache_loc=torch.cat(locs).to(device=device, dtype=torch.int64),
        positions=torch.cat(positions).to(device=device, dtype=torch.int64),
        extend_seq_lens=None if ext_cpu is None else ext_cpu.to(device),
        extend_seq_lens_cpu=ext_cpu, spec_info=scn.spec,
        capture_hidden_mode=scn.capture_hidden_mode, raw_bs=scn.raw_bs)
    return Materialized(scn, batch, rows, fill)


def verify_spec(n: int, bs: int, rng: random.Random, topk: int = 1, steps: Optional[int] = None,
                device="cpu") -> SpecInfo:
    if topk == 1:
        return SpecInfo(num_draft_tokens=n, topk=1, num_steps=steps or n - 1)
    steps = steps or max(1, -(-(n - 1) // topk))
    masks = [random_tree_mask(n, rng) for _ in range(bs)]
    return SpecInfo(num_draft_tokens=n, topk=topk, num_steps=steps,
                    tree_mask=torch.stack(masks).to(device))


def draft_extend_spec(n: int, bs: int, raw_bs: int, accept: list, device="cpu", topk: int = 1,
                      steps: Optional[int] = None) -> SpecInfo:
    """DRAFT_EXTEND at width N; with ``topk > 1`` N is the tree size, not ``steps + 1``."""
    acc = torch.tensor(list(accept) + [1] * (bs - raw_bs), dtype=torch.int32, device=device)
    return SpecInfo(num_draft_tokens=n, topk=topk, num_steps=steps or n - 1, accept_lens=acc)


def draft_decode_spec(topk: int, steps: int, step: int) -> SpecInfo:
    return SpecInfo(num_draft_tokens=steps * topk + 1, topk=topk, num_steps=steps, draft_step=step)
