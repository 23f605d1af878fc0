"""The split-KV count of the triton backends (``triton_common.choose_num_kv_splits``): about
``per_sm`` programs per SM, a power of two, never more than the pages, at most 32 splits, and 64
for a batch of few programs with at most 4 query rows. Host logic: the SM count is patched and
the CUDA device is only a ``torch.device`` object, so this runs without a GPU."""
import pytest
import torch

from attn_backends.backends import triton_common as tc

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(tc, "sm_count", lambda index: 132)


@pytest.mark.parametrize("programs,per_sm,width,max_pages,want", [
    (8, 16, 1, 2048, 64),      # GQA 8 KV heads, decode bs 1: 64 (32 before 0bf745b)
    (32, 16, 1, 2048, 32),     # bs 4 keeps 32 (64 measured 3-8 % slower)
    (128, 16, 1, 2048, 16),    # bs 16: per_sm x SMs / programs
    (8, 8, 4, 2048, 64),       # GQA 64/8 verify4 bs 1
    (8, 16, 8, 2048, 32),      # the 8-row tree keeps 32 at bs 1
    (1, 2, 1, 512, 64),        # MLA16 decode bs 1
    (4, 2, 1, 512, 64),        # MLA16 decode bs 4
    (8, 2, 1, 512, 32),        # MLA16 decode bs 8: wants 33
    (1, 2, 1, 40, 32),         # never more than the pages (a power of two below 40)
    (1, 2, 1, 1, 1),
])
def test_split_count(h200, programs, per_sm, width, max_pages, want):
    assert tc.choose_num_kv_splits(programs, CUDA0, max_pages, per_sm, width) == want


def test_interpreter_takes_two_splits():
    assert tc.choose_num_kv_splits(8, torch.device("cpu"), 2048, 16, 1) == 2
