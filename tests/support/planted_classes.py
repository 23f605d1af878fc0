"""The bug classes of 2026 (docs/bug-classes.md maps all thirteen),
planted where tests/support/planted_bugs.py and tests/support/planted_mutants.py had none: backend copies of the
reference (``attn-backends check --backend tests/support/planted_classes.py:<Class>``) and monkeypatches
of our runners and executor (``plant(mp)``, as tests/support/planted_mutants.py does).
tests/check/test_bug_classes.py shows a check reporting each one."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from attn_backends import CaptureHiddenMode as H
from attn_backends import ForwardMode
from attn_backends.backends.torch_native import TorchNativeBackend
from attn_backends.base import ForwardMetadata
from attn_backends_runtime import engine, executor, full_graph

# --------------------------------------------------------------------------- backends


class ForeignCaptureMetadata(TorchNativeBackend):
    """vLLM #48261: a capture reuses the metadata an earlier capture of the same mode built (views
    of another bucket's static buffers) instead of building its own."""

    name = "bug_foreign_capture"

    def init_forward_metadata_capture_cuda_graph(self, inputs):
        key, view = inputs.key, inputs.step
        origin = view.origin if view is not None else id(self._steps.graph_step)    # the step of the capture
        earlier = [m for (k, o), m in self._graph_meta.items()
                   if o == origin and k.forward_mode == key.forward_mode and k != key]
        if not earlier:
            return super().init_forward_metadata_capture_cuda_graph(inputs)
        self._graph_meta[(key, origin)] = earlier[0]
        self.forward_metadata = earlier[0]


class ContextSizedBuffers(TorchNativeBackend):
    """SGLang #29695: speculative graph buffers sized by the context length (the request-to-token
    width less the speculative headroom W), while requests index up to the full width. The
    backend's own page table (allocated with its graph state, as SGLang's backends do) takes the
    columns of the step's that fit."""

    name = "bug_context_sized_buffers"

    def __init__(self, config, memory):
        super().__init__(config, memory)
        self._page_table = None

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        w = max(1, max_num_tokens // max_bs)
        ps = self.memory.page_size
        context = (self.memory.max_context_len - w) // ps * ps
        self._page_table = None if w == 1 else torch.zeros(max_bs, context // ps, dtype=torch.int32,
                                                            device=self.memory.device)

    def _update(self, meta, view):
        own = self._page_table
        if meta.key is None or own is None:
            return
        lay = view.layout
        pt = own[:lay.bs]
        pt.copy_(lay.page_table[:, :pt.shape[1]])
        meta.view = view._replace(layout=dataclasses.replace(lay, page_table=pt))

    def _extra_graph_buffers(self):
        return {} if self._page_table is None else {"own.page_table": self._page_table}


class TreeMaskDoubleCounted(TorchNativeBackend):
    """SGLang #32691: the verify custom-mask size counts N^2 * bs twice; when that outgrows the
    static buffer, replay allocates a larger one, which the captured graph never reads."""

    name = "bug_tree_mask_double_counted"

    def init_forward_metadata_replay_cuda_graph(self, inputs):
        super().init_forward_metadata_replay_cuda_graph(inputs)
        lay = self.forward_metadata.layout
        if lay.custom_mask is None:
            return
        n = lay.bs * lay.width * lay.width
        need = 2 * n
        if need > lay.custom_mask.untyped_storage().nbytes():
            grown = lay.custom_mask.new_zeros(need)
            grown[:n] = lay.custom_mask
            lay.custom_mask = grown[:n]


@dataclasses.dataclass(eq=False)
class _SliceMetadata(ForwardMetadata):
    cache_seqlens: Optional[torch.Tensor] = None      # graph: the key's own copy, which its kernel reads


class UnboundReplaySlice(TorchNativeBackend):
    """SGLang #26655: each captured key has its own copy of the cache lengths that the kernel
    reads; replay copies the new lengths into the copy bound last (another key's) before
    rebinding, so the key's own copy keeps what its capture held."""

    name = "bug_unbound_replay_slice"

    def _metadata(self, view, key):
        own = None if key is None else view.layout.seq_lens_k.clone()
        return _SliceMetadata(view, key, cache_seqlens=own)

    def _extra_graph_buffers(self):
        return {f"cache_seqlens/{k.bs}": m.cache_seqlens for (k, _), m in self._graph_meta.items()}

    def _update(self, meta, view):
        if meta.key is None or self._graph_meta.get((meta.key, view.origin)) is not meta:
            return                                # eager, or a capture (its record is new): replays only
        bound = self.forward_metadata             # the bug: not yet rebound to ``meta``
        dst = getattr(bound, "cache_seqlens", None)
        if dst is not None:
            n = min(dst.numel(), view.layout.bs)
            dst[:n].copy_(view.layout.seq_lens_k[:n])

    def _run(self, q, layer, meta):
        own = meta.cache_seqlens
        if own is not None:
            meta = dataclasses.replace(meta, view=meta.view._replace(
                layout=dataclasses.replace(meta.layout, seq_lens_k=own)))
        return super()._run(q, layer, meta)


class QLenOneGraphs(TorchNativeBackend):
    """vLLM #44492: declares uniform-batch graphs in every mode it runs, but its graph metadata
    handles q_len 1 only: capturing verify (or draft extend) fails."""

    name = "bug_q_len_one_graphs"

    def init_forward_metadata_capture_cuda_graph(self, inputs):
        if inputs.key.width != 1:
            raise NotImplementedError(f"graph metadata for q_len {inputs.key.width}: only q_len 1 is captured")
        super().init_forward_metadata_capture_cuda_graph(inputs)


class CaptureBatchUnpadded(TorchNativeBackend):
    """vLLM #32645: the capture's query start offsets count the capture batch's real requests
    only (pad rows get no query rows), where every replay pads them like real ones."""

    name = "bug_capture_batch_unpadded"

    def init_forward_metadata_capture_cuda_graph(self, inputs):
        super().init_forward_metadata_capture_cuda_graph(inputs)
        lay = self.forward_metadata.layout
        if lay.width and inputs.raw_bs < lay.bs:
            lay.cu_seqlens_q[inputs.raw_bs + 1:].fill_(inputs.raw_bs * lay.width)


class HostListInCapture(TorchNativeBackend):
    """vLLM #40807 / #40831: a ``.tolist()`` of the prefix lengths in the continuation (draft
    extend) path of the capture: a host sync while the stream is captured."""

    name = "bug_host_list_in_capture"

    def init_forward_metadata_capture_cuda_graph(self, inputs):
        if inputs.key.forward_mode == ForwardMode.DRAFT_EXTEND:
            self.prefix_hint = (inputs.seq_lens - inputs.key.width).tolist()
        super().init_forward_metadata_capture_cuda_graph(inputs)


BACKENDS = [ForeignCaptureMetadata, ContextSizedBuffers, TreeMaskDoubleCounted, UnboundReplaySlice, QLenOneGraphs,
            CaptureBatchUnpadded, HostListInCapture]

# --------------------------------------------------------------------------- runners and executor


def dispatch_by_shape(mp):
    """vLLM #51865: a uniform runner classifies a batch as its own mode from the token shape
    alone (W tokens per request), so a batch of another mode with that shape replays its graph."""
    orig = full_graph.UniformGraphRunner.refusal

    def refusal(self, batch):
        if batch.num_tokens == batch.raw_bs * self.width:
            batch = dataclasses.replace(batch, forward_mode=self.mode)
        return orig(self, batch)
    mp.setattr(full_graph.UniformGraphRunner, "refusal", refusal)


def capture_ladder_capped(mp):
    """vLLM #53407, #54933: a capture-size cap in tokens, compared with requests * W, drops the
    widest uniform buckets: those batch sizes silently run eagerly."""
    orig = full_graph.UniformGraphRunner.__init__

    def init(self, model, backends, memory, mode, buckets, spec=None, capture_hidden_mode=H.NULL):
        w = 1 if mode == ForwardMode.DECODE or spec is None else spec.num_draft_tokens
        cap = max(buckets)
        kept = [b for b in buckets if b * w <= cap] or [min(buckets)]
        orig(self, model, backends, memory, mode, kept, spec, capture_hidden_mode)
    mp.setattr(full_graph.UniformGraphRunner, "__init__", init)


GRAPH_WHITELIST = ("triton", "flashinfer", "flashinfer_mla", "trtllm_mla")


def draft_extend_graph_whitelist(mp):
    """SGLang #30944: the draft-extend graph is built only for a hard-coded list of backend names,
    whatever the backend declares."""
    orig = executor.draft_executor

    def draft_executor(model, memory, backend, cfg, **kw):
        ex = orig(model, memory, backend, cfg, **kw)
        if backend not in GRAPH_WHITELIST:
            ex.runners.pop("draft_extend", None)
        return ex
    for mod in (executor, engine):          # the engine imported it by name
        mp.setattr(mod, "draft_executor", draft_executor)


RUNNER_PLANTS = [dispatch_by_shape, capture_ladder_capped, draft_extend_graph_whitelist]

# --------------------------------------------------------------------------- the thirteen classes, as data
# (thread, bug-list entry, invariant that reports it, the plant, the test that holds it);
# docs/bug-classes.md is this table in words.
CLASSES = [
    ("vLLM #48261", "A4, D4", "I9 (crash: metadata of another bucket)", "planted_classes.ForeignCaptureMetadata",
     "test_bug_classes.py::test_backend_plant_reported[ForeignCaptureMetadata]"),
    ("SGLang #27664", "A4", "I2", "planted_bugs.ReallocOnReplay",
     "test_planted_bugs.py::test_suite_reports_planted_bug[bug_realloc_on_replay]"),
    ("SGLang #29695", "A5", "I6, I9n", "planted_classes.ContextSizedBuffers",
     "test_bug_classes.py::test_backend_plant_reported[ContextSizedBuffers]"),
    ("SGLang #32691", "A5, A6", "I2", "planted_classes.TreeMaskDoubleCounted",
     "test_bug_classes.py::test_backend_plant_reported[TreeMaskDoubleCounted]"),
    ("SGLang #33253", "B1, B2", "I16", "planted_mutants.pad_kv_into_real_slots",
     "test_bug_classes.py::test_pad_slots_of_the_breakable_runner"),
    ("SGLang #26655", "A4", "I9, I14, I7, I10", "planted_classes.UnboundReplaySlice",
     "test_bug_classes.py::test_backend_plant_reported[UnboundReplaySlice]"),
    ("vLLM #44492", "E1, A7", "I13", "planted_classes.QLenOneGraphs",
     "test_bug_classes.py::test_backend_plant_reported[QLenOneGraphs]"),
    ("vLLM #32645", "B3", "I13 (the captured layout)", "planted_classes.CaptureBatchUnpadded",
     "test_bug_classes.py::test_backend_plant_reported[CaptureBatchUnpadded]"),
    ("vLLM #51865", "E2, A7", "I11", "planted_classes.dispatch_by_shape",
     "test_bug_classes.py::test_runner_plant_reported[dispatch_by_shape]"),
    ("vLLM #53407, #54933", "A7, E2", "I11 (captured buckets)", "planted_classes.capture_ladder_capped",
     "test_bug_classes.py::test_runner_plant_reported[capture_ladder_capped]"),
    ("vLLM #40807, #40831", "C1", "I15", "planted_classes.HostListInCapture",
     "test_bug_classes.py::test_backend_plant_reported[HostListInCapture]"),
    ("SGLang #30944", "E1", "I11 (column executor: the engine's graph runners)",
     "planted_classes.draft_extend_graph_whitelist",
     "test_bug_classes.py::test_whitelist_reported_by_the_runner_suite"),
    ("SGLang 0.5.10 fix of #19807", "A1, A2", "I1", "planted_bugs.StepsStride",
     "test_planted_bugs.py::test_suite_reports_planted_bug[bug_steps_stride]"),
]
