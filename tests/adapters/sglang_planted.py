"""Planted engine bugs for the SGLang adapter's tests. ShortReplayBackend: SGLang's own TritonAttnBackend whose graph
replay (0.5.13+: a replay's out-of-graph prep) writes every request's KV extent one token short (what a
replay that takes its lengths from a stale buffer does). Eager metadata and the capture are SGLang's, unchanged."""
import torch
from sglang_adapter.triton import SGLangTritonBackend, SGLangTritonTreeVerify
from sglang_adapter.trtllm_mla import SGLangTRTLLMMLABackend


def _short_replay(base: type) -> type:
    """``base`` (an SGLang attention backend class) whose replay writes every KV extent one token short:
    its replay method (0.5.9 / 0.5.10) or a replay's out-of-graph prep (0.5.13+)."""
    class ShortReplay(base):
        def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, *rest):
            super().init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens - 1, seq_lens_sum - bs,
                                                            *rest)

        def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):   # SGLang 0.5.13+
            if not in_capture:
                forward_batch.seq_lens = forward_batch.seq_lens - 1
            super().init_forward_metadata_out_graph(forward_batch, in_capture)

    return ShortReplay


class ShortReplayBackend(SGLangTritonBackend):
    name = "sglang_triton_short_replay"

    def engine_class(self) -> type:
        return _short_replay(super().engine_class())


class OpenTreeReplayBackend(SGLangTritonTreeVerify):
    """SGLang's replay followed by a verify mask opened wholly (every draft token sees every other:
    what a replay that skips the mask copy and finds ones there reads)."""

    name = "sglang_triton_open_tree_replay"

    def engine_class(self) -> type:
        base = super().engine_class()

        class OpenTree(base):
            def init_forward_metadata_replay_cuda_graph(self, *args, **kwargs):
                super().init_forward_metadata_replay_cuda_graph(*args, **kwargs)
                self.cuda_graph_custom_mask.fill_(1)

        return OpenTree


class ShortTRTLLMReplayBackend(SGLangTRTLLMMLABackend):
    """SGLang's TRTLLMMLABackend whose replay (0.5.9 / 0.5.10: its replay method; 0.5.13+: a replay's
    init_forward_metadata_out_graph) writes every request's KV extent one token short."""

    name = "sglang_trtllm_mla_short_replay"

    def engine_class(self) -> type:
        return _short_replay(super().engine_class())


class ShortDraftReplayBackend(SGLangTritonBackend):
    """SGLang's TritonMultiStepDraftBackend whose replay prepares every draft step from a committed
    prefix one token short (its seq_lens and the positions its kv_indptr comes from)."""

    name = "sglang_triton_short_draft_replay"

    def draft_engine_class(self) -> type:
        base = super().draft_engine_class()

        def short(fb):      # clamped at 0: a negative prefix makes SGLang's index kernel store out of bounds
            fb.seq_lens, fb.positions = (fb.seq_lens - 1).clamp(min=0), (fb.positions - 1).clamp(min=0)

        class ShortReplay(base):
            def init_forward_metadata_replay_cuda_graph(self, forward_batch, bs):
                short(forward_batch)
                super().init_forward_metadata_replay_cuda_graph(forward_batch, bs)

            def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):   # SGLang 0.5.13+
                if not in_capture:
                    short(forward_batch)
                super().init_forward_metadata_out_graph(forward_batch, in_capture)

        return ShortReplay


class PackedDraftExtendTRTLLMBackend(SGLangTRTLLMMLABackend):
    """SGLang 0.5.13+'s TRTLLMMLABackend whose draft-extend replay writes a packed cu_seqlens_q (N - 1 rows a
    request: finding (d)'s class) into the buffer the graph holds. That buffer is constant state the adapter
    leaves out of the poisoning (0.5.23 writes it at graph creation only); I1 must still see the write."""

    name = "sglang_trtllm_mla_packed_draft_extend"

    def engine_class(self) -> type:
        base = super().engine_class()

        class PackedReplay(base):
            def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
                super().init_forward_metadata_out_graph(forward_batch, in_capture)
                if not in_capture and forward_batch.forward_mode.is_draft_extend_v2():
                    bs, m = forward_batch.batch_size, self.decode_cuda_graph_metadata[forward_batch.batch_size]
                    rows = torch.arange(1, bs + 1, dtype=torch.int32, device=m.cu_seqlens_q.device)
                    m.cu_seqlens_q[1:bs + 1].copy_(rows * (self.num_draft_tokens - 1))

        return PackedReplay
