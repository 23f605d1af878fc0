"""``triton``: MHA/GQA over the paged cache with the kernels of ``kernels/``.

DECODE runs the split-KV decode kernel; EXTEND, TARGET_VERIFY (chain and tree),
DRAFT_EXTEND and draft decode (topk branch rows) run the extend kernel with the mask the
layout names. Every host value a launch takes (W, split count, grid) comes from the
layout's host ints, which in graph mode come from the GraphKey alone.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from attn_backends_kernels.decode_attention import decode_attention_fwd
from attn_backends_kernels.extend_attention import extend_attention_fwd
from attn_backends_kernels.kv_store import store_kv

from ..base import Capabilities, GraphSupport
from ..batch import ForwardMode
from ..config import AttentionLayer
from ..layout import Layout, MaskKind
from .triton_common import TritonBackendBase, TritonMetadata

ALL_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                       ForwardMode.DRAFT_EXTEND})


def is_plain_decode(lay: Layout) -> bool:
    return lay.mode == ForwardMode.DECODE and lay.width == 1


class TritonBackend(TritonBackendBase):
    name: ClassVar[str] = "triton"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=ALL_MODES, mha=True, mla=False, page_sizes=(1, 16, 64), topk_gt1=True,
        graph=GraphSupport.UNIFORM_BATCH, devices=("cpu", "cuda"), requires=("triton",))

    def _programs(self, bs: int, width: int) -> int:
        return bs * self.config.num_kv_heads

    # Verify and extend: a 64-token kernel tile a split at least, where that leaves a quarter of
    # the SMs a program. H200, graph replay, verify4 bs 1 kv 2048 (128 pages of 16; 64 splits
    # of 32 tokens -> 32 of 64): GQA 64/8 19.0 -> 16.5 us, 32/8 16.8 -> 14.6; 16 splits 17.2 /
    # 14.8; at kv 8192 (64 splits of 128 tokens) and at bs 4 unchanged.
    SPLIT_TOKENS: ClassVar[int] = 64

    def _split_rule(self, width: int, lay=None) -> tuple:
        # H200, graph replay, the split count halved and doubled around the rule (2026-11-27):
        # decode bs 16 kv 8192: 16 splits 144.5 us -> 8: 140.6; bs 64: 4 -> 2 510 / 508.
        # A chain verify of <= 4 rows wants fewer splits still: GQA 32/8 verify4 kv 8192 bs 4
        # 32 -> 16 56.6 -> 52.1 us, bs 16 16 -> 4 153.6 -> 142.8, kv 2048 bs 64 4 -> 1
        # 155.3 -> 139.0; GQA 64/8 bs 4 32 -> 16 64.3 -> 56.8, bs 16 8 -> 4 181.3 -> 178.0,
        # kv 2048 bs 64 2 -> 1 183.7 -> 169.6. Bs 1 keeps 64 (the cap).
        # Trees (8 rows; up to 8, a 64-row tile for GQA 64/8) write 64 x 128 float32 partials a
        # split and tile, as many bytes as a 64-token KV tile: at bs 4 kv 2048 the old 16 per SM
        # (32 splits) moved as many partial bytes as KV. Now 2 per SM with at least 4 splits where
        # that keeps <= 16 programs an SM (the floor and ``floor_per_sm`` below). H200 graph replay,
        # 2026-11-27, splits 4 / 8 / 16 / 32 where measured, us: GQA 64/8 tree8 bs 4 kv 2048
        # 37.3 / 28.7 / 34.4 / 48.6 (was 32, now 8), kv 8192 101.8 / 69.2 / 75.7 / 87.9 (32 -> 8);
        # bs 16 kv 2048 75.9 / 86.2 / 112.9 (16 -> 4); bs 64 kv 2048 269.5 / 309.8 / 401.2 (4,
        # kept); bs 1 kv 2048 33.0 / 22.4 / 18.9 / 18.7 and kv 32768 343.8 / 177.8 / 101.6 / 71.3
        # (32, the cap, kept). GQA 32/8 alike: bs 4 kv 2048 33.4 / 26.8 / 30.8 / 40.5, bs 16
        # 70.3 / 75.3 / 89.0. Bs 128 keeps 2: 4 there (sweeps at 62c0d91 -> 0036fd0) was 4-8 %
        # slower at kv 2048, 2-3 % faster at kv 32768. Wider batches (extend) keep 16 per SM.
        # Decode keeps at least 2: at bs 128 (1024 programs) it took 1 by its 8 per SM and lost
        # 23-43 % to 2 (H200 sweep at e3b0779: GQA 32/8 kv 8192 997 -> 1224 us, 64/8 kv 32768
        # 3916 -> 5595).
        # Decode, 6 per SM (was 8), counts below 8 not rounded to a power of two
        # (``_exact_splits_below``). H100, graph replay, least of 3 interleaved rounds, us, GQA
        # 32/8 and 64/8 at kv 2048 / 8192 / 32768 (2026-11-28): bs 8 16 -> 8 splits 45.6 / 131.3 /
        # 454.6 -> 39.5 / 109.0 / 378.8 and 42.3 / 110.8 / 377.3 -> 39.8 / 109.1 / 379.1; bs 4
        # 32 -> 16 26.1 / 65.3 / 199.2 -> 24.3 / 64.0 / 198.7 and 28.1 / 67.2 / 201.7 -> 25.6 /
        # 64.9 / 199.9; bs 16 8 -> 6 64.3 / 197.6 / 727.4 -> 63.5 / 194.8 / 721.8 and 65.2 /
        # 198.6 / 729.3 -> 63.4 / 195.3 / 723.7 (4: 0.5-1.4 % slower than 8 at kv >= 8192); bs 32
        # 4 -> 3 108.5 / 374.6 / 1436.7 -> 107.5 / 371.2 / 1430.2 and 109.7 / 376.4 / 1437.2 ->
        # 107.6 / 371.8 / 1431.4. Bs 1 (64, the cap) and 2 (32) keep theirs: the best or within
        # 1 % of it but at bs 1 kv 2048 (32 splits: 32/8 14.2 against 15.2, 64/8 15.5 against
        # 15.7). Bs 64 and 128 keep the floor of 2. Identical launches differed by up to 0.8 %
        # between rounds of these probes: the bs 16 (kv >= 8192) and bs 32 gains are near that.
        if width <= 1:
            return 6, 2, None
        if width <= 4:
            return 4, 1, None
        return (2, 4, 16) if width <= 8 else (16, 1, None)

    def _exact_splits_below(self, width: int) -> int:
        return 8 if width <= 1 else 1         # decode: 6 splits at bs 16 (see _split_rule)

    def _store_kv(self, layer: AttentionLayer, loc: torch.Tensor, k, v) -> None:
        pool = self.memory.pool
        store_kv(k, v, pool.k[layer.layer_id], pool.v[layer.layer_id], loc)

    def _kv_buffers(self, layer: AttentionLayer) -> tuple:
        pool = self.memory.pool
        return pool.k[layer.layer_id], pool.v[layer.layer_id]

    def _launch(self, q: torch.Tensor, kv: tuple, out: torch.Tensor, layer: AttentionLayer,
                meta: TritonMetadata) -> None:
        lay = meta.layout
        kb, vb = kv
        splits, ws = meta.num_kv_splits, meta.workspace
        if is_plain_decode(lay):
            decode_attention_fwd(q, kb, vb, lay.page_table, lay.seq_lens_k, lay.page_size,
                                 layer.scaling, splits, out, workspace=ws)
            return
        extend_attention_fwd(
            q, kb, vb, lay.page_table, lay.seq_lens_k, lay.cu_seqlens_q, lay.page_size, layer.scaling,
            lay.max_seq_len_q, out, mask=lay.mask.value, custom_mask=lay.custom_mask,
            draft_prefix_lens=lay.draft_prefix_lens, num_kv_splits=splits, workspace=ws)


__all__ = ("TritonBackend", "MaskKind")
