"""``triton_mla``: absorbed MLA over the latent cache ``[slots, 1, latent 512 + rope 64]``.

DECODE, TARGET_VERIFY (chain and tree) and DRAFT_EXTEND run the MLA kernel, which loads
each latent tile once for all W rows and a block of heads. Ragged EXTEND and multi-branch
draft decode (uncommon for MLA, and off the hot path) run the generic extend kernel over
views of the same cache (K = all 576 columns, V = the latent 512).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from kernels.extend_attention import extend_attention_fwd
from kernels.kv_store import store_mla_kv
from kernels.mla_attention import mla_attention_fwd

from ..base import Capabilities, ForwardMetadata, GraphSupport
from ..batch import ForwardMode
from ..config import AttentionLayer
from ..layout import MaskKind
from .triton_common import TritonBackendBase

ALL_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                       ForwardMode.DRAFT_EXTEND})


class TritonMLABackend(TritonBackendBase):
    name: ClassVar[str] = "triton_mla"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=ALL_MODES, mha=False, mla=True, page_sizes=(1, 16, 64), topk_gt1=True,
        graph=GraphSupport.UNIFORM_BATCH, devices=("cpu", "cuda"), requires=("triton",))

    def _programs(self, bs: int, width: int) -> int:
        w_pad = 1 << (max(width, 1) - 1).bit_length()
        block_h = max(min(self.config.num_q_heads, max(1, 64 // w_pad)), 16 // min(w_pad, 16))
        return bs * -(-self.config.num_q_heads // block_h)

    def _store_kv(self, layer: AttentionLayer, loc: torch.Tensor, k, v) -> None:
        r = self.config.kv_lora_rank
        store_mla_kv(k[..., :r], k[..., r:], self.memory.pool.kv[layer.layer_id], loc)

    def _run(self, q: torch.Tensor, layer: AttentionLayer, meta: ForwardMetadata) -> torch.Tensor:
        lay = meta.layout
        kv = self.memory.pool.kv[layer.layer_id]
        r = self.config.kv_lora_rank
        out = torch.empty(q.shape[0], q.shape[1], r, dtype=q.dtype, device=q.device)
        splits, ws = meta.extra["num_kv_splits"], meta.extra["workspace"]
        if lay.mode == ForwardMode.EXTEND or lay.mask == MaskKind.DRAFT:
            return extend_attention_fwd(
                q, kv, kv[..., :r], lay.page_table, lay.seq_lens_k, lay.cu_seqlens_q, lay.page_size,
                layer.scaling, lay.max_seq_len_q, out, mask=lay.mask.value,
                draft_prefix_lens=lay.draft_prefix_lens, num_kv_splits=splits, workspace=ws)
        return mla_attention_fwd(q, kv, lay.page_table, lay.seq_lens_k, lay.page_size, layer.scaling,
                                 splits, out, q_per_req=lay.width, mask=lay.mask.value,
                                 custom_mask=lay.custom_mask, workspace=ws)
