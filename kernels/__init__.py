"""Triton kernels: paged attention (MHA/GQA decode, extend/verify, MLA), index building, KV store."""
import triton

if triton.knobs.runtime.interpret:      # TRITON_INTERPRET as Triton reads it (1, true, yes, on)
    from ._interpret_compat import patch as _patch

    _patch()
