"""The example plugin of docs/plugin-guide.md (examples/sdpa_backend) passes the layout suite and
matches the float64 reference; CI also installs it and runs `attn-backends check` on it."""
import pathlib

import pytest
import torch
from reference import dense_reference
from test_torch_native import named_batches

from attn_backends import ModelConfig
from attn_backends.check.scenarios import make_memory, materialize
from attn_backends.check.suite import run_suite
from attn_backends.registry import load_class

ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGET = f"{ROOT / 'examples' / 'sdpa_backend' / 'sdpa_backend' / '__init__.py'}:SdpaBackend"


@pytest.fixture(scope="module")
def cls():
    return load_class(TARGET)


def test_example_passes_the_layout_suite(cls):
    report = run_suite(cls, cases=4, seed=3)
    assert report.ok, "\n".join(map(str, report.failures[:5]))


@pytest.mark.parametrize("name", ["decode_padded", "extend_ragged", "verify_tree", "draft_extend",
                                  "draft_decode_topk4"])
def test_example_matches_float64(cls, name):
    cfg = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=16)
    mem = make_memory(cfg, num_pages=140, max_reqs=16, max_context_len=128, seed=5)
    be = cls(cfg, mem)
    m = materialize(named_batches()[name](), mem, be.get_cuda_graph_seq_len_fill_value())
    g = torch.Generator().manual_seed(1)
    n = m.batch.num_tokens
    q, k, v = (torch.randn(n, h, 32, generator=g) for h in (4, 2, 2))
    be.init_forward_metadata(m.batch)
    out = be.forward(q, k, v, cfg.layer(0), m.batch)
    ref = dense_reference(m.batch, mem, 0, q, cfg.layer(0).scaling, cfg.kv_lora_rank)
    real = ~ref[:, 0, 0].isnan()
    err = float((out[real].double() - ref[real]).norm() / ref[real].norm())
    assert err < 1e-5, f"relative error {err:.2e}"


def test_ci_installs_and_checks_the_example():
    script = (ROOT / ".ci" / "run").read_text()
    assert "pip install --no-deps -e examples/sdpa_backend" in script
    assert "attn-backends check --backend example_sdpa" in script
