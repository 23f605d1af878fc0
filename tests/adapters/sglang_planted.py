"""Planted engine bugs for the SGLang adapter's tests. ShortReplayBackend: SGLang's own TritonAttnBackend whose graph
replay (0.5.13+: a replay's out-of-graph prep) writes every request's KV extent one token short (what a
replay that takes its lengths from a stale buffer does). Eager metadata and the capture are SGLang's, unchanged."""
from sglang_adapter.triton import SGLangTritonBackend, SGLangTritonTreeVerify


class ShortReplayBackend(SGLangTritonBackend):
    name = "sglang_triton_short_replay"

    def engine_class(self) -> type:
        base = super().engine_class()

        class ShortReplay(base):
            def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, *rest):
                super().init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens - 1, seq_lens_sum - bs,
                                                                *rest)

            def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):   # SGLang 0.5.13+
                if not in_capture:
                    forward_batch.seq_lens = forward_batch.seq_lens - 1
                super().init_forward_metadata_out_graph(forward_batch, in_capture)

        return ShortReplay


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
