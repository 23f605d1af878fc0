"""Kernel-test setup: run Triton kernels in the interpreter when no GPU is present.

``@triton.jit`` picks the interpreter when the decorator runs (at import of a kernel
module, triton 3.6 reads ``TRITON_INTERPRET`` through ``triton.knobs`` then), so the
variable must be set before any ``kernels.*`` module is imported; conftest files are
imported before test modules, which is early enough.
"""

import os
import pathlib

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_interpreter_scalar_index():
    """Let interpreted kernels use loaded scalars as ``range`` bounds under numpy >= 2.4.

    The triton 3.6 interpreter keeps a scalar loaded from memory as a 1-element array and
    converts it with ``int(array)``, which numpy 2.4 refuses for arrays with ndim > 0
    (``for n0 in range(start, end, BLOCK_N)`` then fails). Compiled kernels are unaffected.
    """
    import numpy as np

    try:
        int(np.zeros(1))
        return  # this numpy still converts 1-element arrays
    except TypeError:
        pass
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_scalar_index()


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    here = pathlib.Path(__file__).parent
    for item in items:
        if "cuda" in item.keywords and here in pathlib.Path(item.fspath).parents:
            item.add_marker(skip)
