"""Test setup shared by every test directory.

Without CUDA, Triton kernels run in the interpreter: ``@triton.jit`` reads
``TRITON_INTERPRET`` when a kernel module is imported, so the variable is set here, at the
top of the root conftest, before any test module (or ``kernels.*``) imports triton.
GPU tests carry ``@pytest.mark.cuda`` (the marker is declared in pyproject.toml) and are
skipped, with the reason, on a machine without CUDA.

Plugins that the machine has installed (the ``attn_backends.backends`` entry-point group) must
not change what our tests see: tests run the suites on :func:`registry.builtin_names`, and a
test that needs the registry to hold only our built-ins takes the ``builtin_registry`` fixture.
"""
import os
import sys
from pathlib import Path

import torch  # does not import triton

# the shared references and plants (support/), and the groups' modules, which import helpers of each other
for _group in ("support", "core", "backends", "check", "kernels", "runtime", "bench"):
    sys.path.insert(0, str(Path(__file__).resolve().parent / _group))

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("ATTN_BACKENDS_BACKEND", None)   # a user's select() override must not change what tests see

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def rng():
    import random
    return random.Random(0)


@pytest.fixture
def no_kernel(monkeypatch):
    """Any torch_native attention launch fails the test: the error must come first."""
    from attn_backends.backends.torch_native import TorchNativeBackend

    def boom(*a, **k):
        raise AssertionError("an attention kernel ran on a bad batch")
    monkeypatch.setattr(TorchNativeBackend, "_run", boom)


@pytest.fixture
def builtin_registry(monkeypatch):
    """The registry with our built-ins only: no installed plugin, no run-time registration."""
    from attn_backends import registry
    monkeypatch.setattr(registry, "_installed", lambda: {})
    monkeypatch.setattr(registry, "_extra", {})
