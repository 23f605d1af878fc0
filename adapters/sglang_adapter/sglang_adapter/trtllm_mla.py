"""SGLang's ``TRTLLMMLABackend`` (``sglang/srt/layers/attention/trtllm_mla_backend.py``) as an
attn-backends backend: its block-table metadata (``TRTLLMMLADecodeMetadata``) from its own
``init_forward_metadata``, ``init_cuda_graph_state`` and capture / replay methods (SGLang 0.5.13+:
``init_forward_metadata_out_graph`` / ``_in_graph``, ``ingraph.py``), the block tables written by
its Triton kernel (``create_flashmla_kv_indices_triton``) in the interpreter.

The forward cannot run here: it is FlashInfer's trtllm-gen kernel (CUDA, SM100). The class declares
``Capabilities.layout_only`` with that reason, so the suite reports I9n as not run (:meth:`forward`
raises, should anything call it); every other layout invariant reads SGLang's metadata.

Stand-ins besides the Triton adapter's (``engine.py``), installed only where FlashInfer or the
server's global args are absent:

- FlashInfer's wrapper classes (``BatchPrefillWithRaggedKVCacheWrapper``,
  ``BatchMLAPagedAttentionWrapper``): the parent ``FlashInferMLAAttnBackend`` constructs them in
  ``__init__``; the trtllm paths of decode, verify and draft extend never call them. A stand-in
  accepts the constructor and raises on any use.
- The global server args (``set_global_server_args_for_scheduler``): the parent reads
  ``disaggregation_mode``, ``disable_chunked_prefix_cache`` and ``flashinfer_mla_disable_ragged``
  (chunked prefix cache off: no extend path here).
- ``kv_indices_buf``: SGLang's own optional argument of ``init_cuda_graph_state``; without it the
  FlashInfer parent allocates on ``"cuda"`` by name. The trtllm paths do not read it.
- 0.5.13+, without CUDA only (the constructor's CUDA-only parts, each a function below with its
  reason): the parent's pinned host buffers (allocated unpinned), the ``fixup_zero_kv`` JIT prebuild,
  trtllm-gen's multi-CTA KV counters; the global server args are SGLang's published config there
  (``ingraph.publish``).

Mapping (the canonical fields): the block table is the page table (``-1`` past each row's pages,
as SGLang writes it, stated as the reserved page 0 there); decode's KV lengths are the runner's
``seq_lens`` (0.5.9 / 0.5.10's decode forward reads ``forward_batch.seq_lens``; 0.5.23's reads the
metadata's ``seq_lens_k`` first, so the view states that one); verify and draft extend
read ``seq_lens_k``; draft extend's query rows are its ``cu_seqlens_q`` and each request's padded
query width ``max_seq_len_q`` (the kernel's query row j of a request sits at
``seq_lens_k - max_seq_len_q + j``).
"""
from __future__ import annotations

import contextlib
import importlib
import types
from dataclasses import dataclass
from typing import ClassVar

import torch

from attn_backends import AttentionBackend, Capabilities, ForwardMode, GraphSupport

from . import engine, ingraph
from .triton import I32, SGLangMetadata, SGLangTritonBackend


class _StandInWrapper:
    """FlashInfer's wrapper classes, where FlashInfer is absent: constructed, never used."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name: str):
        raise NotImplementedError(f"FlashInfer wrapper .{name} is a stand-in (FlashInfer is CUDA-only); "
                                  "the trtllm paths must not call it")


def _standin_jit_fixup_module(dtype):
    """0.5.23's constructor prebuilds a CUDA JIT module (``fixup_zero_kv``, nvcc for the device's
    arch) for its ragged prefill; without a GPU there is no arch to build for. Never called on the
    decode / verify / draft-extend paths; a stand-in module raises if it is."""
    return _StandInWrapper()


def _standin_multi_ctas_kv_counter_buffer(device, num_q_heads, max_batch_size):
    """0.5.23's constructor sizes trtllm-gen's multi-CTA KV counters by the GPU's SM count
    (``flashinfer.utils.get_device_sm_count``: CUDA, FlashInfer). Only the trtllm-gen forward reads
    them (not run here): an empty buffer."""
    return torch.zeros(0, dtype=torch.uint8, device=device)


def install_standins() -> None:
    fim = importlib.import_module("sglang.srt.layers.attention.flashinfer_mla_backend")
    for name in ("BatchPrefillWithRaggedKVCacheWrapper", "BatchMLAPagedAttentionWrapper"):
        if not hasattr(fim, name):
            setattr(fim, name, _StandInWrapper)
    if ingraph.in_graph_api():     # 0.5.13+: the process-wide config, published by ingraph.publish
        tm = importlib.import_module("sglang.srt.layers.attention.trtllm_mla_backend")
        if not torch.cuda.is_available():
            tm._jit_fixup_module = _standin_jit_fixup_module
            tm.make_persistent_multi_ctas_kv_counter_buffer = _standin_multi_ctas_kv_counter_buffer
        return
    sa = importlib.import_module("sglang.srt.server_args")
    if getattr(sa, "_global_server_args", None) is None:
        sa.set_global_server_args_for_scheduler(types.SimpleNamespace(
            disaggregation_mode="null", disable_chunked_prefix_cache=True, flashinfer_mla_disable_ragged=True))


@contextlib.contextmanager
def unpinned_host_buffers():
    """SGLang 0.5.23's FlashInfer-MLA parent allocates pinned host buffers for its fast prefill plan
    (``torch.zeros(..., device="cpu", pin_memory=True)``, ``flashinfer_mla_backend.py:328-336``).
    Pinned memory needs a CUDA driver; without one the allocation raises. Pinning only makes host
    to device copies asynchronous (no value changes), so while the constructor runs on a machine
    without CUDA, host allocations drop the flag. The trtllm paths never read those buffers."""
    if torch.cuda.is_available():
        yield
        return
    zeros = torch.zeros

    def unpinned(*args, pin_memory=False, **kwargs):
        return zeros(*args, **kwargs)

    torch.zeros = unpinned
    try:
        yield
    finally:
        torch.zeros = zeros


@dataclass(eq=False)
class TRTLLMMetadata(SGLangMetadata):
    page_size: int = 0

    def as_layout(self) -> dict:
        m, bs, w, ps = self.sgl, self.bs, self.width, self.page_size
        if self.mode == ForwardMode.DECODE:
            cu = torch.arange(bs + 1, dtype=I32, device=m.block_kv_indices.device)
            # the decode kernel's lengths: the metadata's seq_lens_k where SGLang made one (0.5.13+:
            # forward_decode reads it first), else the batch's seq_lens (0.5.9 / 0.5.10's forward)
            own = isinstance(m.seq_lens_k, torch.Tensor)
            seq, q_pad = (m.seq_lens_k[:bs] if own else self.runner_seq[:bs]).to(I32), 1
        elif self.mode == ForwardMode.TARGET_VERIFY:
            cu = torch.arange(0, (bs + 1) * w, w, dtype=I32, device=m.block_kv_indices.device)
            seq, q_pad = m.seq_lens_k[:bs], w
        else:
            cu, seq, q_pad = m.cu_seqlens_q[:bs + 1], m.seq_lens_k[:bs], m.max_seq_len_q
        blocks = m.block_kv_indices[:bs]
        cols = torch.arange(blocks.shape[1], device=blocks.device)
        used = cols[None, :] < ((seq.to(torch.int64) + ps - 1) // ps)[:, None]
        out = {"cu_seqlens_q": self._out("cu_seqlens_q", cu), "seq_lens_k": self._out("seq_lens_k", seq),
               "prefix_lens": self._out("prefix_lens", seq - q_pad),
               "page_table": self._out("page_table", torch.where(used, blocks, 0)),
               "max_seq_len_q": int(q_pad), "max_seq_len_k": int(m.max_seq_len_k)}
        return out


class SGLangTRTLLMMLABackend(SGLangTritonBackend):
    """SGLang's TRTLLMMLABackend, TP 1, pages of 64 (SGLang takes 32 or 64; our KV memory 1, 16, 64)."""

    name: ClassVar[str] = "sglang_trtllm_mla"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}),
        mha=False, mla=True, page_sizes=(64,), topk_gt1=False, draft_decode=False,
        graph=GraphSupport.UNIFORM_BATCH, devices=("cpu", "cuda"), requires=("sglang",), preference=-10,
        layout_only="SGLang's forward is FlashInfer's trtllm-gen kernel (CUDA, SM100)")
    meta_class = TRTLLMMetadata

    def __init__(self, config, memory) -> None:
        AttentionBackend.__init__(self, config, memory)
        if not config.is_mla or config.page_size != 64 or memory.page_size != config.page_size:
            raise ValueError(f"{self.name}: MLA on pages of 64 only, got is_mla={config.is_mla} "
                             f"page_size={config.page_size}")
        engine.sglang()
        install_standins()
        self.sgl, self.draft_tokens, self.graph_state = None, None, None
        self.records, self.layers = {}, {}

    def _backend(self, spec) -> object:
        with unpinned_host_buffers():
            return super()._backend(spec)

    def engine_class(self) -> type:
        from sglang.srt.layers.attention.trtllm_mla_backend import TRTLLMMLABackend
        return TRTLLMMLABackend

    def _runner(self, args) -> engine.StandInRunner:
        args.page_size = self.config.page_size        # 0.5.13+ publishes it, its translator reads it
        r = super()._runner(args)
        r.max_running_requests = int(self.memory.req_to_token.shape[0])   # 0.5.23 sizes its trtllm-gen counters by it
        c, mc = self.config, r.model_config
        mc.kv_lora_rank, mc.qk_nope_head_dim = c.kv_lora_rank, c.qk_nope_head_dim
        mc.qk_rope_head_dim = c.qk_rope_head_dim
        mc.v_head_dim, mc.scaling, mc.attention_arch = c.kv_lora_rank, c.layer(0).scaling, None
        r.page_size, r.kv_cache_dtype = c.page_size, c.cache_dtype
        return r

    def _accept_length(self, spec, bs: int):
        """The trtllm replay takes ``accept_length + 1`` rows a request (``accept_length``: the
        accepted draft tokens, the bonus one not counted)."""
        return spec.accept_lens[:bs] - 1

    def _init_graph_state(self) -> None:
        max_bs, max_tokens = self.graph_state
        buf = torch.zeros(max_bs * self.memory.max_context_len, dtype=I32, device=self.memory.device)
        self.sgl.init_cuda_graph_state(max_bs, max_tokens, kv_indices_buf=buf)

    def _engine_meta(self):
        return self.sgl.forward_decode_metadata

    def _own_buffers(self, key, meta) -> dict:
        own = super()._own_buffers(key, meta)
        own["page_table"] = torch.zeros(tuple(meta.block_kv_indices.shape), dtype=I32, device=self.memory.device)
        return own

    def init_forward_metadata(self, batch) -> None:
        super().init_forward_metadata(batch)
        self.forward_metadata.page_size = self.config.page_size

    def init_forward_metadata_capture_cuda_graph(self, inputs) -> None:
        super().init_forward_metadata_capture_cuda_graph(inputs)
        self.forward_metadata.page_size = self.config.page_size

    def graph_buffers(self) -> dict:
        """The block table and, per captured bs, the metadata's lengths; ``cu_seqlens_q[0]`` left out
        like the Triton backend's indptr entries 0 (0.5.9's replay writes ``[1:]`` only)."""
        if self.sgl is None or not self.records:
            return {}
        out = {"decode_cuda_graph_kv_indices": self.sgl.decode_cuda_graph_kv_indices}
        # 0.5.13+: a draft extend's cu_seqlens_q and seq_lens_q are the stride N, written once when
        # the graph's metadata is made (_init_cuda_graph_metadata) and never by a replay
        # (_apply_cuda_graph_metadata): constant kernel state, left out of the poisoning like the
        # indptr entries 0 (docs/engines.md, (c)); I1 still compares cu_seqlens_q on every replay
        constant = ("seq_lens_q", "cu_seqlens_q") if ingraph.in_graph_api() else ()
        for bs, m in self.sgl.decode_cuda_graph_metadata.items():
            for k in ("seq_lens_k", "seq_lens_q"):
                if isinstance(getattr(m, k, None), torch.Tensor) and k not in constant:
                    out[f"{k}@{bs}"] = getattr(m, k)
            if isinstance(m.cu_seqlens_q, torch.Tensor) and "cu_seqlens_q" not in constant:
                out[f"cu_seqlens_q[1:]@{bs}"] = m.cu_seqlens_q[1:]
        return out

    def forward(self, q, k, v, layer, batch, save_kv_cache: bool = True):
        raise NotImplementedError(f"{self.name}: SGLang's forward is FlashInfer's trtllm-gen kernel (CUDA, SM100); "
                                  "on this device only the layout invariants apply")
