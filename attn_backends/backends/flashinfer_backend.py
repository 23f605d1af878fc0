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
the pool, no copy) and the step's ``kv_indices``. A graph wrapper (one per GraphKey, step and plan
variant, shared by every layer of the variant) reads the step layout's ``cu_seqlens_q``, ``kv_indptr``,
``kv_indices`` and ``kv_last_page_len``, which the step's prep writes on the device (a sliding
layer's: the window layout's ``kv_indptr`` and ``kv_indices``, derived before its plan), and owns,
with a mask, the packed mask and ``mask_indptr``. Capture runs ``plan()``; a replay runs
``replan()``, the scheduler call of ``plan()`` alone on the step's host lengths
(:class:`flashinfer_common.HostPlan`), after packing the mask on the device from the step's
``custom_mask`` / ``draft_prefix_lens`` and copying its offsets. An eager uniform batch runs a
graph-form wrapper on buffers of its own, planned in full.

Windows, softcap and sinks (``AttentionLayer``; torch_native defines them) are fixed at plan time,
so a step plans one wrapper per ``(window_left, logits_soft_cap, sinks)`` its model's layers use
(full and sliding layers: two). ``window_left = window - 1``: FlashInfer keeps key ``kv`` of query row ``qo`` when
``kv + qo_len + window_left >= kv_len + qo`` (``variants.cuh`` ``DefaultAttention``), a row at
``kv_len - qo_len + qo``: its absolute position in decode, extend, chain verify and draft extend,
not in tree verify (a draft token sits at its depth) nor in multi-branch draft decode (at its step),
which are refused for windowed layers. The cap: ``tanh(q.k * sm_scale / cap)`` scaled by ``cap`` in
the softmax, the cap on the scaled score as torch_native's. Sinks: ``run(sinks=)`` is dropped on the
fa2 route (``prefill.py`` ``paged_run``) and the CUDA-core decode takes none, so a model with sinks
runs every mode but the masked ones on ``BatchAttentionWithAttentionSinkWrapper`` (fa2 prefill
kernels with the ``AttentionSink`` JIT variant, ``jit/attention/variants.py``: the sink joins the
denominator, the same row window; it reads no custom mask and applies no cap: those are refused).
"""
from __future__ import annotations

from typing import ClassVar, Optional

import numpy as np
import torch

from attn_backends_kernels.mask_pack import pack_uniform_mask, packed_mask_bytes

from ..base import Capabilities, GraphSupport
from ..batch import ForwardMode, GraphKey
from ..config import FP8_KV
from ..layout import Layout
from .flashinfer_common import I32, FlashInferBase, HostPlan, float_workspace

ALL_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                       ForwardMode.DRAFT_EXTEND})
TENSOR_CORE_MIN_GROUP = 4      # GQA group from which tensor-core decode is faster (bf16/fp16)
ROWS_NOT_DEPTH = ("FlashInfer's window counts query rows (kv_len - qo_len + row, variants.cuh), "
                  "not a draft token's tree depth or draft step")
SINK_NO_MASK = ("FlashInfer's sink variant (BatchAttentionWithAttentionSinkWrapper, AttentionSink in "
                "jit/attention/variants.py) reads no custom mask")
SINK_NO_CAP = ("FlashInfer's sink variant applies no logits transform, and its plain fa2 kernels drop "
               "run(sinks=) (prefill.py paged_run)")


class _Call:
    """One FlashInfer wrapper and the buffers it reads. Graph form: bound to the step's layout (a
    sliding variant: the step's window layout, ``window_layout.step_window_layout``)
    (``bound``: its ``cu_seqlens_q``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``, which
    the step's prep writes on the device) or, for an eager batch, buffers of its own.
    ``buffers``: the fixed buffers the call owns (``graph_buffers`` lists them)."""

    def __init__(self, backend: "FlashInferBackend", layout: Layout, key: Optional[GraphKey], indices,
                 bound: bool, variant: tuple) -> None:
        self.cfg, self.memory = backend.config, backend.memory
        self.window_left, self.softcap, self.sinks = variant    # fixed at plan(): one wrapper per variant
        self.graph, self.bound = key is not None, bound and key is not None
        self.buffers: dict = {}
        self.reads: dict = {}
        dev = self.memory.device
        if self.bound:
            self.reads = {"qo_indptr": layout.cu_seqlens_q, "kv_indptr": layout.kv_indptr,
                          "kv_last_page_len": layout.kv_last_page_len}
        elif self.graph:
            z = lambda n: torch.zeros(n, dtype=I32, device=dev)  # noqa: E731
            self.buffers = {"qo_indptr": z(key.bs + 1), "kv_indptr": z(key.bs + 1), "kv_last_page_len": z(key.bs)}
            self.reads = dict(self.buffers)

    def run(self, q: torch.Tensor, pages, layer) -> torch.Tensor:
        shape = q.shape                  # torch.empty with dtype and device: cheaper than new_empty on the host
        out = torch.empty(shape[0], shape[1], self.cfg.v_head_dim, dtype=self.cfg.dtype, device=self.memory.device)
        # the sink variant's JIT tensor argument, after the pages: [H] float32 logits
        sink = (layer.sinks.to(q.device, torch.float32),) if self.sinks else ()
        k_scale, v_scale = layer.k_scale, layer.v_scale
        if k_scale == 1.0 and v_scale == 1.0:
            return self.wrapper.run(q, pages, *sink, out=out)
        # an FP8 cache's scales: run() folds k_scale into sm_scale and multiplies out by v_scale
        return self.wrapper.run(q, pages, *sink, out=out, k_scale=k_scale, v_scale=v_scale)

    def light_ok(self, host: HostPlan) -> bool:
        """Whether replays may replan light (the checks the full plan made hold for the key)."""
        return True

    def _workspaces(self) -> tuple:
        w = self.wrapper
        return w._float_workspace_buffer, w._int_workspace_buffer, w._pin_memory_int_workspace_buffer

    def _dtypes(self) -> dict:
        c = self.cfg
        return dict(pos_encoding_mode="NONE", q_data_type=c.dtype, kv_data_type=c.cache_dtype, sm_scale=c.sm_scale,
                    window_left=self.window_left, logits_soft_cap=self.softcap, non_blocking=True)


class DecodeCall(_Call):
    """W = 1 rows: ``BatchDecodeWithPagedKVCacheWrapper`` (decode.py ``__init__``, ``plan`` ->
    ``_plan_impl``, ``run`` of flashinfer 0.7.2.post1)."""

    def __init__(self, backend, layout, key, indices, bound, variant) -> None:
        super().__init__(backend, layout, key, indices, bound, variant)
        c = self.cfg
        self.tensor_cores = c.num_q_heads // c.num_kv_heads >= TENSOR_CORE_MIN_GROUP
        kw = dict(use_tensor_cores=self.tensor_cores, backend="fa2")
        if self.graph:
            r = self.reads
            self.buffers.pop("qo_indptr", None)     # the decode wrapper keeps its own arange(bs+1)
            kw.update(use_cuda_graph=True, paged_kv_indptr_buffer=r["kv_indptr"],
                      paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=r["kv_last_page_len"])
        self.wrapper = backend.fi.BatchDecodeWithPagedKVCacheWrapper(float_workspace(self.memory), "NHD", **kw)
        self._empty = (torch.empty(0, dtype=c.dtype), torch.empty(0, dtype=c.cache_dtype))  # plan's dtype tags

    def plan(self, layout: Layout, host: HostPlan) -> None:
        c = self.cfg
        self.wrapper.plan(host.kv_indptr, layout.kv_indices, host.kv_last_page_len, c.num_q_heads, c.num_kv_heads,
                          c.head_dim, layout.page_size, q_len_per_req=1, **self._dtypes())

    def replan(self, layout: Layout, host: HostPlan) -> None:
        """``_plan_impl``'s scheduler call alone, with the arguments it passes in graph mode."""
        c, w, bs = self.cfg, self.wrapper, host.bs
        heads = (c.num_q_heads, c.num_kv_heads, layout.page_size, True)
        if self.tensor_cores:
            w._plan_info = w._cached_module.plan(*self._workspaces(), host.qo_indptr, host.kv_indptr, host.kv_lens,
                                                 bs, bs, *heads, c.head_dim, c.head_dim, False, self.window_left, -1,
                                                 False, 0, 0)
            w._max_kv_len = host.longest
        else:
            w._plan_info = w._cached_module.plan(*self._workspaces(), host.kv_indptr, bs, *heads, self.window_left,
                                                 self.softcap, c.head_dim, c.head_dim, *self._empty)


class PrefillCall(_Call):
    """Causal rows, or a packed custom mask: ``BatchPrefillWithPagedKVCacheWrapper``
    (prefill.py ``__init__``, ``plan``, ``run`` of flashinfer 0.7.2.post1), fa2."""

    def __init__(self, backend, layout, key, indices, bound, variant, masked: bool) -> None:
        super().__init__(backend, layout, key, indices, bound, variant)
        if masked and not self.graph:
            raise ValueError("a masked FlashInfer call needs the graph form (a uniform batch)")
        self.masked = masked
        kw = dict(backend="fa2")
        if self.graph:
            b, r = self.buffers, self.reads
            if masked:                  # sparse blocks: W * sum(kv) <= W * bs * max_context_len bytes
                cap = packed_mask_bytes(key.width, key.bs * self.memory.max_context_len) + 8
                b["custom_mask"] = torch.zeros(cap, dtype=torch.uint8, device=self.memory.device)
                b["mask_indptr"] = torch.zeros(key.bs + 1, dtype=I32, device=self.memory.device)
                kw.update(custom_mask_buf=b["custom_mask"], mask_indptr_buf=b["mask_indptr"])
            kw.update(use_cuda_graph=True, qo_indptr_buf=r["qo_indptr"], paged_kv_indptr_buf=r["kv_indptr"],
                      paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=r["kv_last_page_len"])
        wrapper = backend.fi.BatchPrefillWithPagedKVCacheWrapper
        if self.sinks:          # the AttentionSink JIT variant, built for the dtypes, head dims and window
            c = self.cfg
            wrapper = backend.fi.BatchAttentionWithAttentionSinkWrapper
            kw.update(q_data_type=c.dtype, kv_data_type=c.cache_dtype, head_dim_qk=c.head_dim,
                      head_dim_vo=c.v_head_dim, window_left=self.window_left)
        self.wrapper = wrapper(float_workspace(self.memory), "NHD", **kw)

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

    def replan(self, layout: Layout, host: HostPlan) -> None:
        """``plan``'s scheduler call alone (fa2, graph mode), after the mask: packed on the device
        into the wrapper's buffer, its byte offsets ``cumsum(q_len * kv_len)`` from the host lengths
        (``_compute_page_mask_indptr``) copied once."""
        c, w, bs = self.cfg, self.wrapper, host.bs
        if self.masked:
            self.packed_mask(layout, host)
            q = (host.qo_indptr[1:] - host.qo_indptr[:-1]).numpy().astype(np.int64)
            offsets = np.zeros(bs + 1, dtype=np.int32)
            np.cumsum(q * host.kv_lens.numpy(), out=offsets[1:])
            self.buffers["mask_indptr"].copy_(torch.from_numpy(offsets), non_blocking=True)
        w._plan_info = w._cached_module.plan(
            *self._workspaces(), host.qo_indptr, host.kv_indptr, host.kv_lens, w._max_total_num_rows, bs,
            c.num_q_heads, c.num_kv_heads, layout.page_size, True, c.head_dim, c.v_head_dim, not self.masked,
            self.window_left, -1, False, 0, layout.width if layout.width > 1 else 0)
        w._max_kv_len = host.longest


class FlashInferBackend(FlashInferBase):
    name: ClassVar[str] = "flashinfer"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=ALL_MODES, mha=True, mla=False, page_sizes=(1, 16, 64), topk_gt1=True,
        graph=GraphSupport.UNIFORM_BATCH, devices=("cuda",), min_sm=80, head_dims=(64, 128, 256),
        requires=("flashinfer",), dtypes=(torch.float16, torch.bfloat16), kv_dtypes=FP8_KV, windows=True,
        sinks=True, softcap=True, topk_gt1_features=("softcap",), apart=(("sinks", "softcap"),),
        why_not=(("windows", ROWS_NOT_DEPTH), ("sinks", SINK_NO_MASK), ("sinks+softcap", SINK_NO_CAP)))

    def __init__(self, config, memory) -> None:
        if config.v_head_dim != config.head_dim:
            raise ValueError(f"backend flashinfer needs v_head_dim == head_dim, got {config.v_head_dim} "
                             f"and {config.head_dim}")
        if config.sinks and config.logit_softcap is not None:     # the sink variant would drop the cap
            raise ValueError(f"backend {self.name}: attention sinks with logit softcapping (c={config.logit_softcap}) "
                             f"not supported: {SINK_NO_CAP}")
        super().__init__(config, memory)

    def _window(self, variant, layout: Layout) -> Optional[int]:
        # masked layouts plan no window (refused: rows, not depth), and the host skip assumes rows at kv_len - q_len
        return None if variant[0] < 0 or self._kind(layout) == "masked" else variant[0] + 1

    def _kind(self, layout: Layout) -> str:
        if layout.custom_mask is not None or layout.draft_prefix_lens is not None:
            return "masked"
        return "decode" if layout.mode == ForwardMode.DECODE and layout.width == 1 else "prefill"

    def _variants(self, layout: Layout) -> tuple:
        """``(window_left, logits_soft_cap, sinks)`` of each kind of layer the model has (-1, 0.0,
        False: none); a masked layout plans neither window nor sinks (:meth:`_variant` refuses them)."""
        c = self.config
        cap = float(c.logit_softcap or 0.0)
        if self._kind(layout) == "masked":
            return ((-1, cap, False),)
        return tuple(dict.fromkeys((-1 if w is None else w - 1, cap, c.sinks)
                                   for w in map(c.window, range(c.num_layers))))

    PLAIN_VARIANT = (-1, 0.0, False)

    def _variant(self, layer, layout: Layout) -> tuple:
        if (layer.window is not None or layer.sinks is not None) and self._kind(layout) == "masked":
            what, why = (f"window={layer.window}", ROWS_NOT_DEPTH) if layer.window else ("sinks", SINK_NO_MASK)
            raise ValueError(f"backend {self.name}: layer {layer.layer_id} {what} in {layout.mode.name} with "
                             f"topk > 1 not supported: {why}")
        return (-1 if layer.window is None else layer.window - 1, float(layer.softcap or 0.0), layer.sinks is not None)

    def _new_call(self, layout: Layout, key: Optional[GraphKey], indices, bound: bool = False,
                  variant=PLAIN_VARIANT):
        kind = self._kind(layout)
        if kind == "decode" and not variant[2]:      # sinks: the prefill kernels' sink variant, W = 1
            return DecodeCall(self, layout, key, indices, bound, variant)
        return PrefillCall(self, layout, key, indices, bound, variant, masked=kind == "masked")

    def _kv_pages(self, layer_id: int):
        pool = self.memory.pool
        k, v = pool.k[layer_id], pool.v[layer_id]
        hit = self._pages.get(layer_id)
        if hit is None or hit[0] is not k or hit[1] is not v:
            ps = self.memory.page_size
            hit = self._pages[layer_id] = (k, v, (k.view(k.shape[0] // ps, ps, *k.shape[1:]),
                                                  v.view(v.shape[0] // ps, ps, *v.shape[1:])))
        return hit[2]
