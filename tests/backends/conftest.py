"""Fixtures of the backend tests."""
import pytest

from attn_backends.backends import triton_common as tc


@pytest.fixture
def h200(monkeypatch):
    """An H200's 132 SMs for the split rules' host logic (the CUDA device a ``torch.device`` object only)."""
    monkeypatch.setattr(tc, "sm_count", lambda index: 132)
