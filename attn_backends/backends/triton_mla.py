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
from . import triton_common
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
        if w_pad == 1:   # decode: 64-head tiles from 64 heads, else 16-head tiles (``_tile_config``)
            return bs * -(-self.config.num_q_heads // (64 if self.config.num_q_heads >= 64 else 16))
        block_h = max(min(self.config.num_q_heads, max(1, 64 // w_pad)), 16 // min(w_pad, 16))
        return bs * -(-self.config.num_q_heads // block_h)

    # Verify: two 64-token tiles a split where that leaves a quarter of the SMs a program. H200,
    # graph replay, MLA16 verify4 kv 2048 (32 pages of 64): bs 4 32 splits (a tile each) 22.2 us
    # -> 16 19.3; bs 1 keeps 32 (16 programs at 16: 15.6 -> 16.7); at kv 8192 and 32768, and at
    # bs >= 16, the count is below the pages anyway.
    SPLIT_TOKENS: ClassVar[int] = 128

    def _split_rule(self, width: int) -> tuple:
        # decode on the Triton kernel: two 16-head programs per SM, one 64-head program (>= 64
        # heads); verify: one. (Decode on the transposed kernel: ``_swap_splits``.)
        return (2 if width <= 1 and self.config.num_q_heads < 64 else 1), 1, None

    def _splits(self, lay) -> int:
        # uniform causal decode rows: what the wrapper's default runs on the transposed kernel
        decode = lay.mode != ForwardMode.EXTEND and (lay.width or 1) <= 1 and lay.mask.value == "causal"
        swap = self._swap_splits(lay.bs, 1) if decode else None
        return swap if swap is not None else super()._splits(lay)

    def _swap_splits(self, bs: int, width: int):
        """The split count of a decode batch of ``bs`` requests where it runs on the transposed
        kernel (``mla_swap``: 16-head tiles, where ``decodes_transposed``; the wrapper's default
        takes it there), None where it runs on the Triton kernel. A function of (bs, W). (A q
        whose strides the kernel refuses runs on the Triton kernel at this count.)

        The transposed kernel holds a whole SM's shared memory: it takes one program an SM. H200,
        graph replay, MLA16 decode, us, the Triton kernel at two programs an SM -> this kernel at
        one (FlashInfer fa3): bs 16 kv 8192 59.7 -> 55.7 (56.7), bs 64 kv 2048 60.2 -> 55.7
        (55.9), bs 128 kv 8192 313.6 -> 291.3 (295.5); and where one an SM fills the SMs
        unevenly: bs 80 kv 8192 286.8 -> 242.4 (275.8), bs 96 kv 2048 88.3 -> 73.5 (90.6), bs
        140 kv 8192 (two waves) 793.3 -> 514.0 (524.2). Three splits there were faster still
        (bs 80: 198.1, bs 140: 378.3; bs 96 kv 2048: 93.4, slower): not taken, measured at
        these points only."""
        key = ("swap", bs, width)
        cache = self._split_cache
        if key not in cache:
            cache[key] = None
            if width <= 1 and self.config.num_q_heads < 64 and self._decodes_transposed():
                max_pages = -(-self.memory.max_context_len // self.memory.page_size)
                cache[key] = triton_common.choose_num_kv_splits(   # (the module's: bench/probe_launch.py patches it)
                    self._programs(bs, 1), self.memory.device, max_pages, 1)
        return cache[key]

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
