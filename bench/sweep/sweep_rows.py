"""The sweep's workload matrix (issue #10), one row's data, and its byte and flop counts.

A row is (workload, bs, kv): ``bs`` requests, each attending to exactly ``kv`` KV tokens
(its prefix plus this forward's ``W`` tokens), bf16, pages shuffled (``make_memory`` with
``page_order="shuffled"``). Ours and every FlashInfer configuration read the same KV pool,
the same q and the same page tables.

Counts (``Workload.nbytes`` / ``Workload.flops``), per row:

* bytes = the KV of every request read once + q + out
  (GQA ``bs*kv*Hkv*(D+Dv)*2``; MLA ``bs*kv*576*2``; q ``bs*W*H*Dqk*2``; out ``bs*W*H*Dv*2``);
* flops = ``2*bs*W*H*kv*(Dqk+Dv)`` (QK^T and PV over the full kv for every query row;
  causal verify skips at most W-1 keys of kv, below 0.4% here).

The roofline rule: with ``ridge = matmul_tflops*1e12 / (copy_gbs*1e9)`` (both measured in
the same run: a bf16 8192^3 matmul and a 1 GiB device-to-device copy), a row is
compute-bound when ``flops / bytes > ridge``, memory-bound otherwise.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Optional

import torch

from attn_backends import ForwardBatch, ForwardMode, ModelConfig, SpecInfo
from attn_backends.backends.triton_common import WIDE_MAX_KV_SPLITS
from attn_backends.check.scenarios import Scenario, make_memory, materialize, verify_spec

BATCHES = (1, 4, 16, 64, 128)
KVS = (2048, 8192, 32768)
QUICK_BATCHES = (1, 16, 128)
QUICK_KVS = (8192,)
SMOKE_BS, SMOKE_KV = 2, {"gqa": 40, "mla": 100}   # CPU interpreter; last pages partly full
TREE_N, TREE_TOPK, TREE_STEPS = 8, 4, 3
BF16 = 2                             # bytes per element


@dataclass(frozen=True)
class Workload:
    name: str
    family: str          # "gqa" | "mla"
    mode: str            # "decode" | "verify" (chain, causal) | "tree"
    heads: int
    kv_heads: int        # 1 for MLA (one latent head)
    qk_dim: int          # 128 | 576 (latent 512 + rope 64)
    v_dim: int           # 128 | 512
    page_size: int
    width: int           # W: query rows per request
    topk: int = 1

    @property
    def backend(self) -> str:
        return "triton_mla" if self.family == "mla" else "triton"

    def config(self, dtype=torch.bfloat16) -> ModelConfig:
        if self.family == "mla":
            return ModelConfig(num_layers=1, num_q_heads=self.heads, is_mla=True,
                               page_size=self.page_size, dtype=dtype)
        return ModelConfig(num_layers=1, num_q_heads=self.heads, num_kv_heads=self.kv_heads,
                           head_dim=self.qk_dim, page_size=self.page_size, dtype=dtype)

    def kv_bytes_per_token(self) -> int:
        if self.family == "mla":
            return self.qk_dim * BF16
        return self.kv_heads * (self.qk_dim + self.v_dim) * BF16

    def nbytes(self, bs: int, kv: int) -> int:
        rows = bs * self.width * self.heads
        return bs * kv * self.kv_bytes_per_token() + rows * (self.qk_dim + self.v_dim) * BF16

    def flops(self, bs: int, kv: int) -> int:
        return 2 * bs * self.width * self.heads * kv * (self.qk_dim + self.v_dim)

    def describe(self) -> dict:
        return dict(workload=self.name, family=self.family, mode=self.mode, heads=self.heads,
                    kv_heads=self.kv_heads, qk_dim=self.qk_dim, v_dim=self.v_dim,
                    page_size=self.page_size, width=self.width, topk=self.topk)


def _gqa(heads: int, mode: str, width: int, topk: int = 1) -> Workload:
    name = f"gqa{heads}_{mode}" + (str(width) if mode != "decode" else "")
    return Workload(name, "gqa", mode, heads, 8, 128, 128, 16, width, topk)


def _mla(heads: int, mode: str, width: int) -> Workload:
    name = f"mla{heads}_{mode}" + (str(width) if mode != "decode" else "")
    return Workload(name, "mla", mode, heads, 1, 576, 512, 64, width)


WORKLOADS = tuple(
    [w for h in (32, 64) for w in (_gqa(h, "decode", 1), _gqa(h, "verify", 4),
                                   _gqa(h, "tree", TREE_N, TREE_TOPK))]
    + [w for h in (16, 128) for w in (_mla(h, "decode", 1), _mla(h, "verify", 4))])
BY_NAME = {w.name: w for w in WORKLOADS}


def matrix(quick: bool = False, only: Optional[str] = None, smoke: bool = False) -> list:
    """``[(family, bs, kv, [workloads])]``, the quick points first (a run cut short keeps
    them). The workloads of a group share one KV memory and one set of requests."""
    families = [f for f in ("gqa", "mla") if only in (None, f)]
    group = lambda fam, bs, kv: (fam, bs, kv, [w for w in WORKLOADS if w.family == fam])  # noqa: E731
    if smoke:
        return [(f, SMOKE_BS, SMOKE_KV[f], [smoke_workload(w) for w in group(f, 0, 0)[3]]) for f in families]
    first = [(f, bs, kv) for kv in QUICK_KVS for f in families for bs in QUICK_BATCHES]
    rest = [(f, bs, kv) for kv in KVS for f in families for bs in BATCHES if (f, bs, kv) not in first]
    return [group(*key) for key in first + ([] if quick else rest)]


def smoke_workload(wl: Workload) -> Workload:
    """The interpreter's version of ``wl``: the same mode, W, page size, head dims and GQA
    group, fewer heads (GQA one KV head; MLA-128 32 heads, still two head blocks)."""
    if wl.family == "mla":
        return replace(wl, heads=min(wl.heads, 32))
    return replace(wl, heads=wl.heads // wl.kv_heads, kv_heads=1)


def estimate_bytes(family: str, bs: int, kv: int) -> int:
    """Device memory a group needs at most: the KV pool, FlashInfer's flattened tree mask,
    our split-KV workspace (WIDE_MAX_KV_SPLITS at most) and 1 GiB for workspaces and graph pools."""
    wls = [w for w in WORKLOADS if w.family == family]
    wl = wls[0]
    pool = (bs * (kv // wl.page_size) + 1) * wl.page_size * wl.kv_bytes_per_token()
    mask = max(bs * w.width * kv if w.mode == "tree" else 0 for w in wls)
    split_ws = max(bs * w.width * w.heads * WIDE_MAX_KV_SPLITS * (w.v_dim + 1) * 4 for w in wls)
    return pool + mask + split_ws + (1 << 30)


@dataclass
class Group:
    """The KV memory and the requests of one (family, bs, kv): every request holds exactly
    ``kv`` tokens on shuffled pages (``materialize`` of a DECODE scenario)."""

    family: str
    bs: int
    kv: int
    mem: object          # KVMemory
    base: object         # ForwardBatch of the DECODE scenario (raw_bs == bs: no padding)
    dtype: torch.dtype


@dataclass
class Row:
    wl: Workload
    bs: int
    kv: int
    cfg: ModelConfig
    mem: object          # KVMemory (the group's)
    batch: object        # ForwardBatch of this workload's mode over the group's requests
    q: torch.Tensor      # [bs*W, H, qk_dim], the group's dtype

    @property
    def layer(self):
        return self.cfg.layer(0)


def build_group(wl: Workload, bs: int, kv: int, device, seed: int = 0, dtype=None) -> Group:
    """The KV memory of ``wl``'s family (every workload of a group has the same KV heads,
    head dims and page size), pages shuffled, filled on the device (no host copy), and
    ``bs`` requests of ``kv`` tokens each. bf16, except in the Triton interpreter (CPU),
    which misreads bf16 (triton 3.6): float16 there."""
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float16)
    pages = -(-kv // wl.page_size)
    mem = make_memory(wl.config(dtype), num_pages=bs * pages + 1, max_reqs=bs,
                      max_context_len=pages * wl.page_size, page_order="shuffled", seed=seed,
                      device=device, fill=False)              # page 0 is reserved
    gen = torch.Generator(device=device).manual_seed(seed)
    for buf in (mem.pool.kv if wl.family == "mla" else mem.pool.k + mem.pool.v):
        buf.normal_(generator=gen)
    m = materialize(Scenario(ForwardMode.DECODE, bs, [kv - 1] * bs), mem, 1)
    return Group(wl.family, bs, kv, mem, m.batch, dtype)


def _spec(wl: Workload, bs: int, rng: random.Random, device) -> Optional[SpecInfo]:
    if wl.mode == "decode":
        return None
    if wl.mode == "verify":
        return verify_spec(wl.width, bs, rng, device=device)
    return verify_spec(wl.width, bs, rng, topk=wl.topk, steps=TREE_STEPS, device=device)


def build_row(group: Group, wl: Workload, seed: int = 0) -> Row:
    """``wl``'s batch over the group's requests: the last ``W`` of each request's ``kv``
    tokens are this forward's (``out_cache_loc`` and ``positions`` name them, as
    ``materialize`` would), and q is drawn for ``wl``'s heads."""
    base, mem, w, kv = group.base, group.mem, wl.width, group.kv
    device = base.seq_lens.device
    mode = ForwardMode.DECODE if wl.mode == "decode" else ForwardMode.TARGET_VERIFY
    req = base.req_pool_indices
    loc = mem.req_to_token[req.long(), kv - w:kv].reshape(-1).to(torch.int64)   # [bs*W]
    pos = torch.arange(kv - w, kv, device=device).repeat(group.bs)
    batch = ForwardBatch(forward_mode=mode, batch_size=group.bs, req_pool_indices=req,
                         seq_lens=base.seq_lens, seq_lens_cpu=base.seq_lens_cpu, out_cache_loc=loc,
                         positions=pos, spec_info=_spec(wl, group.bs, random.Random(seed), device),
                         raw_bs=group.bs)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    dtype = group.dtype
    q = torch.randn(group.bs * w, wl.heads, wl.qk_dim, generator=gen, device=device, dtype=dtype)
    return Row(wl, group.bs, kv, wl.config(dtype), mem, batch, q)


def roofline(wl: Workload, bs: int, kv: int, us: Optional[float], env: dict) -> dict:
    """bytes, flops, intensity and bound of a row; GB/s, % copy and TFLOPs of a time."""
    nbytes, flops = wl.nbytes(bs, kv), wl.flops(bs, kv)
    out = dict(bytes=nbytes, flops=flops, intensity=round(flops / nbytes, 2))
    ridge = env.get("ridge_flop_per_byte")
    out["bound"] = None if ridge is None else ("compute" if flops / nbytes > ridge else "memory")
    if us:
        out["gbs"] = nbytes / us / 1e3
        out["tflops"] = flops / us / 1e6
        if env.get("copy_gbs"):
            out["frac_copy"] = out["gbs"] / env["copy_gbs"]
        if env.get("matmul_tflops"):
            out["frac_matmul"] = out["tflops"] / env["matmul_tflops"]
    return out
