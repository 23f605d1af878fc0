"""``triton``: MHA/GQA over the paged cache with the kernels of ``kernels/``.

DECODE runs the split-KV decode kernel; EXTEND, TARGET_VERIFY (chain and tree),
DRAFT_EXTEND and draft decode (topk branch rows) run the extend kernel with the mask the
layout names. Every host value a launch takes (W, split count, grid) comes from the
layout's host ints, which in graph mode come from the GraphKey alone.
"""
from __future__ import annotations

import functools
from typing import ClassVar

import torch

from attn_backends_kernels.decode_attention import decode_attention_fwd
from attn_backends_kernels.extend_attention import chunk_fits, extend_attention_fwd, pick_block_q
from attn_backends_kernels.kv_store import store_kv
from attn_backends_kernels.launch_record import pow2

from ..base import Capabilities, GraphSupport
from ..batch import ForwardMode
from ..config import FP8_KV, AttentionLayer
from ..layout import Layout, MaskKind
from .triton_common import TritonBackendBase, TritonMetadata

# The batch-invariant prefill tile: query rows of a 64-row tile, whatever the batch's longest query.
INVARIANT_TILE_ROWS = 64
ALL_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                       ForwardMode.DRAFT_EXTEND})


def is_plain_decode(lay: Layout) -> bool:
    return lay.mode == ForwardMode.DECODE and lay.width == 1


class TritonBackend(TritonBackendBase):
    name: ClassVar[str] = "triton"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=ALL_MODES, mha=True, mla=False, page_sizes=(1, 16, 64), topk_gt1=True,
        graph=GraphSupport.UNIFORM_BATCH, devices=("cpu", "cuda"), requires=("triton",), kv_dtypes=FP8_KV,
        windows=True, sinks=True, softcap=True)

    def _programs(self, bs: int, width: int) -> int:
        return bs * self.config.num_kv_heads

    # Verify and extend: a 64-token kernel tile a split at least, where that leaves a quarter of
    # the SMs a program (shorter splits re-read the query tile for little KV; bench/RESULTS.md, 'Split counts').
    SPLIT_TOKENS: ClassVar[int] = 64

    def _split_rule(self, width: int, lay=None) -> tuple:
        # Programs an SM, the fewest splits, and where that floor holds, per query rows a request
        # (each measured around its neighbours: bench/RESULTS.md, 'Split counts'). Decode: 6 an SM,
        # at least 2 (one split at bs 128 lost a quarter or more). Chain verify of <= 4 rows: 4 an
        # SM (fewer splits: each re-reads the query rows). Trees: 2 an SM and at least 4 splits up
        # to 16 programs an SM (a tree's float32 partials weigh as much as a KV tile). Wider
        # batches (extend): 16 an SM. An FP8 cache's decode: twice the programs (its 64-token
        # tiles hold half the bytes in flight; bench/RESULTS.md, 'FP8 KV').
        if width <= 1:
            fp8 = self.config.cache_dtype in FP8_KV and (lay is None or is_plain_decode(lay))   # not 1-token extends
            return (12 if fp8 else 6), 2, None
        if width <= 4:
            return 4, 1, None
        return (2, 4, 16) if width <= 8 else (16, 1, None)

    # Decode and the uniform modes whose rows fit one tile (verify, draft rows) cut the batch's KV
    # into equal chunks on the device, whatever the lengths (bench/RESULTS.md, 'Ragged batches');
    # batch_invariant=True: into fixed chunks, a request's output then the same bits in any batch.
    schedule = "chunks"
    # A request's chunks merged by a second launch spread over rows, heads and columns ("pass"): with
    # "last" one program reads a long request's hundred chunks in a row (RESULTS.md, 'Ragged batches').
    chunk_merge = "pass"

    def __init__(self, config, memory, batch_invariant: bool = False) -> None:
        super().__init__(config, memory)
        if batch_invariant:
            self.schedule = "invariant"

    # A decode of at most this many programs (requests x KV heads), any cache dtype, runs on
    # DEEP_MAX_KV_SPLITS equal splits where the tile of group x Dv fills at least DEEP_TILE values at Dv <= 128
    # (measured: GQA 8/1 and 16/2 d128 on bf16 and e4m3 caches; the merge a separate pass): 64 splits of one KV
    # head leave half the SMs idle, and the chunks' two launches lost 1.04-1.4x at bs 2-8 (bench/RESULTS.md,
    # 'Ragged batches'). Class-level: the split plan's cache does not key on them.
    SPLIT_DECODE_PROGRAMS: ClassVar[int] = 8
    DEEP_TILE: ClassVar[int] = 1024

    @functools.cached_property
    def _deep_config(self) -> bool:
        cfg = self.config
        rows = pow2(cfg.num_q_heads // cfg.num_kv_heads)
        return cfg.v_head_dim <= 128 and rows * cfg.v_head_dim >= self.DEEP_TILE

    def _deep(self, lay: Layout) -> bool:
        # the programs first: most batches stop there (each eager step asks _chunked several times)
        return (self._programs(lay.bs, 1) <= self.SPLIT_DECODE_PROGRAMS and is_plain_decode(lay)
                and self.schedule != "invariant" and self._deep_config)

    def _split_decode(self, lay: Layout) -> bool:
        # One request's decode has nothing to balance: the split pass merges in its own launch, where
        # chunks take a second; a few programs fill the SMs deeper on splits (_deep). The invariant
        # schedule's bits need chunks (bench/RESULTS.md, 'Ragged batches').
        return self.schedule == "chunks" and is_plain_decode(lay) and (lay.bs == 1 or self._deep(lay))

    def _chunked(self, lay: Layout) -> bool:
        if self.schedule == "split" or self._split_decode(lay):
            return False
        group = self.config.num_q_heads // self.config.num_kv_heads
        return is_plain_decode(lay) or (bool(lay.width) and chunk_fits(lay.width, group))

    # Decode chunks where the split rule leaves fewer than this many a request (big batches, the floor
    # of 2 or 3): twice as many, shorter chunks; long ones ran 1.1-1.3x slower at bs 64-96 on a
    # bf16 cache (bench/RESULTS.md, 'Ragged batches'). FP8 caches have their own rule (12 an SM); the
    # interpreter's 2 splits stay 2 (occupancy is a GPU's).
    DOUBLE_CHUNKS_BELOW: ClassVar[int] = 4

    def _splits(self, lay: Layout) -> int:
        if self.schedule == "invariant" and not self._chunked(lay):
            return 1              # prefill and wide trees: a split count from the batch would make its bits the batch's
        splits = super()._splits(lay)
        if (splits < self.DOUBLE_CHUNKS_BELOW and self.schedule == "chunks" and is_plain_decode(lay)
                and self._chunked(lay) and self.config.cache_dtype not in FP8_KV and self.memory.device.type == "cuda"):
            return 2 * splits
        return splits

    def _exact_splits_below(self, width: int) -> int:
        return 8 if width <= 1 else 1         # decode: 6 splits at bs 16 (8 on FP8; see _split_rule)

    def _store_kv(self, layer: AttentionLayer, loc: torch.Tensor, k, v) -> None:
        pool = self.memory.pool
        store_kv(k, v, pool.k[layer.layer_id], pool.v[layer.layer_id], loc, layer.k_scale, layer.v_scale)

    def _kv_buffers(self, layer: AttentionLayer) -> tuple:
        pool = self.memory.pool
        return pool.k[layer.layer_id], pool.v[layer.layer_id]

    def _launch(self, q: torch.Tensor, kv: tuple, out: torch.Tensor, layer: AttentionLayer,
                meta: TritonMetadata) -> None:
        lay = meta.layout
        kb, vb = kv
        splits, ws = meta.num_kv_splits, meta.workspace
        chunked, tile = self._chunked(lay), {}
        merge = self.chunk_merge if chunked else "last"
        scales = dict(k_scale=layer.k_scale, v_scale=layer.v_scale,       # an FP8 cache's
                      window=layer.window, softcap=layer.softcap, sinks=layer.sinks)
        if is_plain_decode(lay):
            decode_attention_fwd(q, kb, vb, lay.page_table, lay.seq_lens_k, lay.page_size,
                                 layer.scaling, splits, out, workspace=ws, merge=merge,
                                 schedule=self.schedule if chunked else "split",
                                 **scales)
            return
        if self.schedule == "invariant" and not chunked:   # the batch's longest query would pick the tile
            group = self.config.num_q_heads // self.config.num_kv_heads
            tile = dict(block_q=pick_block_q(INVARIANT_TILE_ROWS, pow2(group)), num_warps=4,
                        num_stages=2)
        extend_attention_fwd(
            q, kb, vb, lay.page_table, lay.seq_lens_k, lay.cu_seqlens_q, lay.page_size, layer.scaling,
            lay.max_seq_len_q, out, mask=lay.mask.value, custom_mask=lay.custom_mask,
            draft_prefix_lens=lay.draft_prefix_lens, num_kv_splits=splits, workspace=ws,
            schedule=self.schedule if chunked else "split", merge=merge, **tile, **scales)


class BatchInvariantTritonBackend(TritonBackend):
    """``triton`` with ``batch_invariant=True``, by name for ``attn-backends check --backend
    attn_backends.backends.triton_backend:BatchInvariantTritonBackend``."""

    name: ClassVar[str] = "triton_invariant"

    def __init__(self, config, memory) -> None:
        super().__init__(config, memory, batch_invariant=True)


class Pow2SplitsTritonBackend(TritonBackend):
    """``triton`` without ``EXACT_CHUNK_SPLITS`` (chunked launches at a power of two below the split
    rule's count, the rule before it), by name for the sweep's ``*_pow2`` rows and ``attn-backends check``."""

    name: ClassVar[str] = "triton_pow2"
    EXACT_CHUNK_SPLITS: ClassVar[bool] = False


__all__ = ("TritonBackend", "BatchInvariantTritonBackend", "Pow2SplitsTritonBackend", "MaskKind")
