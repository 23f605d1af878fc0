"""Shared set-up of the bad-input tests (test_bad_input.py, test_bad_config.py); their
fixtures ``rng`` and ``no_kernel`` live in conftest.py."""
import torch

from attn_backends import ModelConfig, get_backend
from attn_backends.check.scenarios import make_memory, materialize

MHA = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16)
MLA = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=1, is_mla=True, kv_lora_rank=32,
                  qk_rope_head_dim=8)


def setup(cfg=MHA, *, num_pages=64, max_reqs=8, max_context_len=128):
    mem = make_memory(cfg, num_pages=num_pages, max_reqs=max_reqs, max_context_len=max_context_len)
    return mem, get_backend("torch_native", cfg, mem)


def batch_of(backend, mem, scn):
    return materialize(scn, mem, backend.get_cuda_graph_seq_len_fill_value()).batch


def qkv(cfg, rows):
    q = torch.randn(rows, cfg.num_q_heads, cfg.qk_dim)
    k = torch.randn(rows, cfg.num_kv_heads, cfg.qk_dim)
    v = torch.randn(rows, cfg.num_kv_heads, cfg.out_dim)
    return q, k, v
