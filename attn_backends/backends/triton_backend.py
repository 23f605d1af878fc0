"""``triton``: MHA/GQA over the paged cache with the kernels of ``kernels/``.

DECODE runs the split-KV decode kernel; EXTEND, TARGET_VERIFY (chain and tree),
DRAFT_EXTEND and draft decode (topk branch rows) run the extend kernel with the mask the
layout names. Every host value a launch takes (W, split count, grid) comes from the
layout's host ints, which in graph mode come from the GraphKey alone.
"""
from __future__ import annotations

from typing import ClassVar

import torch
import triton

from attn_backends_kernels.decode_attention import decode_attention_fwd
from attn_backends_kernels.extend_attention import extend_attention_fwd, pick_block_q, wide_verify_tile
from attn_backends_kernels.kv_store import store_kv

from ..base import Capabilities, ForwardMetadata, GraphSupport
from ..batch import ForwardMode
from ..config import AttentionLayer
from ..layout import Layout, MaskKind
from .triton_common import TritonBackendBase

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

    def _per_sm(self, width: int) -> int:
        # a verify tile of >= 32 rows (a KV group of >= 8 heads) does twice the work per program
        if width <= 1:
            return 16
        group_pad = triton.next_power_of_2(self.config.num_q_heads // self.config.num_kv_heads)
        return 8 if wide_verify_tile(width, pick_block_q(width, group_pad) * group_pad) else 16

    def _store_kv(self, layer: AttentionLayer, loc: torch.Tensor, k, v) -> None:
        pool = self.memory.pool
        store_kv(k, v, pool.k[layer.layer_id], pool.v[layer.layer_id], loc)

    def _kv_buffers(self, layer: AttentionLayer) -> tuple:
        pool = self.memory.pool
        return pool.k[layer.layer_id], pool.v[layer.layer_id]

    def _launch(self, q: torch.Tensor, kv: tuple, out: torch.Tensor, layer: AttentionLayer,
                meta: ForwardMetadata) -> None:
        lay = meta.layout
        kb, vb = kv
        splits, ws = meta.extra["num_kv_splits"], meta.extra["workspace"]
        if is_plain_decode(lay):
            decode_attention_fwd(q, kb, vb, lay.page_table, lay.seq_lens_k, lay.page_size,
                                 layer.scaling, splits, out, workspace=ws)
            return
        extend_attention_fwd(
            q, kb, vb, lay.page_table, lay.seq_lens_k, lay.cu_seqlens_q, lay.page_size, layer.scaling,
            lay.max_seq_len_q, out, mask=lay.mask.value, custom_mask=lay.custom_mask,
            draft_prefix_lens=lay.draft_prefix_lens, num_kv_splits=splits, workspace=ws)


__all__ = ["TritonBackend", "MaskKind"]
