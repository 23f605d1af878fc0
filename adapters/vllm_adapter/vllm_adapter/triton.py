"""vLLM v1's Triton attention backend (``vllm/v1/attention/backends/triton_attn.py``:
``TritonAttentionMetadataBuilder`` and ``TritonAttentionImpl``) as an attn-backends backend.

The metadata is vLLM's: the adapter drives the persistent inputs as vLLM's V2 GPU model runner does
(``engine.RunnerBuffers``: ``query_start_loc``, ``seq_lens``, positions, block table and slot mapping
written by vLLM's own kernels), builds ``CommonAttentionMetadata`` from them as ``build_attn_metadata``
does, and calls the builder's ``build`` (eager, every replay) or ``build_for_cudagraph_capture`` (a
capture, on vLLM's dummy capture batch). The forward is ``TritonAttentionImpl.forward`` (vLLM's
``unified_attention`` kernel, in the interpreter on a CPU).

- capture: vLLM captures on a dummy batch (``prepare_inputs_to_capture``: ``InputBatch.make_dummy``, zeroed
  block tables, slots -1; ``max_seq_len = max_model_len``) and ``build_for_cudagraph_capture`` sets
  ``seq_lens`` to 1. The metadata it returns is the record a graph keeps: host ints baked in
  (``max_query_len``, ``max_seq_len``, ``num_actual_tokens``) and views of the persistent buffers. Before
  its first replay vLLM's runner prepares the step's inputs into those buffers; the adapter does that for
  the capture batch too, so the captured view states the capture batch.
- replay: the runner's step preparation (``RunnerBuffers.prepare``: ``num_reqs`` real requests padded to
  the key's bs, FULL mode), then ``build`` as the runner calls it every step. The view states what the
  graph reads: the captured record's host ints over the persistent buffers.
- eager (EXTEND, and DECODE / TARGET_VERIFY without a graph): the same preparation, unpadded, ``build``.

Modes: DECODE, EXTEND (prefill and chunked prefill: eager or piecewise, never in a FULL graph),
TARGET_VERIFY as vLLM verifies (a chain: ``1 + num_speculative_tokens`` rows a request, causal; vLLM has
no tree verify) and DRAFT_EXTEND, vLLM's draft prefill: its speculators keep the target's batch shape
(each request's N rows, rejected positions included) and reuse the target's attention metadata
(``spec_decode/target_dependent_ar/speculator.py`` ``propose``, FULL graphs captured like the target's in
``target_dependent_ar/cudagraph_utils.py``); accept lengths only select rows, as in ours. Not declared:
draft decode (its steps' ``seq_lens`` come from the speculator's ``prepare_decode_inputs`` kernel, which
the adapter does not drive) and topk > 1.

Conventions translated, not changed (:meth:`VLLMMetadata.as_layout`): vLLM pads a graph's batch with
requests of no query rows and no KV (``query_start_loc`` past the real requests = their token count,
``seq_lens`` 0, block-table rows the null block 0, slots -1); the canonical pad request has W rows and
``seq_len`` = the fill value on the reserved page 0. A pad row in vLLM's form is stated canonically; any
other value is stated as it is. vLLM's blocks are our pages; its null block 0 is our reserved page 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch

from attn_backends import AttentionBackend, Capabilities, ForwardMode, GraphSupport
from attn_backends.base import ForwardMetadata
from attn_backends.layout import LayoutError

from . import engine

I32 = torch.int32


@dataclass(eq=False)
class VLLMMetadata(ForwardMetadata):
    """vLLM's ``TritonAttentionMetadata`` (``vm``: what ``unified_attention`` reads) with the mode, ``bs``,
    W, the real requests, the pad rule, and in graph mode fixed buffers for the canonical fields."""

    vm: object = None
    mode: ForwardMode = ForwardMode.DECODE
    bs: int = 0
    width: int = 1
    raw_bs: int = 0
    fill: int = 1
    page_size: int = 16
    own: dict = field(default_factory=dict)

    def _out(self, name: str, value: torch.Tensor) -> torch.Tensor:
        buf = self.own.get(name)
        if buf is None:
            return value.to(I32)
        buf.copy_(value)
        return buf

    def as_layout(self) -> dict:
        """The canonical fields of what vLLM's kernel reads (host reads: the suite's, after a replay)."""
        m, bs, raw, w = self.vm, self.bs, self.raw_bs, self.width
        qsl = m.query_start_loc.to(torch.int64)
        seq = m.seq_lens.to(torch.int64)
        table = m.block_table.to(torch.int64)
        have = seq.shape[0]                      # vLLM's requests: raw eagerly, bs in a graph
        end = int(qsl[raw]) if raw < qsl.shape[0] else 0
        cu, sk = [int(x) for x in qsl[:raw + 1]], [int(x) for x in seq[:raw]]
        rows = [table[i] for i in range(raw)]
        pad_w = w if self.mode != ForwardMode.EXTEND else 1
        for i in range(raw, bs):
            # vLLM's pad request (no rows, no KV, null block) is the canonical pad row; anything else shows
            vllm_pad = i >= have or (int(qsl[i + 1]) == end and int(seq[i]) == 0 and not bool(table[i].any()))
            cu.append(cu[-1] + pad_w if vllm_pad else int(qsl[i + 1]))
            sk.append(max(self.fill, pad_w) if vllm_pad else int(seq[i]))
            rows.append(torch.zeros_like(table[0]) if vllm_pad else table[i])
        dev = m.seq_lens.device
        cu_t, sk_t = torch.tensor(cu, device=dev), torch.tensor(sk, device=dev)
        q_len = cu_t[1:] - cu_t[:-1]
        page_table = torch.stack(rows) if rows else table[:0]
        npages = (sk_t + self.page_size - 1) // self.page_size
        used = torch.arange(page_table.shape[1], device=dev)[None, :] < npages[:, None]
        return {"cu_seqlens_q": self._out("cu_seqlens_q", cu_t), "seq_lens_k": self._out("seq_lens_k", sk_t),
                "prefix_lens": self._out("prefix_lens", sk_t - q_len),
                # columns past a row's pages are not read by the kernel (it stops at seq_lens)
                "page_table": self._out("page_table", torch.where(used, page_table, 0)),
                "max_seq_len_q": int(m.max_query_len), "max_seq_len_k": int(m.max_seq_len)}


class VLLMTritonBackend(AttentionBackend):
    """vLLM v1's Triton attention (metadata builder + impl), TP 1, pages of vLLM's block size."""

    name: ClassVar[str] = "vllm_triton"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                         ForwardMode.DRAFT_EXTEND}),
        mha=True, mla=False, page_sizes=(16, 64), topk_gt1=False, draft_decode=False,
        graph=GraphSupport.UNIFORM_BATCH, devices=("cpu", "cuda"), head_dims=(32, 64, 128),
        sinks=True, softcap=True, requires=("vllm",), preference=-10)

    def __init__(self, config, memory) -> None:
        super().__init__(config, memory)
        if config.is_mla or memory.page_size % 16:
            raise ValueError(f"{self.name}: MHA/GQA on pages that are multiples of 16 only (vLLM's Triton "
                             f"backend: block sizes MultipleOf(16)), got is_mla={config.is_mla} "
                             f"page_size={memory.page_size}")
        engine.vllm()
        self.builder = None
        self.num_spec: Optional[int] = None
        self.buffers: Optional[engine.RunnerBuffers] = None
        self.graph_state: Optional[tuple] = None
        self.records: dict = {}
        self.impls: dict = {}

    def builder_class(self) -> type:
        """The vLLM class adapted (a test plants bugs in a subclass of it)."""
        from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder
        return TritonAttentionMetadataBuilder

    # -- vLLM's builder, made once the speculative width is known (vLLM reads it from its config)
    def _builder(self, spec):
        k = spec.num_draft_tokens - 1 if spec is not None else 0
        if self.builder is None:
            max_bs = self.graph_state[0] if self.graph_state else self.memory.req_to_token.shape[0]
            max_tokens = self.graph_state[1] if self.graph_state else max_bs * self.memory.max_context_len
            cfg = engine.standin_config(self.config, self.memory, max_bs, k)
            self.builder = self.builder_class()(engine.kv_cache_spec(self.config, self.memory), ["layer.0"], cfg,
                                                self.memory.device)
            self.buffers = engine.RunnerBuffers(self.memory, max_bs, max(max_tokens, max_bs * 16))
            self.num_spec = k
        elif k != self.num_spec:
            raise LayoutError(f"{self.name}: vLLM fixes num_speculative_tokens={self.num_spec} in its config; "
                              f"this batch has N={k + 1}")
        return self.builder

    def _check(self, mode, spec) -> None:
        if mode not in self.capabilities.modes:
            runs = ", ".join(sorted(m.name for m in self.capabilities.modes))
            raise LayoutError(f"{self.name} does not run mode {mode.name}; it runs {runs}")
        if spec is not None and (spec.topk > 1 or spec.is_draft_decode):
            raise LayoutError(f"{self.name}: vLLM verifies chains only (no tree verify, no draft decode here); "
                              f"got topk={spec.topk} draft_step={spec.draft_step}")

    def _meta(self, vm, key, batch, mode, bs, w, raw) -> VLLMMetadata:
        return VLLMMetadata(None, key, batch, vm=vm, mode=mode, bs=bs, width=w, raw_bs=raw,
                            fill=self.get_cuda_graph_seq_len_fill_value(), page_size=self.memory.page_size)

    def _step(self, rows, seq_lens, q_lens, q_lens_cpu: list, seq_cpu: list, padded: Optional[tuple]):
        """One step's inputs as vLLM's runner prepares them; ``padded`` = (reqs, tokens) of a FULL graph."""
        b = self.buffers
        raw = len(q_lens_cpu)
        b.load_requests(rows[:raw], seq_lens[:raw], q_lens[:raw])
        reqs, tokens = padded if padded else (raw, sum(q_lens_cpu))
        qsl, table, slots = b.prepare(rows, q_lens_cpu, reqs, tokens)
        return engine.common_metadata(qsl, b.inputs.query_start_loc, b.inputs.seq_lens, table, slots, reqs, tokens,
                                      max(q_lens_cpu), max(seq_cpu))

    # -- eager
    def init_forward_metadata(self, batch) -> None:
        mode, spec, raw = batch.forward_mode, batch.spec_info, batch.raw_bs
        self._check(mode, spec)
        builder = self._builder(spec)
        if mode == ForwardMode.EXTEND:
            q_cpu = [int(x) for x in batch.extend_seq_lens_cpu[:raw]]
            q_dev = batch.extend_seq_lens.to(I32)
        else:
            q_cpu = [batch.width] * raw
            q_dev = torch.full((batch.batch_size,), batch.width, dtype=I32, device=self.memory.device)
        cm = self._step(batch.req_pool_indices, batch.seq_lens, q_dev, q_cpu,
                        [int(x) for x in batch.seq_lens_cpu[:raw]], None)
        vm = builder.build(0, cm)
        w = batch.width if mode != ForwardMode.EXTEND else 0
        self.forward_metadata = self._meta(vm, None, batch, mode, batch.batch_size, w, raw)

    # -- graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph_state = (max_bs, max_num_tokens)
        self.records.clear()
        self.forward_metadata = None

    def _graph_step(self, inputs):
        key = inputs.key
        w, raw = key.width, inputs.raw_bs
        q_dev = torch.full((key.bs,), w, dtype=I32, device=self.memory.device)
        return self._step(inputs.req_pool_indices, inputs.seq_lens, q_dev, [w] * raw,
                          [int(x) for x in inputs.seq_lens_cpu[:raw]], (key.bs, key.bs * w))

    def init_forward_metadata_capture_cuda_graph(self, inputs) -> None:
        key, spec = inputs.key, inputs.spec_info
        self._check(key.forward_mode, spec)
        if self.graph_state is None:
            raise LayoutError("capture before init_cuda_graph_state()")
        builder = self._builder(spec)
        b, w = self.buffers, key.width
        # vLLM's capture: the dummy batch (cudagraph_utils.prepare_inputs_to_capture), FULL, max_model_len
        dummy, table, slots = b.dummy(key.bs, key.bs * w)
        cm = engine.common_metadata(dummy.query_start_loc_np, b.inputs.query_start_loc, b.inputs.seq_lens, table,
                                    slots, key.bs, key.bs * w, w, self.memory.max_context_len)
        vm = builder.build_for_cudagraph_capture(cm)
        # before the graph's first replay the runner prepares the step: here, the capture batch
        builder.build(0, self._graph_step(inputs))
        dev = self.memory.device
        own = {k: torch.zeros(n, dtype=I32, device=dev) for k, n in
               (("cu_seqlens_q", key.bs + 1), ("seq_lens_k", key.bs), ("prefix_lens", key.bs))}
        own["page_table"] = torch.zeros(key.bs, b.max_blocks, dtype=I32, device=dev)
        rec = self._meta(vm, key, None, key.forward_mode, key.bs, w, inputs.raw_bs)
        rec.own = own
        self.records[key] = rec
        self.forward_metadata = rec

    def init_forward_metadata_replay_cuda_graph(self, inputs) -> None:
        key = inputs.key
        rec = self.records.get(key)
        if rec is None:
            raise LayoutError(f"no graph captured for {key}; captured: {', '.join(map(str, self.records)) or 'none'}")
        self.builder.build(0, self._graph_step(inputs))     # the runner builds every step; the graph keeps rec
        rec.raw_bs = inputs.raw_bs
        self.forward_metadata = rec

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def graph_buffers(self) -> dict:
        if self.builder is None or not self.records:
            return {}
        b = self.builder
        out = dict(self.buffers.buffers())
        out.update(softmax_segm_output=b.softmax_segm_output, softmax_segm_max=b.softmax_segm_max,
                   softmax_segm_expsum=b.softmax_segm_expsum)
        return out

    # -- forward: vLLM's TritonAttentionImpl on the metadata a captured graph (or the eager step) reads
    def forward(self, q, k, v, layer, batch, save_kv_cache: bool = True):
        from . import forward
        meta = self.forward_metadata
        if meta is None:
            raise LayoutError("forward() before init_forward_metadata()")
        if layer.window is not None:
            # vLLM's runner masks the blocks below a window to its null block (gather_block_tables), not mirrored
            raise ValueError(f"{self.name} declares no sliding windows (layer {layer.layer_id} has {layer.window})")
        return forward.run(self, q, k, v, layer, meta, save_kv_cache)
