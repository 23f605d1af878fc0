"""Triton kernels: paged attention (MHA/GQA decode, extend/verify, MLA), index building, KV store."""
import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from ._interpret_compat import patch as _patch

    _patch()
