"""attn-backends adapters for SGLang's own attention backends (installed apart from the project:
``adapters/install_engines.sh``; ``docs/engines.md`` says how to run the check on them).

``sglang_adapter.triton:SGLangTritonBackend``: SGLang's ``TritonAttnBackend``.
Stand-ins: ``standins.py`` (modules that cannot exist on a CPU) and ``engine.py`` (the
ModelRunner, KV pool and server args an SGLang backend is constructed from).
"""
