"""``flashinfer_mla``: absorbed MLA through FlashInfer's ``BatchMLAPagedAttentionWrapper``
(``pip install 'attn-backends[flashinfer]'``), fa3 on SM90 and fa2 elsewhere.

DECODE (and draft decode with topk = 1), TARGET_VERIFY chain, DRAFT_EXTEND and EXTEND, over the
latent cache of ``triton_mla`` (``[slots, 1, 512 + 64]``, read as ``[pages, page_size, 576]``
without a copy) and the step's ``kv_indices``; W > 1 rows are causal (bottom-right). The
wrapper takes no custom mask: tree verify and multi-branch draft decode are refused
(``Capabilities.cannot``). Calls follow flashinfer 0.7.2.post1 ``mla/_batch_mla/_wrapper.py``
(``__init__`` graph buffers ``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_len_arr``;
``plan(metadata=MLAPlanMetadata.csr(...))`` with host CSR copies, packed query and cache;
``run(query=, kv_cache=, out=)``). A graph wrapper's buffers are the step layout's
(``cu_seqlens_q``, ``kv_indptr``, ``kv_indices``, ``seq_lens_k``): the capture's full plan
stages the host metadata into them (``_fa_common._stage_metadata``, the same values the prep
wrote); a replay reruns the scheduler alone (:meth:`MLACall.replan`).

An FP8 cache: FlashInfer's fa2/fa3 MLA reads float8_e4m3fn with a bfloat16 query on SM90 alone
(``_fa_common._validate_generated_fa_plan``; e5m2, an fp16 model and other GPUs are refused here
with the reason). ``plan(kv_data_type=, scale_mode="kv-per-tensor")`` and ``run(ckv_scale=,
kpe_scale=)``: the kernel widens each KV tile to bf16 and multiplies it by the scale rounded to
bf16 (``mla_hopper.cuh`` / ``mla.cuh`` ``repack_fp8_kv_to_bf16``), before both products.
"""
from __future__ import annotations

from typing import ClassVar, Optional

import torch

from ..base import Capabilities, GraphSupport
from ..batch import ForwardMode, GraphKey
from ..config import FP8_KV
from ..layout import Layout
from .flashinfer_common import I32, FlashInferBase, HostPlan, float_workspace

MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND})


def mla_backend_for(device: torch.device) -> str:
    """fa3 on SM90 (Hopper), fa2 elsewhere."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        return "fa3"
    return "fa2"


class MLACall:
    """One ``BatchMLAPagedAttentionWrapper``. Graph form: bound to the step's layout (its
    ``cu_seqlens_q``, ``kv_indptr``, ``kv_indices``, ``seq_lens_k``) or, for an eager batch,
    buffers of its own (``buffers``)."""

    def __init__(self, backend: "FlashInferMLABackend", layout: Layout, key: Optional[GraphKey], indices,
                 bound: bool) -> None:
        self.cfg, self.memory, self.fi = backend.config, backend.memory, backend.fi
        self.bound = bound and key is not None
        dev = self.memory.device
        self.buffers: dict = {}
        self.fp8 = self.cfg.cache_dtype in FP8_KV
        kw = dict(backend=mla_backend_for(dev))
        if self.bound:
            kw.update(use_cuda_graph=True, qo_indptr=layout.cu_seqlens_q, kv_indptr=layout.kv_indptr,
                      kv_indices=indices, kv_len_arr=layout.seq_lens_k)
        elif key is not None:
            z = lambda n: torch.zeros(n, dtype=I32, device=dev)  # noqa: E731
            b = self.buffers = {"qo_indptr": z(key.bs + 1), "kv_indptr": z(key.bs + 1), "kv_len_arr": z(key.bs)}
            kw.update(use_cuda_graph=True, qo_indptr=b["qo_indptr"], kv_indptr=b["kv_indptr"],
                      kv_indices=indices, kv_len_arr=b["kv_len_arr"])
        self.wrapper = self.fi.mla.BatchMLAPagedAttentionWrapper(float_workspace(self.memory), **kw)

    def plan(self, layout: Layout, host: HostPlan) -> None:
        c = self.cfg
        meta = self.fi.mla.MLAPlanMetadata.csr(host.qo_indptr, host.kv_indptr, layout.kv_indices, host.kv_lens)
        self.wrapper.plan(metadata=meta, num_heads=c.num_q_heads, head_dim_ckv=c.kv_lora_rank,
                          head_dim_kpe=c.qk_rope_head_dim, page_size=layout.page_size,
                          causal=layout.max_seq_len_q > 1, sm_scale=c.sm_scale, q_data_type=c.dtype,
                          kv_data_type=c.cache_dtype, scale_mode="kv-per-tensor" if self.fp8 else "default")
        self.causal = layout.max_seq_len_q > 1

    def light_ok(self, host: HostPlan) -> bool:
        """The checks the full plan makes per batch hold for every batch of the key: its work
        items (_fa_plan_work_count) are at most the SMs plus the query tiles (each request's KV
        cut at a limit >= the average per cluster), tiles fixed by (bs, W, heads); the causal
        tile check passes for any lengths when a tile holds whole head groups (power-of-two
        heads <= 128, the constructor's rule); KV lengths stay within int32 arithmetic."""
        from flashinfer.mla._batch_mla._backends import _fa_common as fa
        h, bs = self.cfg.num_q_heads, host.bs
        w = int(host.qo_indptr[1] - host.qo_indptr[0])
        tile = 128 if w * h > 64 else 64
        tiles = bs * -(-w * h // tile)
        sms = fa.get_device_sm_count(self.memory.device)
        return sms + tiles <= fa._FA_MAX_WORK_ITEMS and tile % h == 0 and 2 * host.max_kv + 256 < 2 ** 31

    def replan(self, layout: Layout, host: HostPlan) -> None:
        """``_plan_generated_fa``'s scheduler call alone: the kernel reads the plan's copies of the
        CSR arrays in the int workspace and ``kv_indices`` from the layout, so the staging copies
        (and snapshots) of the bound buffers are not needed."""
        pb = self.wrapper._planned_backend
        args = (pb._float_workspace_buffer, pb._int_workspace_buffer, pb._pin_memory_int_workspace_buffer,
                host.qo_indptr, host.kv_indptr, host.kv_lens, self.cfg.num_q_heads, self.cfg.kv_lora_rank,
                self.causal)
        pb._plan_info, pb._staged_int_workspace_bytes = pb._cached_module.plan_with_staged_workspace_bytes(*args)
        self.wrapper._plan_info = pb._plan_info

    def run(self, q: torch.Tensor, pages, layer) -> torch.Tensor:
        k_scale = layer.k_scale
        if not self.fp8:
            if k_scale != 1.0:          # a hand-made layer's scale on a cache of the model's dtype: not dropped
                raise ValueError(f"flashinfer_mla: k_scale {k_scale} on a {self.cfg.cache_dtype} cache (FP8 alone)")
            return self.wrapper.run(query=q, kv_cache=pages)     # its own output: cheaper than ours on the host
        # the latent is K and V under the layer's one scale (AttentionLayer: k == v): latent and rope by it
        return self.wrapper.run(query=q, kv_cache=pages, ckv_scale=k_scale, kpe_scale=k_scale)


class FlashInferMLABackend(FlashInferBase):
    name: ClassVar[str] = "flashinfer_mla"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=MODES, mha=False, mla=True, page_sizes=(1, 16, 64), topk_gt1=False,
        graph=GraphSupport.UNIFORM_BATCH, devices=("cuda",), min_sm=80, head_dims=(576,),
        requires=("flashinfer",), dtypes=(torch.float16, torch.bfloat16),
        kv_dtypes=(torch.float8_e4m3fn,), fp8_min_sm=90, fp8_below_sm=100,   # FlashInfer's MLA: e4m3 with a
        fp8_model_dtypes=(torch.bfloat16,),                                   # bf16 query on sm_90 alone
        cannot="tree verify and multi-branch draft decode need a custom mask, which "
               "BatchMLAPagedAttentionWrapper does not take")

    def __init__(self, config, memory) -> None:
        if config.kv_lora_rank != 512 or config.qk_rope_head_dim != 64:
            raise ValueError(f"backend flashinfer_mla runs latent 512 + rope 64, got {config.kv_lora_rank} + "
                             f"{config.qk_rope_head_dim}")
        h = config.num_q_heads
        if h & (h - 1) or h > 128:
            # fa2/fa3 refuse causal tiles that split a head group (_fa_common._validate_fa_causal_tile_bound)
            raise ValueError(f"backend flashinfer_mla needs a power-of-two num_q_heads <= 128, got {h}")
        super().__init__(config, memory)

    eager_as_graph: ClassVar[bool] = False    # the MLA planner does not look at the graph flag

    def _kind(self, layout: Layout) -> str:
        return "mla"

    def _new_call(self, layout: Layout, key: Optional[GraphKey], indices, bound: bool = False, variant=None):
        return MLACall(self, layout, key, indices, bound)

    def _kv_pages(self, layer_id: int):
        kv = self.memory.pool.kv[layer_id]
        hit = self._pages.get(layer_id)
        if hit is None or hit[0] is not kv:
            ps = self.memory.page_size
            hit = self._pages[layer_id] = (kv, kv.view(kv.shape[0] // ps, ps, kv.shape[-1]))  # [pages, ps, 576]
        return hit[1]
