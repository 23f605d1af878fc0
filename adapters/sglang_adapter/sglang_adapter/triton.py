"""SGLang's ``TritonAttnBackend`` (``sglang/srt/layers/attention/triton_backend.py``) as an
attn-backends backend.

Every method hands the call to SGLang's own: ``init_forward_metadata`` (eager),
``init_cuda_graph_state``, ``init_forward_metadata_capture_cuda_graph`` and
``init_forward_metadata_replay_cuda_graph`` (SGLang 0.5.13+: ``init_forward_metadata_out_graph`` /
``_in_graph`` as its graph runners call them, ``ingraph.py``; draft decode: its
``TritonMultiStepDraftBackend``'s, ``draft.py``), and the forward
(``TritonAttnBackend.forward``, its Triton decode and extend kernels). What the adapter adds is
translation:

- in: our ``ForwardBatch`` / ``GraphInputs`` become SGLang's ``ForwardBatch`` and call
  arguments. One convention differs: in TARGET_VERIFY SGLang's ``seq_lens`` count the committed
  prefix (the draft tokens come in as the extend part), ours count prefix + N, so the adapter
  passes ``seq_lens - N``. The tree mask SGLang reads for a verify is its ``EagleVerifyInput.
  custom_mask`` (per request ``N x (prefix + N)`` rows, flattened); for a chain the adapter builds
  the causal one, as SGLang's tree builder does for ``topk == 1``. Our DRAFT_EXTEND is SGLang's
  ``DRAFT_EXTEND_V2`` (N rows a request, ``seq_lens`` counting them; eager with the extend fields
  ``prepare_for_extend_to_fill_draft_kvcache`` sets), not v1's ``DRAFT_EXTEND`` (packed rows).
- out: :meth:`SGLangMetadata.as_layout` reads the tensors SGLang's kernels read (the
  ``ForwardMetadata`` SGLang made at capture, for a graph: the addresses a captured graph holds)
  and states them as canonical fields, ``docs/plugin-guide.md`` section 4. SGLang's KV is
  token-indexed (page size 1): ``kv_indices`` are slots and pages at once.

Graph buffers (poisoned by the suite before each replay): SGLang's static ``kv_indptr``,
``cuda_graph_kv_indices``, ``cuda_graph_num_kv_splits``, ``cuda_graph_attn_logits`` /
``_lse`` (decode scratch), ``qo_indptr``, ``mask_indptr`` and ``cuda_graph_custom_mask`` (0.5.13+:
``_verify_mask.buffer``; besides, ``cuda_graph_uneven_batch`` and the lean-decode scratch).
"""
from __future__ import annotations

from typing import ClassVar, Optional

import torch

from attn_backends import AttentionBackend, Capabilities, ForwardMode, GraphSupport
from attn_backends.layout import LayoutError

from . import draft, engine, ingraph
from .metadata import I32, SGLangMetadata

__all__ = ["I32", "SGLangMetadata", "SGLangTritonBackend", "SGLangTritonTreeVerify"]


class SGLangTritonBackend(AttentionBackend):
    """SGLang's TritonAttnBackend, TP 1, page size 1, through its own metadata methods."""

    name: ClassVar[str] = "sglang_triton"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}),
        mha=True, mla=False, page_sizes=(1,),
        topk_gt1=False, draft_decode=True, graph=GraphSupport.UNIFORM_BATCH, devices=("cpu", "cuda"),
        requires=("sglang",), preference=-10)

    def __init__(self, config, memory) -> None:
        super().__init__(config, memory)
        if config.is_mla or config.page_size != 1 or memory.page_size != 1:
            raise ValueError(f"{self.name}: MHA/GQA on pages of 1 only (SGLang's Triton backend indexes tokens), "
                             f"got is_mla={config.is_mla} page_size={config.page_size}")
        engine.sglang()
        self.sgl = None                       # made at the first batch, when N is known (server args)
        self.draft_tokens: Optional[int] = None
        self.graph_state: Optional[tuple] = None
        self.records: dict = {}
        self.layers: dict = {}

    # -- SGLang's backend, made once N is known (SGLang reads it from the server args at construction)
    def _backend(self, spec) -> object:
        if draft.is_draft(spec):           # SGLang's multi-step draft backend, this step's backend
            return draft.backend(self, spec)
        n = spec.num_draft_tokens if spec is not None else None
        if self.sgl is None:
            args = engine.ServerArgs(speculative_num_draft_tokens=n,
                                     speculative_num_steps=None if n is None else spec.num_steps,
                                     speculative_eagle_topk=None if n is None else spec.topk)
            self.sgl = self.engine_class()(self._runner(args))
            self.draft_tokens = n
            if self.graph_state is not None:
                self._init_graph_state()
        elif n is not None and self.draft_tokens is not None and n != self.draft_tokens:
            raise LayoutError(f"{self.name}: SGLang fixes speculative_num_draft_tokens={self.draft_tokens} at "
                              f"construction; this batch has N={n}")
        elif n is not None and self.draft_tokens is None:
            raise LayoutError(f"{self.name}: SGLang's backend was made without speculative decoding (its server "
                              f"args); this batch has N={n}: use a new instance")
        return self.sgl

    def _runner(self, args) -> engine.StandInRunner:
        cls = ingraph.StandInRunner13 if ingraph.in_graph_api() else engine.StandInRunner
        return cls(self.config, self.memory, args)

    def _accept_length(self, spec, bs: int):
        """SGLang's ``accept_length`` for a draft extend: the Triton backend's replay takes it as the
        rows of each request (ours, the accepted tokens and the bonus one)."""
        return spec.accept_lens[:bs]

    def engine_class(self) -> type:
        """The SGLang class adapted (a test plants bugs in a subclass of it)."""
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
        return TritonAttnBackend

    def draft_engine_class(self) -> type:
        """The SGLang class adapted for draft decode (``draft.py``; a test plants bugs in a subclass)."""
        from sglang.srt.layers.attention.triton_backend import TritonMultiStepDraftBackend
        return TritonMultiStepDraftBackend

    def _check(self, mode, spec) -> None:
        if mode not in self.capabilities.modes:
            runs = ", ".join(sorted(m.name for m in self.capabilities.modes))
            raise LayoutError(f"{self.name} does not run mode {mode.name}; it runs {runs}")
        tree_ok = mode == ForwardMode.TARGET_VERIFY and self.capabilities.topk_gt1
        draft_ok = spec is None or not spec.is_draft_decode or self.capabilities.draft_decode
        if spec is not None and ((spec.topk > 1 and not tree_ok) or not draft_ok):
            raise LayoutError(f"{self.name}: no topk={spec.topk} in {mode.name}, no draft decode "
                              f"(draft_step={spec.draft_step})")

    def _spec(self, mode, spec, seq_lens_cpu: torch.Tensor, bs: int, raw_bs: int):
        """SGLang's spec input: EagleVerifyInput for a verify (its mask over prefix + N per request:
        the prefix, then the tree's block, causal for a chain and for pad rows, the runner's pad rule),
        EagleDraftInput for a draft extend (its accept lengths)."""
        if mode == ForwardMode.DRAFT_EXTEND and ingraph.in_graph_api():
            return ingraph.draft_extend_input(spec.num_draft_tokens)
        if mode == ForwardMode.DRAFT_EXTEND:
            from sglang.srt.speculative.eagle_info import EagleDraftInput
            return EagleDraftInput(accept_length=self._accept_length(spec, bs), accept_length_cpu=None)
        if mode != ForwardMode.TARGET_VERIFY:
            return None
        from sglang.srt.speculative.eagle_info import EagleVerifyInput
        n, dev = spec.num_draft_tokens, self.memory.device
        rows, tril = [], torch.tril(torch.ones(n, n, dtype=torch.bool, device=dev))
        for i, s in enumerate(seq_lens_cpu[:bs].tolist()):      # host lengths: ours (prefix + N)
            block = spec.tree_mask[i].to(torch.bool) if spec.topk > 1 and i < raw_bs else tril
            rows.append(torch.cat([torch.ones(n, s - n, dtype=torch.bool, device=dev), block], 1).reshape(-1))
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
        return EagleVerifyInput(**ingraph.spec_fields(
            EagleVerifyInput, draft_token=None, custom_mask=torch.cat(rows), positions=None, retrive_index=None,
            retrive_next_token=None, retrive_next_sibling=None, retrive_cum_len=None, spec_steps=spec.num_steps,
            topk=spec.topk, draft_token_num=n, capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=None,
            seq_lens_cpu=None))

    def _sgl_seq(self, mode, seq_lens, n):
        return seq_lens - n if mode == ForwardMode.TARGET_VERIFY else seq_lens

    # -- eager
    def init_forward_metadata(self, batch) -> None:
        mode, spec = batch.forward_mode, batch.spec_info
        self._check(mode, spec)
        sgl = self._backend(spec)
        w = batch.width if mode != ForwardMode.EXTEND else 0
        n = w if mode == ForwardMode.TARGET_VERIFY else 0
        if draft.is_draft(spec):
            fb = draft.eager(self, batch)
        else:
            fb = self._sgl_batch(batch, self._sgl_seq(mode, batch.seq_lens, n),
                                 self._sgl_seq(mode, batch.seq_lens_cpu, n))
            sgl.init_forward_metadata(fb)
        self.forward_metadata = self.meta_class(None, None, batch, sgl=self._engine_meta(), mode=mode,
                                               bs=batch.batch_size, width=w, max_k=int(batch.seq_lens_cpu.max()),
                                               tree=mode == ForwardMode.TARGET_VERIFY and spec.topk > 1)
        self.forward_metadata.runner_seq = batch.seq_lens
        self._fb = fb

    meta_class = SGLangMetadata

    def _engine_meta(self):
        """SGLang's record of the batch just prepared (what its forward reads)."""
        return self.sgl.forward_metadata

    def _own_buffers(self, key, meta) -> dict:
        """Fixed buffers for the canonical fields the engine has no tensor for (graph mode: their
        addresses hold from capture to replay)."""
        dev = self.memory.device
        return {k: torch.zeros(s, dtype=I32, device=dev) for k, s in
                (("cu_seqlens_q", key.bs + 1), ("seq_lens_k", key.bs), ("prefix_lens", key.bs))}

    def _sgl_batch(self, batch, seq_lens, seq_lens_cpu):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        sp = self._spec(batch.forward_mode, batch.spec_info, batch.seq_lens_cpu, batch.batch_size, batch.raw_bs)
        fb = ForwardBatch(forward_mode=engine.sgl_mode(batch.forward_mode), batch_size=batch.batch_size,
                          input_ids=torch.zeros(batch.num_tokens, dtype=torch.int64, device=self.memory.device),
                          req_pool_indices=batch.req_pool_indices.to(torch.int64), seq_lens=seq_lens,
                          out_cache_loc=batch.out_cache_loc, seq_lens_sum=int(seq_lens_cpu.sum()),
                          seq_lens_cpu=seq_lens_cpu, positions=batch.positions, spec_info=sp)
        mode, bs, dev = batch.forward_mode, batch.batch_size, self.memory.device
        if mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND):
            # the extend fields, as SGLang's scheduler (EXTEND) and v2's prepare_for_extend_to_fill_
            # draft_kvcache (DRAFT_EXTEND, N rows each) set them
            if mode == ForwardMode.EXTEND:
                ext, ext_cpu = batch.extend_seq_lens.to(I32), batch.extend_seq_lens_cpu.to(torch.int64)
            else:
                ext = torch.full((bs,), batch.width, dtype=I32, device=dev)
                ext_cpu = torch.full((bs,), batch.width, dtype=torch.int64)
            fb.extend_seq_lens, fb.extend_prefix_lens = ext, (seq_lens - ext).to(I32)
            fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = ext_cpu.tolist(), (seq_lens_cpu - ext_cpu).tolist()
            fb.extend_start_loc = (torch.cumsum(ext, 0) - ext).to(I32)
            fb.extend_num_tokens = int(ext_cpu.sum())
        fb.token_to_kv_pool = engine.StandInKVPool(self.memory)
        if ingraph.in_graph_api():
            ingraph.bind_plan(self.sgl, fb)
        return fb

    # -- graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph_state = (max_bs, max_num_tokens)
        self.records.clear()
        self.forward_metadata = None
        if self.sgl is not None:
            self._init_graph_state()

    def _init_graph_state(self) -> None:
        (getattr(self, "multi", None) or self.sgl).init_cuda_graph_state(*self.graph_state)

    def init_forward_metadata_capture_cuda_graph(self, inputs) -> None:
        key, spec = inputs.key, inputs.spec_info
        self._check(key.forward_mode, spec)
        if self.graph_state is None:
            raise LayoutError("capture before init_cuda_graph_state()")
        sgl = self._backend(spec)
        n = key.width if key.forward_mode == ForwardMode.TARGET_VERIFY else 0
        if draft.is_draft(spec):
            draft.capture(self, inputs)
        elif ingraph.in_graph_api():
            ingraph.capture(sgl, self._graph_batch(inputs, replay=False))
        else:
            sgl.init_forward_metadata_capture_cuda_graph(
                key.bs, key.bs * key.width, inputs.req_pool_indices.to(torch.int64),
                self._sgl_seq(key.forward_mode, inputs.seq_lens, n), None, engine.sgl_mode(key.forward_mode),
                self._spec(key.forward_mode, spec, inputs.seq_lens_cpu, key.bs, inputs.raw_bs))
        dev, meta = self.memory.device, self._engine_meta()
        own = self._own_buffers(key, meta)
        tree = spec is not None and spec.topk > 1 and key.forward_mode == ForwardMode.TARGET_VERIFY
        if tree:
            own["custom_mask"] = torch.zeros(key.bs * key.width ** 2, dtype=torch.bool, device=dev)
        rec = self.meta_class(None, key, None, sgl=meta, mode=key.forward_mode, bs=key.bs, width=key.width,
                              max_k=self.memory.max_context_len, tree=tree, own=own,
                              runner_seq=inputs.seq_lens.as_subclass(torch.Tensor))
        if draft.is_draft(spec):
            rec.kv_full = draft.graph_kv_indices(self, meta)
        self.records[key] = rec
        self.forward_metadata = rec

    def init_forward_metadata_replay_cuda_graph(self, inputs) -> None:
        key, spec = inputs.key, inputs.spec_info
        rec = self.records.get(key)
        if rec is None:
            raise LayoutError(f"no graph captured for {key}; captured: {', '.join(map(str, self.records)) or 'none'}")
        n = key.width if key.forward_mode == ForwardMode.TARGET_VERIFY else 0
        seq_cpu = self._sgl_seq(key.forward_mode, inputs.seq_lens_cpu, n)
        if draft.is_draft(spec):
            draft.replay(self, inputs)
        elif ingraph.in_graph_api():
            self.sgl.forward_metadata = rec.sgl                 # the graph of this key
            ingraph.replay(self.sgl, self._graph_batch(inputs, replay=True))
        else:
            self.sgl.init_forward_metadata_replay_cuda_graph(
                key.bs, inputs.req_pool_indices.to(torch.int64), self._sgl_seq(key.forward_mode, inputs.seq_lens, n),
                int(seq_cpu.sum()), None, engine.sgl_mode(key.forward_mode),
                self._spec(key.forward_mode, spec, inputs.seq_lens_cpu, key.bs, inputs.raw_bs), seq_cpu)
        rec.runner_seq = inputs.seq_lens.as_subclass(torch.Tensor)     # the runner's buffer, unguarded view
        self.forward_metadata = rec

    def _graph_batch(self, inputs, replay: bool):
        """SGLang 0.5.13+: the padded batch its graph runners hand the backend's graph prep (capture:
        the capture batch; replay: the replay view), from the runner's padded inputs."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch
        key, dev = inputs.key, self.memory.device
        mode, bs, w = key.forward_mode, key.bs, key.width
        n = w if mode == ForwardMode.TARGET_VERIFY else 0
        seq_cpu = self._sgl_seq(mode, inputs.seq_lens_cpu, n)
        if mode == ForwardMode.DRAFT_EXTEND:
            sp = ingraph.draft_extend_input(w, torch.full((bs,), w, dtype=I32, device=dev) if replay else None)
        else:
            sp = self._spec(mode, inputs.spec_info, inputs.seq_lens_cpu, bs, inputs.raw_bs)
        zeros = torch.zeros(bs * w, dtype=torch.int64, device=dev)
        fb = ForwardBatch(forward_mode=engine.sgl_mode(mode), batch_size=bs, input_ids=zeros,
                          req_pool_indices=inputs.req_pool_indices.to(torch.int64),
                          seq_lens=self._sgl_seq(mode, inputs.seq_lens, n), out_cache_loc=zeros,
                          seq_lens_sum=int(seq_cpu.sum()), seq_lens_cpu=seq_cpu, positions=zeros, spec_info=sp)
        ingraph.bind_plan(self.sgl, fb)
        return fb

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1 if self.sgl is None else self.sgl.get_cuda_graph_seq_len_fill_value()

    def graph_buffers(self) -> dict:
        s = self.sgl
        if s is None or not self.records:
            return {}
        names = ("cuda_graph_kv_indices", "cuda_graph_num_kv_splits", "cuda_graph_attn_logits",
                 "cuda_graph_attn_lse", "cuda_graph_custom_mask",      # 0.5.13+ besides: the lean-decode
                 "cuda_graph_uneven_batch", "cuda_graph_lean_Mp", "cuda_graph_lean_Lp", "cuda_graph_lean_Op",
                 "cuda_graph_lean_locks")                               # scratch, the uneven-batch flag
        out = {k: getattr(s, k) for k in names if isinstance(getattr(s, k, None), torch.Tensor)}
        vm = getattr(s, "_verify_mask", None)          # 0.5.13+: the verify mask buffer (VerifyMask)
        if vm is not None:
            out["verify_mask.buffer"] = vm.buffer
        # entry 0 of the three indptrs is constant state, not a batch's: zero from the allocation
        # (triton_backend.py __init__) or rewritten as 0; replays write [1:bs+1] (kv_indptr,
        # mask_indptr; qo_indptr in 0.5.9's draft extend) and the kernels read [0]. Left out of the
        # poisoning like the contract's other constant kernel state; poisoned, SGLang's kernels read
        # and store out of bounds and the interpreter's process aborts (docs/engines.md).
        for k in ("kv_indptr", "mask_indptr", "qo_indptr"):
            t = getattr(s, k, None)
            if isinstance(t, torch.Tensor):
                out[f"{k}[1:]"] = t[1:]
        return out

    # -- forward: SGLang's, on the metadata a captured graph (or the eager step) reads
    def forward(self, q, k, v, layer, batch, save_kv_cache: bool = True):
        meta = self.forward_metadata
        if meta is None:
            raise LayoutError("forward() before init_forward_metadata()")
        if layer.features:
            raise ValueError(f"{self.name} declares no windows, sinks or softcap (layer {layer.layer_id} uses them)")
        rl = self.layers.get(layer.layer_id)
        if rl is None:
            rl = self.layers[layer.layer_id] = engine.radix_layer(layer, self.config)
        if meta.key is None:
            fb = self._fb
        else:
            n = meta.width if meta.mode == ForwardMode.TARGET_VERIFY else 0
            fb = self._sgl_batch(batch, self._sgl_seq(meta.mode, batch.seq_lens, n),
                                 self._sgl_seq(meta.mode, batch.seq_lens_cpu, n))
        if k is None and meta.mode != ForwardMode.DECODE:
            # SGLang's extend kernel takes the new tokens' K/V as arguments (stored at out_cache_loc
            # first); a read-only call hands them over from the slots they were stored in
            loc = batch.out_cache_loc
            k, v = self.memory.pool.k[layer.layer_id][loc], self.memory.pool.v[layer.layer_id][loc]
        # what the captured graph's kernels read
        self.sgl.forward_metadata = meta.sgl if meta.kv_full is None else draft.with_graph_kv(meta)
        out = self.sgl.forward(q.reshape(q.shape[0], -1), k, v, rl, fb, save_kv_cache=save_kv_cache)
        return out.view(q.shape[0], layer.num_q_heads, layer.v_dim)


class SGLangTritonTreeVerify(SGLangTritonBackend):
    """The same backend for its verify modes, trees (topk > 1) included. A class of its own because
    ``Capabilities.topk_gt1`` is one flag for every mode: declared on the backend above it would
    also declare topk > 1 draft extend, which SGLang's uniform draft extend (spec v2, ``server_args.py``:
    "Spec v2 currently only supports topk = 1") does not serve."""

    name: ClassVar[str] = "sglang_triton_tree"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=frozenset({ForwardMode.TARGET_VERIFY}), mha=True, mla=False, page_sizes=(1,), topk_gt1=True,
        draft_decode=False, graph=GraphSupport.UNIFORM_BATCH, devices=("cpu", "cuda"), requires=("sglang",),
        preference=-10)
