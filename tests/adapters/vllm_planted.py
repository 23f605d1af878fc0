"""Planted bugs in vLLM's TritonAttentionMetadataBuilder for the vLLM adapter's tests (subclasses of vLLM's
own class; the adapter, the runner's input preparation and vLLM's kernels unchanged).

ShortSeqLensBackend: ``build`` takes one token off every request's ``seq_lens`` in the runner's persistent
buffer (what a builder that subtracts the new token from already-final lengths does), in eager steps,
captures and replays alike.
CapturedCopyBackend: ``build_for_cudagraph_capture`` hands the graph a copy of ``seq_lens`` instead of the
runner's persistent buffer (what a capture path that makes its own tensor does): the graph then reads
the capture's lengths on every replay.
"""
from vllm_adapter.triton import VLLMTritonBackend


class ShortSeqLensBackend(VLLMTritonBackend):
    name = "vllm_triton_short_seq_lens"

    def builder_class(self) -> type:
        base = super().builder_class()

        class ShortSeqLens(base):
            def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
                common_attn_metadata.seq_lens.sub_(1)
                return super().build(common_prefix_len, common_attn_metadata, fast_build)

        return ShortSeqLens


class CapturedCopyBackend(VLLMTritonBackend):
    name = "vllm_triton_captured_copy"

    def builder_class(self) -> type:
        base = super().builder_class()

        class CapturedCopy(base):
            def build_for_cudagraph_capture(self, common_attn_metadata):
                meta = super().build_for_cudagraph_capture(common_attn_metadata)
                meta.seq_lens = meta.seq_lens.clone()
                return meta

        return CapturedCopy
