"""attn-backends adapter for vLLM's own attention backend (installed apart from the project:
``adapters/install_engines.sh vllm-0.33.0``; ``docs/engines.md`` says how to run the check on it).

``vllm_adapter.triton:VLLMTritonBackend``: vLLM v1's ``TritonAttentionMetadataBuilder`` driven as its V2
GPU model runner drives it (``engine.py``: the runner's persistent inputs, written by vLLM's kernels) and
its ``TritonAttentionImpl`` forward (``forward.py``), vLLM 0.33.
"""
