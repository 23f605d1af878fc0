"""``triton_mla``: absorbed MLA over the latent cache ``[slots, 1, latent 512 + rope 64]``.

Every mode runs the MLA kernel, which loads each latent tile once for a block of query
rows and heads and uses it as both K (all 576 columns) and V (the latent 512): DECODE,
TARGET_VERIFY (chain and tree), DRAFT_EXTEND, draft decode (branch mask) and ragged EXTEND
(rows from ``cu_seqlens_q``, the grid sized by the host bound ``max_seq_len_q``).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from attn_backends_kernels.kv_store import store_mla_kv
from attn_backends_kernels.mla_attention import decodes_transposed, mla_attention_fwd

from ..base import Capabilities, ForwardMetadata, GraphSupport
from ..batch import ForwardMode
from ..config import AttentionLayer
from .triton_common import TritonBackendBase

ALL_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                       ForwardMode.DRAFT_EXTEND})


class TritonMLABackend(TritonBackendBase):
    name: ClassVar[str] = "triton_mla"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=ALL_MODES, mha=False, mla=True, page_sizes=(1, 16, 64), topk_gt1=True,
        graph=GraphSupport.UNIFORM_BATCH, devices=("cpu", "cuda"), requires=("triton",))
    fuses_merge: ClassVar[bool] = False       # the MLA kernels merge in a separate pass

    def _programs(self, bs: int, width: int) -> int:
        w_pad = 1 << (max(width, 1) - 1).bit_length()
        block_h = max(min(self.config.num_q_heads, max(1, 64 // w_pad)), 16 // min(w_pad, 16))
        return bs * -(-self.config.num_q_heads // block_h)

    # Verify: two 64-token tiles a split where that leaves a quarter of the SMs a program. H200,
    # graph replay, MLA16 verify4 kv 2048 (32 pages of 64): bs 4 32 splits (a tile each) 22.2 us
    # -> 16 19.3; bs 1 keeps 32 (16 programs at 16: 15.6 -> 16.7); at kv 8192 and 32768, and at
    # bs >= 16, the count is below the pages anyway.
    SPLIT_TOKENS: ClassVar[int] = 128

    def _split_rule(self, width: int) -> tuple:
        # decode: one 16-head program per SM on the transposed kernel (sm_90, ``mla_swap``), two on
        # the Triton kernel; one 64-head program (>= 64 heads); verify: one. H200, graph replay,
        # MLA16 decode on the transposed kernel, 2 per SM -> 1: bs 16 kv 8192 61.0 -> 55.7 us,
        # bs 64 62.4 -> 55.7 (kv 2048) and 164.0 -> 159.3, bs 128 99.2 -> 87.4 and 299.0 ->
        # 291.3; bs <= 4 as many splits either way (the 64 cap, the pages).
        if width <= 1 and self.config.num_q_heads < 64:
            return (1 if self._decodes_transposed() else 2), 1, None
        return 1, 1, None

    def _decodes_transposed(self) -> bool:
        return decodes_transposed(self.memory.device, self.memory.pool.kv[0].dtype, self.memory.page_size)


    def _store_kv(self, layer: AttentionLayer, loc: torch.Tensor, k, v) -> None:
        r = self.config.kv_lora_rank
        store_mla_kv(k[..., :r], k[..., r:], self.memory.pool.kv[layer.layer_id], loc)

    def _kv_buffers(self, layer: AttentionLayer) -> tuple:
        return (self.memory.pool.kv[layer.layer_id],)

    def _launch(self, q: torch.Tensor, kv: tuple, out: torch.Tensor, layer: AttentionLayer,
                meta: ForwardMetadata) -> None:
        lay = meta.layout
        splits, ws = meta.extra["num_kv_splits"], meta.extra["workspace"]
        ragged = lay.mode == ForwardMode.EXTEND
        mla_attention_fwd(q, kv[0], lay.page_table, lay.seq_lens_k, lay.page_size, layer.scaling,
                          splits, out, q_per_req=lay.width or 1, mask=lay.mask.value,
                          custom_mask=lay.custom_mask, workspace=ws,
                          cu_seqlens_q=lay.cu_seqlens_q if ragged else None,
                          max_q_len=lay.max_seq_len_q if ragged else None,
                          draft_prefix_lens=lay.draft_prefix_lens)
