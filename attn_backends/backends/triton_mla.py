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
    # The transposed decode kernel's programs (one an SM) must fill this much of the SMs in one wave.
    SWAP_FILL: ClassVar[float] = 0.9

    def _split_rule(self, width: int) -> tuple:
        # decode on the Triton kernel: two 16-head programs per SM, one 64-head program (>= 64
        # heads); verify: one. (Decode on the transposed kernel: ``_swap_splits``.)
        return (2 if width <= 1 and self.config.num_q_heads < 64 else 1), 1, None

    def _splits(self, lay) -> int:
        swap = None if lay.mode == ForwardMode.EXTEND else self._swap_splits(lay.bs, lay.width or 1)
        return swap if swap is not None else super()._splits(lay)

    def _swap_splits(self, bs: int, width: int):
        """The split count of a decode batch of ``bs`` requests where it runs on the transposed
        kernel (``mla_swap``), None where it runs on the Triton kernel. A function of (bs, W).

        The transposed kernel holds a whole SM's shared memory, so it takes one program an SM
        (H200, graph replay, MLA16 decode, 2 an SM -> 1: bs 16 kv 8192 61.0 -> 55.7 us, bs 64
        kv 2048 62.4 -> 55.7, kv 8192 164.0 -> 159.3, bs 128 99.2 -> 87.4 and 299.0 -> 291.3);
        and runs where those programs fill at least ``SWAP_FILL`` of the SMs in one wave, or
        where the Triton kernel's count is the same (the 64 cap or the pages: bs 1 kv 8192 18.0
        -> 16.3 us, bs 4 kv 2048 15.5 -> 15.2). Elsewhere (bs 80: 80 programs; bs 140: two
        waves) the Triton kernel, whose two resident programs an SM balance an uneven grid."""
        key = ("swap", bs, width)
        cache = self._split_cache
        if key not in cache:
            cache[key] = None
            if width <= 1 and self.config.num_q_heads < 64 and self._decodes_transposed():
                device = self.memory.device
                programs, max_pages = self._programs(bs, 1), -(-self.memory.max_context_len // self.memory.page_size)
                choose = triton_common.choose_num_kv_splits      # (the module's: bench/probe_launch.py patches it)
                one, two = choose(programs, device, max_pages, 1), choose(programs, device, max_pages, 2)
                sms = triton_common.sm_count(device.index or 0)
                if programs * one <= sms and (one == two or programs * one >= self.SWAP_FILL * sms):
                    cache[key] = one
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
        kernel = None   # 16-head decode tiles: the kernel the split count was chosen for
        if not ragged and (lay.width or 1) <= 1 and self.config.num_q_heads < 64:
            kernel = "swap" if self._swap_splits(lay.bs, 1) is not None else "triton"
        mla_attention_fwd(q, kv[0], lay.page_table, lay.seq_lens_k, lay.page_size, layer.scaling,
                          splits, out, q_per_req=lay.width or 1, mask=lay.mask.value,
                          custom_mask=lay.custom_mask, workspace=ws,
                          cu_seqlens_q=lay.cu_seqlens_q if ragged else None,
                          max_q_len=lay.max_seq_len_q if ragged else None,
                          draft_prefix_lens=lay.draft_prefix_lens, kernel=kernel)
