"""Every FlashInfer (0.7.2.post1) configuration that can run a sweep row, on our data.

Each configuration is a :class:`FiCall`: which wrapper, its constructor, ``plan()`` and
``run()`` arguments, built from the same page tables as ours (our eager layout) and the
same KV pool (paged views of its storage, no copy). The real path hands the call to
FlashInfer; ``sweep_fi_emulate`` computes, in PyTorch, what those very arguments ask for
(the CPU check of this file). Arguments follow the wheel's sources (the numbers are lines
of flashinfer_python-0.7.2.post1):

* ``decode.py`` ``BatchDecodeWithPagedKVCacheWrapper.__init__`` (1211: ``use_cuda_graph``,
  ``use_tensor_cores``, ``paged_kv_*_buffer``, ``backend``), ``plan`` (1834; keywords go to
  ``_plan_impl`` 1975: ``pos_encoding_mode``, ``q_data_type``, ``kv_data_type``,
  ``sm_scale``, ``q_len_per_req``), ``run`` (2711: ``q``, ``paged_kv_cache`` tuple, ``out``).
* ``prefill.py`` ``BatchPrefillWithPagedKVCacheWrapper.__init__`` (2672: ``qo_indptr_buf``,
  ``paged_kv_*_buf``, ``custom_mask_buf``, ``mask_indptr_buf``, ``backend``), ``plan``
  (3215: ``custom_mask`` flattened per request over ``[q_len, kv_len]``, ``causal``,
  ``uniform_q_len``), ``run`` (4027).
* ``mla/_batch_mla/_wrapper.py`` ``BatchMLAPagedAttentionWrapper.__init__`` (246:
  ``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_len_arr`` graph buffers), ``plan``
  (410: ``metadata=MLAPlanMetadata.csr(...)``, packed query / KV layouts by default),
  ``run`` (852: ``query=`` packed ``[T, H, 576]``, ``kv_cache=`` packed
  ``[pages, page_size, 576]``; FA2/FA3 split them into strided views, and
  ``csrc/batch_mla_run.cu`` / ``batch_mla_sm90_run.cu`` read those strides: no copy).

Not swept (``NOT_SWEPT``, also in the JSON header): ``trtllm-gen``, ``cute-dsl``, MLA
``cutlass`` / ``xqa`` / ``cutile`` (kernels for other architectures than SM90), ``cudnn`` (an
extra package) and ``auto`` (it resolves to a configuration swept here).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

BF16 = torch.bfloat16
WORKSPACE_BYTES = 512 << 20

# name: (wrapper kind, constructor keywords)
CONFIGS = {
    "fi_decode": ("decode", dict(use_tensor_cores=False, backend="fa2")),
    "fi_decode_tc_fa2": ("decode", dict(use_tensor_cores=True, backend="fa2")),
    "fi_decode_tc_fa3": ("decode", dict(use_tensor_cores=True, backend="fa3")),
    "fi_prefill_fa2": ("prefill", dict(backend="fa2")),
    "fi_prefill_fa3": ("prefill", dict(backend="fa3")),
    "fi_mla_fa2": ("mla", dict(backend="fa2")),
    "fi_mla_fa3": ("mla", dict(backend="fa3")),
}
WRAPPERS = {"decode": "BatchDecodeWithPagedKVCacheWrapper",
            "prefill": "BatchPrefillWithPagedKVCacheWrapper",
            "mla": "BatchMLAPagedAttentionWrapper"}
NOT_SWEPT = {
    "trtllm-gen": "SM100/103/107 kernels (mla/_batch_mla/_backends/trtllm_gen_backend.py:175)",
    "cute-dsl": "Blackwell (SM100+) kernels (decode.py BatchDecodeWithPagedKVCacheWrapper docs)",
    "mla cutlass / xqa / cutile": "SM10x-11x / SM12x / SM100+ and SM12x (their _backends/*.py checks)",
    "cudnn": "needs the cuDNN frontend package, not among the wheels carried; auto takes it on SM100 only",
    "auto": "resolves to a swept configuration (decode: fa2; prefill: fa2 or fa3; MLA on SM90: fa3/fa2)",
}
# One small call per JIT module, built in parallel before the sweep (sweep.py --prewarm):
# the tensor-core decode shares the prefill modules; the tree row also builds packbits.
PREWARM = {"fi_decode": "gqa32_decode", "fi_prefill_fa2": "gqa32_tree8",
           "fi_prefill_fa3": "gqa32_verify4", "fi_mla_fa2": "mla16_verify4",
           "fi_mla_fa3": "mla16_verify4"}


def candidates(wl) -> list:
    return [c for c, (kind, _) in CONFIGS.items() if (kind == "mla") == (wl.family == "mla")]


def refusal(config: str, wl, sm: int) -> Optional[str]:
    """Why ``config`` cannot run ``wl`` (None: it can), with the source that says so."""
    kind, opts = CONFIGS[config]
    if wl.sinks:
        return ("the sink rows measure what sinks cost our kernels (issue #42: at most 5 %); "
                "FlashInfer's sink path is not swept")
    if opts.get("backend") == "fa3" and sm != 90:
        return f"fa3 kernels need SM90 (sm_{sm} here)"
    if kind == "decode" and not opts["use_tensor_cores"] and wl.heads // wl.kv_heads not in (1, 2, 3, 4, 8):
        return (f"the CUDA-core decode kernel is built for GQA groups 1, 2, 3, 4 and 8 (group "
                f"{wl.heads // wl.kv_heads} here: plan() raises in the generated dispatch)")
    if opts.get("backend") == "fa3" and wl.kv_dtype is not None:
        return ("fa3 (SM90) kernels read an FP8 KV cache with an FP8 query only (the JIT build for a "
                "bf16 query and an e4m3 cache fails)")
    if kind == "decode" and wl.mode == "tree":
        return "the decode wrapper takes no custom mask, a tree needs one"
    if kind == "decode" and wl.width > 1 and not opts["use_tensor_cores"]:
        return ("the CUDA-core decode kernel runs one query row per request "
                "(decode.py _plan_impl: q_len_per_req > 1 requires tensor-core decode)")
    if kind == "decode" and wl.width > 1 and opts["backend"] == "fa3":
        return ("q_len_per_req > 1 runs on the fa2 tensor-core backend only "
                "(decode.py _plan_impl raises NotImplementedError for fa3)")
    if kind == "prefill" and wl.mode == "tree" and opts["backend"] == "fa3":
        return ("fa3 (SM90) batch prefill kernels do not run MaskMode.CUSTOM (prefill.py __init__ on "
                "variant_owns_mask: cudaErrorNotSupported; flashinfer-ai/flashinfer#1981)")
    return None


@dataclass
class FiInputs:
    """A row in FlashInfer's terms (device tensors; CSR over pages, NHD paged views)."""

    bs: int
    width: int
    heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    page_size: int
    sm_scale: float
    qo_indptr: torch.Tensor          # [bs+1] int32
    kv_indptr: torch.Tensor          # [bs+1] int32, pages
    kv_indices: torch.Tensor         # [kv_indptr[-1]] int32, page ids
    kv_last_page_len: torch.Tensor   # [bs] int32
    kv_lens: torch.Tensor            # [bs] int32
    custom_mask: Optional[torch.Tensor]  # tree: [sum_i W*kv_i] bool, request i row-major [W, kv_i]
    q: torch.Tensor                  # [bs*W, H, qk_dim]
    paged_kv: object                 # GQA (k, v) [pages, ps, Hkv, D]; MLA [pages, ps, 576]
    kv_scales: tuple = (1.0, 1.0)    # (k, v): an FP8 cache holds value / scale
    window_left: int = -1            # a sliding window of w tokens: w - 1 (plan(window_left=))
    logits_soft_cap: float = 0.0     # plan(logits_soft_cap=): 0 is none

    @property
    def kv_dtype(self) -> torch.dtype:
        return (self.paged_kv[0] if isinstance(self.paged_kv, tuple) else self.paged_kv).dtype


def tree_custom_mask(tree: torch.Tensor, kv_lens: list, width: int) -> torch.Tensor:
    """FlashInfer's flattened mask from our ``[bs, W, W]`` tree masks: request ``i`` gives
    ``[W, kv_i]`` row-major, its prefix all visible, its last ``W`` columns the tree."""
    parts = []
    for i, kv in enumerate(kv_lens):
        m = torch.ones(width, kv, dtype=torch.bool, device=tree.device)
        m[:, kv - width:] = tree[i].to(torch.bool)
        parts.append(m.reshape(-1))
    return torch.cat(parts)


def fi_inputs(row, layout: dict) -> FiInputs:
    """From our eager layout (``forward_metadata.as_layout()``) and the row's KV pool."""
    wl, mem = row.wl, row.mem
    ps = wl.page_size
    kv_indptr = layout["kv_indptr"]
    nnz = int(kv_indptr[-1])
    last = layout["kv_last_page_len"]
    kv_lens = layout["seq_lens_k"]
    # FlashInfer derives each length from the pages and the last page (get_seq_lens).
    derived = (kv_indptr[1:] - kv_indptr[:-1] - 1) * ps + last
    if not torch.equal(derived, kv_lens):
        raise AssertionError(f"kv_indptr/last_page_len give {derived.tolist()}, seq_lens_k {kv_lens.tolist()}")
    mask = None
    if wl.mode == "tree":
        mask = tree_custom_mask(row.batch.spec_info.tree_mask, kv_lens.tolist(), wl.width)
        if mask.numel() != wl.width * int(kv_lens.sum()):
            raise AssertionError("custom mask size != sum(q_len * kv_len)")
    num_pages = mem.num_slots // ps
    if wl.family == "mla":
        paged = mem.pool.kv[0].view(num_pages, ps, wl.qk_dim)
    else:
        paged = (mem.pool.k[0].view(num_pages, ps, wl.kv_heads, wl.qk_dim),
                 mem.pool.v[0].view(num_pages, ps, wl.kv_heads, wl.v_dim))
    layer = row.layer
    return FiInputs(row.bs, wl.width, wl.heads, wl.kv_heads, wl.qk_dim, wl.v_dim, ps,
                    layer.scaling, layout["cu_seqlens_q"], kv_indptr,
                    layout["kv_indices"][:nnz].contiguous(), last, kv_lens, mask, row.q, paged,
                    (layer.k_scale, layer.v_scale), (layer.window or 0) - 1, layer.softcap or 0.0)


@dataclass
class FiCall:
    kind: str            # "decode" | "prefill" | "mla"
    ctor: dict           # constructor keywords after the float workspace
    plan_args: tuple
    plan_kwargs: dict    # MLA: "metadata" holds the 4 CSR tensors (MLAPlanMetadata.csr)
    run_args: tuple
    run_kwargs: dict

    @property
    def wrapper(self) -> str:
        return WRAPPERS[self.kind]


def _out(inp: FiInputs) -> torch.Tensor:
    return torch.empty(inp.bs * inp.width, inp.heads, inp.v_dim, dtype=inp.q.dtype, device=inp.q.device)


def call_spec(config: str, inp: FiInputs) -> FiCall:
    """The eager call of ``config`` on ``inp`` (``graph_call`` adds the fixed buffers)."""
    kind, opts = CONFIGS[config]
    dtypes = dict(q_data_type=inp.q.dtype, kv_data_type=inp.kv_dtype, sm_scale=inp.sm_scale)
    if kind != "mla" and inp.window_left >= 0:
        dtypes["window_left"] = inp.window_left
    if kind != "mla" and inp.logits_soft_cap > 0:
        dtypes["logits_soft_cap"] = inp.logits_soft_cap
    # run(k_scale=, v_scale=): an FP8 cache's per-tensor scales (decode.py / prefill.py run)
    scales = dict(k_scale=inp.kv_scales[0], v_scale=inp.kv_scales[1]) if inp.kv_scales != (1.0, 1.0) else {}
    out = _out(inp)
    if kind == "mla":
        meta = (inp.qo_indptr, inp.kv_indptr, inp.kv_indices, inp.kv_lens)
        plan_kw = dict(metadata=meta, num_heads=inp.heads, head_dim_ckv=inp.v_dim,
                       head_dim_kpe=inp.qk_dim - inp.v_dim, page_size=inp.page_size,
                       causal=inp.width > 1, **dtypes)
        return FiCall(kind, dict(opts), (), plan_kw, (), dict(query=inp.q, kv_cache=inp.paged_kv, out=out))
    geometry = (inp.heads, inp.kv_heads, inp.qk_dim, inp.page_size)
    if kind == "decode":
        args = (inp.kv_indptr, inp.kv_indices, inp.kv_last_page_len) + geometry
        plan_kw = dict(pos_encoding_mode="NONE", q_len_per_req=inp.width, **dtypes)
    else:
        args = (inp.qo_indptr, inp.kv_indptr, inp.kv_indices, inp.kv_last_page_len) + geometry
        plan_kw = dict(pos_encoding_mode="NONE", causal=inp.width > 1 and inp.custom_mask is None,
                       **dtypes)
        if inp.custom_mask is not None:
            plan_kw["custom_mask"] = inp.custom_mask
        if inp.width > 1:
            plan_kw["uniform_q_len"] = inp.width      # read by the fa2 CUDA-graph planner only
    return FiCall(kind, dict(kv_layout="NHD", **opts), args, plan_kw, (inp.q, inp.paged_kv), dict(out=out, **scales))


def graph_call(call: FiCall, inp: FiInputs) -> FiCall:
    """``call`` with ``use_cuda_graph=True`` and fixed metadata buffers of its own."""
    e = torch.empty_like
    ctor = dict(call.ctor, use_cuda_graph=True)
    if call.kind == "decode":
        ctor.update(paged_kv_indptr_buffer=e(inp.kv_indptr), paged_kv_indices_buffer=e(inp.kv_indices),
                    paged_kv_last_page_len_buffer=e(inp.kv_last_page_len))
    elif call.kind == "prefill":
        ctor.update(qo_indptr_buf=e(inp.qo_indptr), paged_kv_indptr_buf=e(inp.kv_indptr),
                    paged_kv_indices_buf=e(inp.kv_indices), paged_kv_last_page_len_buf=e(inp.kv_last_page_len))
        if inp.custom_mask is not None:               # packed bits, one byte-aligned segment per request
            packed = sum((inp.width * kv + 7) // 8 for kv in inp.kv_lens.tolist())
            ctor.update(custom_mask_buf=torch.empty(packed, dtype=torch.uint8, device=inp.q.device),
                        mask_indptr_buf=e(inp.qo_indptr))
    else:
        ctor.update(qo_indptr=e(inp.qo_indptr), kv_indptr=e(inp.kv_indptr), kv_indices=e(inp.kv_indices),
                    kv_len_arr=e(inp.kv_lens))
    return replace(call, ctor=ctor, run_kwargs=dict(call.run_kwargs, out=_out(inp)))


class Peer:
    """One FlashInfer configuration on one row: plan once, then ``run()``."""

    def __init__(self, fi, config: str, inp: FiInputs, workspace: torch.Tensor, graph: bool = False):
        call = call_spec(config, inp)
        self.call = graph_call(call, inp) if graph else call
        mod = fi.mla if self.call.kind == "mla" else fi
        self.wrapper = getattr(mod, self.call.wrapper)(workspace, **self.call.ctor)
        plan_kw = dict(self.call.plan_kwargs)
        if "metadata" in plan_kw:
            plan_kw["metadata"] = fi.mla.MLAPlanMetadata.csr(*plan_kw["metadata"])
        self.wrapper.plan(*self.call.plan_args, **plan_kw)

    def fn(self):
        w, c = self.wrapper, self.call
        return lambda: w.run(*c.run_args, **c.run_kwargs)


def new_workspace(device) -> torch.Tensor:
    # decode.py __init__: "Must be initialized to 0 for its first use"; shared by every
    # wrapper of the process (calls never overlap).
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
