"""Benchmarks need a GPU: every benchmark item skips cleanly without CUDA."""

import pathlib

import pytest
import torch

HERE = pathlib.Path(__file__).parent


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="benchmarks need CUDA")
    for item in items:
        if HERE in pathlib.Path(item.fspath).parents:
            item.add_marker(skip)
