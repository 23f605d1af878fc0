"""``trtllm_mla``: the block-table layout of SGLang's TRT-LLM MLA backend, on every machine.

The metadata is the block table of the canonical layout: ``page_table [bs, pages]`` (the
reserved page 0 past a row's pages), ``seq_lens_k [bs]`` and, in TARGET_VERIFY and
DRAFT_EXTEND, the uniform stride: a uniform forward's queries are the view ``[bs, W, H, 576]``
of the runner's rows, with ``W`` from the GraphKey. No query indptr is built or read in a
uniform mode, so a packed ``cu_seqlens_q`` against strided rows (SGLang PR #21987)
cannot be expressed; ``cu_seqlens_q`` serves only ragged EXTEND.

Kernels: on SM100+ (with flashinfer installed, page size 32 or 64, bf16, latent 512 + rope 64,
``H <= 64`` or ``H == 128``) the causal uniform modes run FlashInfer's trtllm-gen MLA decode kernel
(``mla/_core.py`` ``trtllm_batch_decode_with_kv_cache_mla``: query ``[bs, W, H, 576]``,
block table, seq_lens, ``max_seq_len``, rows causal within the request); everything else, and
every mode on other machines (the CPU interpreter included), runs our Triton MLA kernel over the
same block table, so the metadata and the outputs are checked everywhere.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from ..base import Capabilities, ForwardMetadata, GraphSupport
from ..config import AttentionLayer
from ..layout import MaskKind
from .triton_mla import ALL_MODES, TritonMLABackend

TRTLLM_PAGE_SIZES = (32, 64)


def trtllm_gen_reason(config, memory) -> str:
    """Why the trtllm-gen kernel does not serve this model here ('' when it does)."""
    if memory.device.type != "cuda" or torch.cuda.get_device_capability(memory.device)[0] < 10:
        return "trtllm-gen needs SM100+"
    if memory.page_size not in TRTLLM_PAGE_SIZES:
        return f"trtllm-gen needs page_size in {TRTLLM_PAGE_SIZES}"
    if config.dtype != torch.bfloat16 or config.kv_lora_rank != 512 or config.qk_rope_head_dim != 64:
        return "trtllm-gen runs bf16 latent 512 + rope 64"
    if 64 < config.num_q_heads < 128:
        return "trtllm-gen does not run 64 < num_heads < 128"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return "flashinfer is not installed"
    return ""


class TrtllmMLABackend(TritonMLABackend):
    name: ClassVar[str] = "trtllm_mla"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=ALL_MODES, mha=False, mla=True, page_sizes=(1, 16, 64), topk_gt1=True,
        graph=GraphSupport.UNIFORM_BATCH, devices=("cpu", "cuda"), requires=("triton",))

    def __init__(self, config, memory) -> None:
        super().__init__(config, memory)
        self.trtllm_gen_off = trtllm_gen_reason(config, memory)   # '' : SM100 kernel on
        self._workspace = None

    def _run(self, q: torch.Tensor, layer: AttentionLayer, meta: ForwardMetadata) -> torch.Tensor:
        lay = meta.layout
        if lay.width:
            q = q.view(lay.bs, lay.width, q.shape[1], q.shape[2])          # [bs, W, H, 576]: the stride is W
            if not self.trtllm_gen_off and lay.mask == MaskKind.CAUSAL:
                return self._run_trtllm_gen(q, layer, meta)
            q = q.view(lay.bs * lay.width, q.shape[2], q.shape[3])
        return super()._run(q, layer, meta)

    def _run_trtllm_gen(self, q: torch.Tensor, layer: AttentionLayer, meta: ForwardMetadata) -> torch.Tensor:
        from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla

        from .flashinfer_common import float_workspace
        lay, c = meta.layout, self.config
        if self._workspace is None:   # zeroed and not shared with FlashInfer's fa2/fa3 wrappers (semaphores)
            self._workspace = float_workspace(self.memory, tag="trtllm-gen")
        kv, ps = self.memory.pool.kv[layer.layer_id], self.memory.page_size
        out = torch.empty(*q.shape[:3], c.kv_lora_rank, dtype=q.dtype, device=q.device)
        trtllm_batch_decode_with_kv_cache_mla(
            query=q, kv_cache=kv.view(kv.shape[0] // ps, ps, kv.shape[-1]), workspace_buffer=self._workspace,
            qk_nope_head_dim=c.qk_nope_head_dim, kv_lora_rank=c.kv_lora_rank, qk_rope_head_dim=c.qk_rope_head_dim,
            block_tables=lay.page_table, seq_lens=lay.seq_lens_k, max_seq_len=lay.max_seq_len_k, out=out,
            bmm1_scale=layer.scaling, bmm2_scale=1.0, backend="trtllm-gen")
        return out.view(-1, out.shape[2], out.shape[3])
