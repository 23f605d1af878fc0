"""Benchmark workloads, timing and bandwidth accounting shared by the bench files.

Every workload holds several input sets (q, KV pool, shuffled page table) and rotates
through them call by call, so that no set stays in L2 between calls; timings are
``triton.testing.do_bench`` medians (it also flushes L2 before each call). Bandwidth is
counted from explicit bytes: the KV cache read once, plus q and out.
"""

import math
import os
import time

import torch
import triton

from attn_backends_kernels.attention_core import decode_workspace
from attn_backends_kernels.decode_attention import decode_attention_fwd
from attn_backends_kernels.extend_attention import extend_attention_fwd
from attn_backends_kernels.mla.attention import mla_attention_fwd

NUM_SETS = 2
# "cpu" (with TRITON_INTERPRET=1 and small shapes) only to smoke-test this file.
DEVICE = os.environ.get("BENCH_DEVICE", "cuda")
# Defaults: the kernel wrappers' own launch configs at these shapes (the winners of the H200
# sweeps; bench/tune.py re-measures them). MLA decode: 64-token tiles, 8 warps, 3 stages
# (bench/RESULTS.md, 'MLA kernels').
DEFAULTS = {
    "gqa_decode": dict(num_kv_splits=4, block_n=32, num_warps=4, num_stages=2),
    "gqa_verify4": dict(num_kv_splits=4, block_n=64, num_warps=4, num_stages=2),
    "gqa_verify8": dict(num_kv_splits=4, block_n=64, num_warps=4, num_stages=2),
    "mla_decode": dict(num_kv_splits=4, block_n=64, num_warps=8, num_stages=3),
    "mla_verify4": dict(num_kv_splits=2, block_n=64, num_warps=8, num_stages=2, block_w=4,
                        block_h=16),
}


def median_us(fn):
    if DEVICE == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def copy_bandwidth_gbs(nbytes=1 << 30):
    """Device-to-device copy bandwidth (read + write bytes per second), in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_(0, 255)
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src))
    return 2 * nbytes / us / 1e3


def paged_layout(bs, seq_len, page_size, seed):
    """Page table [bs, pages] over a random permutation of pages 1..; page 0 unused."""
    pages = math.ceil(seq_len / page_size)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(bs * pages, generator=g) + 1
    table = perm.view(bs, pages).to(torch.int32).to(DEVICE)
    return table, 1 + bs * pages


class Workload:
    """One kernel call on rotating input sets; ``run(**cfg)`` times it."""

    def __init__(self, name, nbytes, sets, call):
        self.name, self.nbytes, self.sets, self.call = name, nbytes, sets, call

    def fn(self, **cfg):
        it = iter(range(1 << 62))
        return lambda: self.call(self.sets[next(it) % len(self.sets)], **cfg)

    def time_us(self, **cfg):
        return median_us(self.fn(**cfg))

    def output(self, **cfg):
        """Output on input set 0 (to check a tuned config against the default one)."""
        return self.call(self.sets[0], **cfg).clone()


def gqa(bs=64, kv_len=4096, H=32, Hkv=8, D=128, page_size=16, W=1, dtype=torch.bfloat16,
        max_splits=16):
    sets = []
    for s in range(NUM_SETS):
        table, num_pages = paged_layout(bs, kv_len, page_size, seed=s)
        k = torch.randn(num_pages * page_size, Hkv, D, device=DEVICE, dtype=dtype)
        v = torch.randn(num_pages * page_size, Hkv, D, device=DEVICE, dtype=dtype)
        sets.append(dict(
            q=torch.randn(bs * W, H, D, device=DEVICE, dtype=dtype), k=k, v=v, pt=table,
            lens=torch.full((bs,), kv_len, dtype=torch.int32, device=DEVICE),
            cu=torch.arange(0, bs * W + 1, W, dtype=torch.int32, device=DEVICE),
            out=torch.empty(bs * W, H, D, device=DEVICE, dtype=dtype),
            ws=decode_workspace(bs * W, H, D, max_splits, DEVICE)))
    el = torch.finfo(dtype).bits // 8
    nbytes = el * (bs * kv_len * Hkv * 2 * D + 2 * bs * W * H * D)

    def call(d, num_kv_splits, **tune):
        ws = (d["ws"][0][:, :, :num_kv_splits], d["ws"][1][:, :, :num_kv_splits], d["ws"][2])
        if W == 1:
            return decode_attention_fwd(d["q"], d["k"], d["v"], d["pt"], d["lens"], page_size,
                                        D ** -0.5, num_kv_splits, d["out"], ws, **tune)
        return extend_attention_fwd(d["q"], d["k"], d["v"], d["pt"], d["lens"], d["cu"],
                                    page_size, D ** -0.5, W, d["out"],
                                    num_kv_splits=num_kv_splits, workspace=ws, **tune)

    name = "gqa_decode" if W == 1 else f"gqa_verify{W}"
    return Workload(name, nbytes, sets, call)


def mla(bs=64, kv_len=4096, H=16, page_size=64, W=1, dtype=torch.bfloat16, max_splits=32):
    sets = []
    for s in range(NUM_SETS):
        table, num_pages = paged_layout(bs, kv_len, page_size, seed=s)
        sets.append(dict(
            q=torch.randn(bs * W, H, 576, device=DEVICE, dtype=dtype),
            kv=torch.randn(num_pages * page_size, 1, 576, device=DEVICE, dtype=dtype),
            pt=table, lens=torch.full((bs,), kv_len, dtype=torch.int32, device=DEVICE),
            out=torch.empty(bs * W, H, 512, device=DEVICE, dtype=dtype),
            ws=decode_workspace(bs * W, H, 512, max_splits, DEVICE)))
    el = torch.finfo(dtype).bits // 8
    nbytes = el * (bs * kv_len * 576 + bs * W * H * (576 + 512))

    def call(d, num_kv_splits, **tune):
        ws = (d["ws"][0][:, :, :num_kv_splits], d["ws"][1][:, :, :num_kv_splits], d["ws"][2])
        return mla_attention_fwd(d["q"], d["kv"], d["pt"], d["lens"], page_size, 576 ** -0.5,
                                 num_kv_splits, d["out"], q_per_req=W, workspace=ws, **tune)

    name = "mla_decode" if W == 1 else f"mla_verify{W}"
    return Workload(name, nbytes, sets, call)


def all_workloads():
    return [gqa(), gqa(W=4), gqa(W=8), mla(), mla(W=4)]
