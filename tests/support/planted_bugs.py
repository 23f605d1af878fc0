"""Copies of the reference backend, each with one known bug planted (its class and source thread
in its docstring).

The suite must report every one of them (tests/check/test_planted_bugs.py)."""
from __future__ import annotations

import dataclasses

import torch

from attn_backends import ForwardMode
from attn_backends.backends.torch_native import TorchNativeBackend


class PackedReplay(TorchNativeBackend):
    """A1 (sgl #19807): replay builds cu_seqlens_q = cumsum(accept_lens), the runner strides N."""

    name = "bug_packed_replay"
    replay_work = True      # its replay writes the layout: the step's prep runs before it

    def init_forward_metadata_replay_cuda_graph(self, inputs):
        super().init_forward_metadata_replay_cuda_graph(inputs)
        spec = inputs.spec_info
        if inputs.key.forward_mode == ForwardMode.DRAFT_EXTEND:
            lay = self.forward_metadata.layout
            torch.cumsum(spec.accept_lens.to(torch.int32), 0, out=lay.cu_seqlens_q[1:])


class StepsStride(TorchNativeBackend):
    """A2 (sgl #27545): stride num_steps + 1 instead of N while topk > 1, in eager and replay alike."""

    name = "bug_steps_stride"
    replay_work = True      # its replay writes the layout: the step's prep runs before it

    def _wrong_stride(self, spec):
        lay = self.forward_metadata.layout
        if spec is not None and spec.topk > 1 and lay.mode == ForwardMode.TARGET_VERIFY:
            stride = spec.num_steps + 1
            lay.cu_seqlens_q.copy_(torch.arange(lay.bs + 1, dtype=torch.int32,
                                                device=lay.cu_seqlens_q.device) * stride)
            lay.max_seq_len_q = stride

    def init_forward_metadata(self, batch):
        super().init_forward_metadata(batch)
        self._wrong_stride(batch.spec_info)

    def init_forward_metadata_capture_cuda_graph(self, inputs):
        super().init_forward_metadata_capture_cuda_graph(inputs)
        self._wrong_stride(inputs.spec_info)

    def init_forward_metadata_replay_cuda_graph(self, inputs):
        super().init_forward_metadata_replay_cuda_graph(inputs)
        self._wrong_stride(inputs.spec_info)


class NoPlusW(TorchNativeBackend):
    """A3 (sgl KNOWN_FAILURES C.3): replay sets the KV extent to the prefix, without + W."""

    name = "bug_no_plus_w"
    replay_work = True      # its replay writes the layout: the step's prep runs before it

    def init_forward_metadata_replay_cuda_graph(self, inputs):
        super().init_forward_metadata_replay_cuda_graph(inputs)
        lay = self.forward_metadata.layout
        lay.seq_lens_k.sub_(lay.width)


class StalePadRows(TorchNativeBackend):
    """B1 (sgl #10892, #28569): replay refreshes rows [:raw_bs] only; pad rows keep old values.
    The backend keeps its own copies of three layout fields per key (as SGLang's backends keep
    their metadata buffers) and copies only the real rows of the step's layout into them."""

    name = "bug_stale_pad_rows"
    FIELDS = ("seq_lens_k", "page_table", "prefix_lens")

    def __init__(self, config, memory):
        super().__init__(config, memory)
        self._own = {}                            # key -> {field: the backend's copy}

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        self._own.clear()

    def _metadata(self, view, key):
        if key is not None:
            self._own[key] = {n: getattr(view.layout, n).clone() for n in self.FIELDS}
        return super()._metadata(view, key)

    def _update(self, meta, view):
        own = self._own.get(meta.key) if meta.key is not None else None
        if own is None:
            return
        for n, t in own.items():                  # the bug: rows raw_bs.. keep what they held
            t[:view.raw_bs].copy_(getattr(view.layout, n)[:view.raw_bs])
        meta.view = view._replace(layout=dataclasses.replace(view.layout, **own))

    def _extra_graph_buffers(self):
        return {f"own.{n}/{k}": t for k, fields in self._own.items() for n, t in fields.items()}


class ReallocOnReplay(TorchNativeBackend):
    """A4 (rtp-llm #1259, sgl #37975): replay builds fresh tensors instead of writing in place."""

    name = "bug_realloc_on_replay"
    replay_work = True      # its replay writes the layout: the step's prep runs before it

    def init_forward_metadata_replay_cuda_graph(self, inputs):
        super().init_forward_metadata_replay_cuda_graph(inputs)
        meta = self.forward_metadata
        lay = meta.layout
        fresh = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(lay).items()}
        self.forward_metadata = dataclasses.replace(meta, view=meta.view._replace(layout=type(lay)(**fresh)))


class HostItemInReplay(TorchNativeBackend):
    """C1 (transformers #45323, sgl #29413): a host .item() on a device tensor in replay prep."""

    name = "bug_host_item"

    def init_forward_metadata_replay_cuda_graph(self, inputs):
        self._max_len_hint = int(inputs.seq_lens.max().item())
        super().init_forward_metadata_replay_cuda_graph(inputs)


PLANTED = {
    # bug class: (modes that exercise it, invariants that must report it)
    PackedReplay: (["draft_extend"], {"I1"}),
    StepsStride: (["verify_tree"], {"I1"}),
    NoPlusW: (["decode", "verify_chain", "draft_extend"], {"I1", "I5"}),
    StalePadRows: (["decode", "verify_chain"], {"I3"}),
    ReallocOnReplay: (["decode", "verify_tree"], {"I2"}),
    HostItemInReplay: (["decode"], {"I15"}),
}


class NoisyForward(TorchNativeBackend):
    """Runner-level (I9, I14): a forward whose output differs from run to run; the layouts are
    correct, so only the runner suite sees it."""

    name = "bug_noisy_forward"

    def _run(self, q, layer, meta):
        out = super()._run(q, layer, meta)
        return out + 1e-2 * torch.randn_like(out)


class ScaleBlindV(TorchNativeBackend):
    """FP8 (#41): V read without its scale (the cache's value / scale taken for the value). A cache
    in the model's dtype has scale 1, so only ``check --kv-dtype fp8_*`` can see it."""

    name = "bug_scale_blind_v"

    def _run(self, q, layer, meta):
        return super()._run(q, dataclasses.replace(layer, v_scale=1.0), meta)
