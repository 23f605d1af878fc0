"""``flashinfer``: MHA/GQA through FlashInfer's paged wrappers (``pip install 'attn-backends[flashinfer]'``).

=====================  =========================================================================
DECODE (W = 1)          ``BatchDecodeWithPagedKVCacheWrapper``; tensor cores (the prefill kernels)
                        from a GQA group of ``TENSOR_CORE_MIN_GROUP`` query heads per KV head up
TARGET_VERIFY chain,    ``BatchPrefillWithPagedKVCacheWrapper``, causal (bottom-right: row ``j``
DRAFT_EXTEND, EXTEND    of a request sees ``p <= prefix + j``), ``uniform_q_len = W`` in graphs
tree verify,            the same wrapper with a packed custom mask (``kernels/mask_pack.py``);
draft decode topk > 1   the fa2 kernels: fa3 (SM90) rejects custom masks
=====================  =========================================================================

Every wrapper is fa2 and reads the KV pool as NHD pages (``[pages, page_size, Hkv, D]`` views of
the pool, no copy) and the step's ``kv_indices``. A graph wrapper (one per GraphKey and
step, shared by every layer) owns ``qo_indptr``, ``kv_indptr``, ``kv_last_page_len`` and,
with a mask, the packed mask and ``mask_indptr``; ``plan()`` rewrites all of them from host
copies on every replay (:class:`flashinfer_common.HostPlan`), and the mask is packed on the
device from the step's ``custom_mask`` / ``draft_prefix_lens``.
"""
from __future__ import annotations

from typing import ClassVar, Optional

import torch

from attn_backends_kernels.mask_pack import pack_uniform_mask, packed_mask_bytes

from ..base import Capabilities, GraphSupport
from ..batch import ForwardMode, GraphKey
from ..layout import Layout
from .flashinfer_common import I32, FlashInferBase, HostPlan, float_workspace

ALL_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                       ForwardMode.DRAFT_EXTEND})
TENSOR_CORE_MIN_GROUP = 4      # GQA group from which tensor-core decode is faster (bf16/fp16)


class _Call:
    """One FlashInfer wrapper and the buffers it reads (graph mode: ours, fixed)."""

    def __init__(self, backend: "FlashInferBackend", key: Optional[GraphKey], indices) -> None:
        self.cfg, self.memory = backend.config, backend.memory
        self.graph = key is not None
        self.buffers: dict = {}
        dev = self.memory.device
        if self.graph:
            z = lambda n: torch.zeros(n, dtype=I32, device=dev)  # noqa: E731
            self.buffers = {"qo_indptr": z(key.bs + 1), "kv_indptr": z(key.bs + 1), "kv_last_page_len": z(key.bs)}

    def kv_pages(self, layer_id: int):
        pool, ps = self.memory.pool, self.memory.page_size
        k, v = pool.k[layer_id], pool.v[layer_id]
        return (k.view(k.shape[0] // ps, ps, *k.shape[1:]), v.view(v.shape[0] // ps, ps, *v.shape[1:]))

    def run(self, q: torch.Tensor, layer) -> torch.Tensor:
        out = torch.empty(q.shape[0], q.shape[1], self.cfg.v_head_dim, dtype=q.dtype, device=q.device)
        return self.wrapper.run(q, self.kv_pages(layer.layer_id), out=out)

    def _dtypes(self) -> dict:
        c = self.cfg
        return dict(pos_encoding_mode="NONE", q_data_type=c.dtype, kv_data_type=c.dtype, sm_scale=c.sm_scale,
                    non_blocking=True)


class DecodeCall(_Call):
    """W = 1 rows: ``BatchDecodeWithPagedKVCacheWrapper`` (decode.py ``__init__``, ``plan`` ->
    ``_plan_impl``, ``run`` of flashinfer 0.7.2.post1)."""

    def __init__(self, backend, key, indices) -> None:
        super().__init__(backend, key, indices)
        c = self.cfg
        self.tensor_cores = c.num_q_heads // c.num_kv_heads >= TENSOR_CORE_MIN_GROUP
        kw = dict(use_tensor_cores=self.tensor_cores, backend="fa2")
        if self.graph:
            b = self.buffers
            del b["qo_indptr"]          # the decode wrapper keeps its own arange(bs+1)
            kw.update(use_cuda_graph=True, paged_kv_indptr_buffer=b["kv_indptr"],
                      paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=b["kv_last_page_len"])
        self.wrapper = backend.fi.BatchDecodeWithPagedKVCacheWrapper(float_workspace(self.memory), "NHD", **kw)

    def plan(self, layout: Layout, host: HostPlan) -> None:
        c = self.cfg
        self.wrapper.plan(host.kv_indptr, layout.kv_indices, host.kv_last_page_len, c.num_q_heads, c.num_kv_heads,
                          c.head_dim, layout.page_size, q_len_per_req=1, **self._dtypes())


class PrefillCall(_Call):
    """Causal rows, or a packed custom mask: ``BatchPrefillWithPagedKVCacheWrapper``
    (prefill.py ``__init__``, ``plan``, ``run`` of flashinfer 0.7.2.post1), fa2."""

    def __init__(self, backend, key, indices, masked: bool) -> None:
        super().__init__(backend, key, indices)
        if masked and not self.graph:
            raise ValueError("a masked FlashInfer call needs the graph form (a uniform batch)")
        self.masked = masked
        kw = dict(backend="fa2")
        if self.graph:
            b = self.buffers
            if masked:                  # sparse blocks: W * sum(kv) <= W * bs * max_context_len bytes
                cap = packed_mask_bytes(key.width, key.bs * self.memory.max_context_len) + 8
                b["custom_mask"] = torch.zeros(cap, dtype=torch.uint8, device=self.memory.device)
                b["mask_indptr"] = torch.zeros(key.bs + 1, dtype=I32, device=self.memory.device)
                kw.update(custom_mask_buf=b["custom_mask"], mask_indptr_buf=b["mask_indptr"])
            kw.update(use_cuda_graph=True, qo_indptr_buf=b["qo_indptr"], paged_kv_indptr_buf=b["kv_indptr"],
                      paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=b["kv_last_page_len"])
        self.wrapper = backend.fi.BatchPrefillWithPagedKVCacheWrapper(float_workspace(self.memory), "NHD",
                                                                      **kw)

    def packed_mask(self, layout: Layout, host: HostPlan) -> torch.Tensor:
        """The step's mask, packed on the device into the fixed buffer (masks come with uniform
        modes only, which run the graph form, eagerly too)."""
        return pack_uniform_mask(layout.seq_lens_k, layout.width, host.max_kv, self.buffers["custom_mask"],
                                 tree_mask=layout.custom_mask, draft_prefix_lens=layout.draft_prefix_lens)

    def plan(self, layout: Layout, host: HostPlan) -> None:
        c = self.cfg
        kw = self._dtypes()
        if self.masked:
            kw["packed_custom_mask"] = self.packed_mask(layout, host)
        if self.graph and layout.width > 1:
            kw["uniform_q_len"] = layout.width       # read by the fa2 graph planner only
        self.wrapper.plan(host.qo_indptr, host.kv_indptr, layout.kv_indices, host.kv_last_page_len,
                          c.num_q_heads, c.num_kv_heads, c.head_dim, layout.page_size, head_dim_vo=c.v_head_dim,
                          causal=not self.masked, **kw)


class FlashInferBackend(FlashInferBase):
    name: ClassVar[str] = "flashinfer"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=ALL_MODES, mha=True, mla=False, page_sizes=(1, 16, 64), topk_gt1=True,
        graph=GraphSupport.UNIFORM_BATCH, devices=("cuda",), min_sm=80, head_dims=(64, 128, 256),
        requires=("flashinfer",), dtypes=(torch.float16, torch.bfloat16))

    def __init__(self, config, memory) -> None:
        if config.v_head_dim != config.head_dim:
            raise ValueError(f"backend flashinfer needs v_head_dim == head_dim, got {config.v_head_dim} "
                             f"and {config.head_dim}")
        super().__init__(config, memory)

    def _kind(self, layout: Layout) -> str:
        if layout.custom_mask is not None or layout.draft_prefix_lens is not None:
            return "masked"
        return "decode" if layout.mode == ForwardMode.DECODE and layout.width == 1 else "prefill"

    def _new_call(self, layout: Layout, key: Optional[GraphKey], indices):
        kind = self._kind(layout)
        if kind == "decode":
            return DecodeCall(self, key, indices)
        return PrefillCall(self, key, indices, masked=kind == "masked")
