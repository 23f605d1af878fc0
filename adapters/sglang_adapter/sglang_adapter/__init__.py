"""attn-backends adapters for SGLang's own attention backends (installed apart from the project:
``adapters/install_engines.sh``; ``docs/engines.md`` says how to run the check on them).

``sglang_adapter.triton:SGLangTritonBackend``: SGLang's ``TritonAttnBackend`` (``SGLangTritonTreeVerify``:
its verify modes with trees; chain draft decode through its ``TritonMultiStepDraftBackend``, ``draft.py``),
SGLang 0.5.9 / 0.5.10 and 0.5.13+ (``ingraph.py``: the in-graph metadata API);
``sglang_adapter.trtllm_mla:SGLangTRTLLMMLABackend``: its ``TRTLLMMLABackend``, metadata only (the forward
is CUDA-only), the same versions.
Stand-ins: ``standins.py`` (modules that cannot exist on a CPU), ``engine.py`` (the ModelRunner, KV
pool and server args an SGLang backend is constructed from) and ``ingraph.py`` (what 0.5.13+ reads besides).
"""
