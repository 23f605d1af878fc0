"""The sweep's workload matrix (issues #10, #40), one row's KV lengths and data, and its byte and flop counts.

A row is (workload, bs, distribution): ``bs`` requests whose KV lengths (prefix plus this forward's
``W`` tokens) are drawn by ``lengths`` from a named distribution, bf16, pages shuffled (``make_memory``
with ``page_order="shuffled"``), the pool holding exactly the pages the lengths need. Ours and every
FlashInfer configuration read the same KV pool, the same q and the same page tables.

Distributions (``lengths(name, bs, seed)``, a pure function of its arguments; serving batches are
ragged, and a long request among short ones is the everyday case of a server, issue #40):

* ``uniform``: every request ``kv`` tokens (the row's ``kv``; issue #10's rows);
* ``ragged``: each uniform in [256, 16384];
* ``longtail``: one request of 32768 (two from bs 32), at random positions, the rest in [256, 2048];
* ``bimodal``: half (rounded) in [256, 1024], the rest in [8192, 16384], shuffled.

A non-uniform row's ``kv`` is the lengths' mean (rounded); its records carry the lengths and their
min, max and sum. Counts (``Workload.nbytes`` / ``Workload.flops``), per row, over the sum of the
lengths ``S`` (``bs*kv`` for a uniform row):

* bytes = the KV of every request read once + q + out
  (GQA ``S*Hkv*(D+Dv)*2``; MLA ``S*576*2``; q ``bs*W*H*Dqk*2``; out ``bs*W*H*Dv*2``);
* flops = ``2*W*H*S*(Dqk+Dv)`` (QK^T and PV over every request's keys for every query row;
  causal verify skips at most W-1 keys per request, below 0.4% here).

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
from attn_backends.backends.triton_common import DEEP_MAX_KV_SPLITS, WIDE_MAX_KV_SPLITS
from attn_backends.check.scenarios import Scenario, make_memory, materialize, verify_spec
from attn_backends.check.suite import fp8_scales
from attn_backends.config import FP8_KV
from attn_backends.kv_cache import to_cache

BATCHES = (1, 4, 16, 64, 128)
KVS = (2048, 8192, 32768)
QUICK_BATCHES = (1, 16, 128)
QUICK_KVS = (8192,)
SMOKE_BS, SMOKE_KV = 2, {"gqa": 40, "mla": 100}   # CPU interpreter; last pages partly full
TREE_N, TREE_TOPK, TREE_STEPS = 8, 4, 3
BF16 = 2                             # bytes per element
FP8_SCALES = fp8_scales(mla=False)   # an FP8 workload's (k, v) scales (check's): the cache holds N(0, 1) / scale

DISTS = ("uniform", "ragged", "longtail", "bimodal")
LONG = 32768                         # longtail: the long requests' length
LONGTAIL_TWO_FROM = 32               # longtail: two long requests from this batch size
SMOKE_DIV = 128                      # --smoke: lengths / 128, at least the widest W (TREE_N)


def lengths(dist: str, bs: int, seed: int = 0, kv: Optional[int] = None) -> list:
    """The KV lengths of ``bs`` requests drawn from ``dist`` (module docstring), a pure function of
    ``(dist, bs, seed)`` (``kv`` too for ``uniform``): a string seed hashes the same in every process."""
    if dist not in DISTS:
        raise ValueError(f"dist={dist!r} is not one of {', '.join(DISTS)}")
    if bs < 1:
        raise ValueError(f"bs={bs} is below 1")
    if dist == "uniform":
        if kv is None or kv < 1:
            raise ValueError(f"uniform lengths need kv >= 1, got kv={kv}")
        return [kv] * bs
    rng = random.Random(f"{dist}:{bs}:{seed}")
    if dist == "ragged":
        return [rng.randint(256, 16384) for _ in range(bs)]
    if dist == "longtail":
        out = [rng.randint(256, 2048) for _ in range(bs)]
        for i in rng.sample(range(bs), min(bs, 2 if bs >= LONGTAIL_TWO_FROM else 1)):
            out[i] = LONG                  # at random positions: a kernel must not count on the first
        return out
    short = (bs + 1) // 2                  # bimodal: half, rounded up, short
    out = [rng.randint(256, 1024) for _ in range(short)] + [rng.randint(8192, 16384) for _ in range(bs - short)]
    rng.shuffle(out)
    return out


def smoke_lengths(lens: list) -> list:
    """The interpreter's lengths: ``lens / SMOKE_DIV``, at least ``TREE_N`` (every W fits)."""
    return [max(TREE_N, n // SMOKE_DIV) for n in lens]


@dataclass(frozen=True)
class Workload:
    name: str
    family: str          # "gqa" | "mla"
    mode: str            # "decode" | "verify" (chain, causal) | "tree"
    heads: int
    kv_heads: int        # 1 for MLA (one latent head)
    qk_dim: int          # 64 | 128 | 576 (latent 512 + rope 64)
    v_dim: int           # 64 | 128 | 512
    page_size: int
    width: int           # W: query rows per request
    topk: int = 1
    balanced: bool = False   # MLA: ours with the chunk schedule (BalancedTritonMLABackend)
    split: bool = False      # MLA: ours with equal splits (SplitTritonMLABackend; the default is "auto")
    pow2: bool = False       # ours with chunked launches at power-of-two split counts (EXACT_CHUNK_SPLITS off)
    kv_dtype: Optional[torch.dtype] = None   # the KV cache's dtype (None: the model's); FP8 stored with FP8_SCALES
    window: Optional[int] = None    # issue #42: a sliding window (HF's sliding_window), a softcap, sinks (SINKS)
    softcap: Optional[float] = None
    sinks: bool = False

    @property
    def variant(self) -> str:
        """The FlashInfer JIT module's tags beyond the head dim (``sweep_prewarm``): ``:fp8``, ``:w``, ``:cap``."""
        return ((":fp8" if self.kv_dtype is not None else "") + (":w" if self.window else "")
                + (":cap" if self.softcap else ""))

    @property
    def backend(self) -> str:
        if self.balanced:
            return "attn_backends.backends.triton_mla:BalancedTritonMLABackend"
        if self.split:
            return "attn_backends.backends.triton_mla:SplitTritonMLABackend"
        if self.pow2:
            return ("attn_backends.backends.triton_mla:Pow2SplitsTritonMLABackend" if self.family == "mla"
                    else "attn_backends.backends.triton_backend:Pow2SplitsTritonBackend")
        return "triton_mla" if self.family == "mla" else "triton"

    @property
    def geometry(self) -> tuple:
        """What the KV pool depends on: workloads of one geometry share a group's memory."""
        return (self.family, self.kv_heads, self.qk_dim, self.v_dim, self.page_size, self.kv_dtype)

    def config(self, dtype=torch.bfloat16) -> ModelConfig:
        fp8 = dict(kv_dtype=self.kv_dtype, kv_scales=(FP8_SCALES,)) if self.kv_dtype is not None else {}
        if self.window or self.softcap or self.sinks:
            fp8.update(sliding_window=self.window, layer_types=("sliding_attention",) if self.window else None,
                       logit_softcap=self.softcap, sinks=self.sinks)
        if self.family == "mla":
            return ModelConfig(num_layers=1, num_q_heads=self.heads, is_mla=True,
                               page_size=self.page_size, dtype=dtype, **fp8)
        return ModelConfig(num_layers=1, num_q_heads=self.heads, num_kv_heads=self.kv_heads,
                           head_dim=self.qk_dim, page_size=self.page_size, dtype=dtype, **fp8)

    def kv_bytes_per_token(self) -> int:
        size = BF16 if self.kv_dtype is None else self.kv_dtype.itemsize
        if self.family == "mla":
            return self.qk_dim * size
        return self.kv_heads * (self.qk_dim + self.v_dim) * size

    def nbytes(self, bs: int, kv: int, lens: Optional[list] = None) -> int:
        """Bytes of a row: ``lens`` (the requests' lengths) where given, else ``bs`` requests of ``kv``."""
        rows = bs * self.width * self.heads
        tokens = sum(lens) if lens is not None else bs * kv
        return tokens * self.kv_bytes_per_token() + rows * (self.qk_dim + self.v_dim) * BF16

    def flops(self, bs: int, kv: int, lens: Optional[list] = None) -> int:
        tokens = sum(lens) if lens is not None else bs * kv
        return 2 * self.width * self.heads * tokens * (self.qk_dim + self.v_dim)

    def describe(self) -> dict:
        return dict(workload=self.name, family=self.family, mode=self.mode, heads=self.heads,
                    kv_heads=self.kv_heads, qk_dim=self.qk_dim, v_dim=self.v_dim,
                    page_size=self.page_size, width=self.width, topk=self.topk,
                    kv_dtype=str(self.kv_dtype or "model").replace("torch.", ""), window=self.window,
                    softcap=self.softcap, sinks=self.sinks)


ISSUE10_GQA = ((32, 8, 128), (64, 8, 128))        # issue #10's shapes keep their names (gqa32_decode)
GQA_SHAPES = ((8, 1), (28, 4), (32, 8), (64, 8))  # (heads, KV heads); 28/4 is a group of 7
GQA_DIMS = (64, 128)
MODES = (("decode", 1, 1), ("verify", 4, 1), ("tree", TREE_N, TREE_TOPK))


def _gqa(heads: int, kv_heads: int, dim: int, mode: str, width: int, topk: int = 1) -> Workload:
    tail = mode + (str(width) if mode != "decode" else "")
    short = (heads, kv_heads, dim) in ISSUE10_GQA
    name = f"gqa{heads}_{tail}" if short else f"gqa{heads}_{kv_heads}_d{dim}_{tail}"
    return Workload(name, "gqa", mode, heads, kv_heads, dim, dim, 16, width, topk)


def _mla(heads: int, mode: str, width: int) -> Workload:
    name = f"mla{heads}_{mode}" + (str(width) if mode != "decode" else "")
    return Workload(name, "mla", mode, heads, 1, 576, 512, 64, width)


ISSUE10_WORKLOADS = tuple(
    [_gqa(h, hkv, d, *m) for h, hkv, d in ISSUE10_GQA for m in MODES]
    + [w for h in (16, 128) for w in (_mla(h, "decode", 1), _mla(h, "verify", 4))])
WORKLOADS = tuple(
    [_gqa(h, hkv, d, *m) for h, hkv in GQA_SHAPES for d in GQA_DIMS for m in MODES]
    + [w for h in (16, 128) for w in (_mla(h, "decode", 1), _mla(h, "verify", 4))])
BY_NAME = {w.name: w for w in WORKLOADS}
# by name only (not in a grid): the MLA rows with ours on the chunk schedule, e.g. mla16_decode_balanced
BY_NAME.update({f"{w.name}_balanced": replace(w, name=f"{w.name}_balanced", balanced=True)
                for w in WORKLOADS if w.family == "mla"})
# by name only: the MLA rows with ours on equal splits, e.g. mla16_decode_split (the default is "auto")
BY_NAME.update({f"{w.name}_split": replace(w, name=f"{w.name}_split", split=True)
                for w in WORKLOADS if w.family == "mla"})
# by name only: ours at power-of-two counts where chunked (the rule before EXACT_CHUNK_SPLITS), e.g. mla128_decode_pow2
BY_NAME.update({f"{w.name}_pow2": replace(w, name=f"{w.name}_pow2", pow2=True) for w in WORKLOADS})
# by name only: the GQA rows on an FP8 (e4m3) cache, e.g. gqa28_4_d128_decode_fp8
BY_NAME.update({f"{w.name}_fp8": replace(w, name=f"{w.name}_fp8", kv_dtype=torch.float8_e4m3fn)
                for w in WORKLOADS if w.family == "gqa"})
# by name only: issue #42's GQA rows, a 4096-token window (_w4096), a softcap of 30 (_cap), sinks (_sinks)
VARIANTS = {"w4096": dict(window=4096), "cap": dict(softcap=30.0), "sinks": dict(sinks=True),
            "capsinks": dict(softcap=30.0, sinks=True)}
BY_NAME.update({f"{w.name}_{tag}": replace(w, name=f"{w.name}_{tag}", **kw)
                for w in WORKLOADS if w.family == "gqa" for tag, kw in VARIANTS.items()})
# the long form of issue #10's GQA names: gqa32_8_d128_decode is gqa32_decode
ALIASES = {f"gqa{w.heads}_{w.kv_heads}_d{w.qk_dim}_{w.name.split('_', 1)[1]}": w.name
           for w in ISSUE10_WORKLOADS if w.family == "gqa"}
BY_NAME.update({long: BY_NAME[short] for long, short in ALIASES.items()})


def smoke_workload(wl: Workload) -> Workload:
    """The interpreter's version of ``wl``: the same mode, W, page size, head dims and GQA
    group, fewer heads (GQA one KV head; MLA-128 32 heads, still two head blocks)."""
    if wl.family == "mla":
        return replace(wl, heads=min(wl.heads, 32))
    return replace(wl, heads=wl.heads // wl.kv_heads, kv_heads=1)


def estimate_bytes(wls, lens: list) -> int:
    """Device memory a group needs at most: the KV pool, FlashInfer's flattened tree mask,
    our split-KV workspace (WIDE_MAX_KV_SPLITS at most; DEEP_MAX_KV_SPLITS for a GQA decode of at most 8
    programs) and 1 GiB for workspaces and graph pools."""
    wl, bs = wls[0], len(lens)
    pool = (sum(-(-n // wl.page_size) for n in lens) + 1) * wl.page_size * wl.kv_bytes_per_token()
    mask = max(w.width * sum(lens) if w.mode == "tree" else 0 for w in wls)
    deep = lambda w: w.family == "gqa" and w.width == 1 and bs * w.kv_heads <= 8      # noqa: E731
    split_ws = max(bs * w.width * w.heads * (DEEP_MAX_KV_SPLITS if deep(w) else WIDE_MAX_KV_SPLITS)
                   * (w.v_dim + 1) * 4 for w in wls)
    return pool + mask + split_ws + (1 << 30)


@dataclass
class Group:
    """The KV memory and the requests of one point: request ``i`` holds ``lens[i]`` tokens on
    shuffled pages (``materialize`` of a DECODE scenario)."""

    family: str
    bs: int
    kv: int              # uniform: every request's length; else the lengths' mean, rounded
    mem: object          # KVMemory
    base: object         # ForwardBatch of the DECODE scenario (raw_bs == bs: no padding)
    dtype: torch.dtype
    lens: tuple = ()
    dist: str = "uniform"


@dataclass
class Row:
    wl: Workload
    bs: int
    kv: int
    cfg: ModelConfig
    mem: object          # KVMemory (the group's)
    batch: object        # ForwardBatch of this workload's mode over the group's requests
    q: torch.Tensor      # [bs*W, H, qk_dim], the group's dtype
    lens: tuple = ()     # each request's KV length
    dist: str = "uniform"

    @property
    def layer(self):
        """Layer 0's record; a sinks model's logits spread over [-2, 2] a head (fixed: the same every call)."""
        sinks = torch.linspace(-2.0, 2.0, self.wl.heads, device=self.q.device) if self.cfg.sinks else None
        return self.cfg.layer(0, sinks=sinks)


def build_group(wl: Workload, bs: int, kv: int, device, seed: int = 0, dtype=None,
                lens: Optional[list] = None, dist: str = "uniform") -> Group:
    """The KV memory of ``wl``'s geometry (every workload of a group has the same KV heads,
    head dims and page size) holding exactly the pages of ``bs`` requests of ``lens`` tokens
    (``kv`` each where ``lens`` is None), pages shuffled, filled on the device (no host copy).
    bf16, except in the Triton interpreter (CPU), which misreads bf16 (triton 3.6): float16 there."""
    lens = [kv] * bs if lens is None else [int(n) for n in lens]
    if len(lens) != bs or min(lens) < 1:
        raise ValueError(f"lens: {len(lens)} lengths, min {min(lens, default=0)}; need bs={bs} lengths >= 1")
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float16)
    pages = [-(-n // wl.page_size) for n in lens]
    mem = make_memory(wl.config(dtype), num_pages=sum(pages) + 1, max_reqs=bs,
                      max_context_len=max(pages) * wl.page_size, page_order="shuffled", seed=seed,
                      device=device, fill=False)              # page 0 is reserved
    gen = torch.Generator(device=device).manual_seed(seed)
    pools = ([(b, FP8_SCALES[0]) for b in mem.pool.kv] if wl.family == "mla" else
             [(b, FP8_SCALES[0]) for b in mem.pool.k] + [(b, FP8_SCALES[1]) for b in mem.pool.v])
    for buf, scale in pools:
        if buf.dtype not in FP8_KV:
            buf.normal_(generator=gen)
            continue
        for part in buf.view(-1).split(1 << 26):          # quantized a slice at a time (float64 inside)
            part.copy_(to_cache(torch.randn(part.shape, generator=gen, device=device), buf.dtype, scale))
    m = materialize(Scenario(ForwardMode.DECODE, bs, [n - 1 for n in lens]), mem, 1)
    return Group(wl.family, bs, kv, mem, m.batch, dtype, tuple(lens), dist)


def _spec(wl: Workload, bs: int, rng: random.Random, device) -> Optional[SpecInfo]:
    if wl.mode == "decode":
        return None
    if wl.mode == "verify":
        return verify_spec(wl.width, bs, rng, device=device)
    return verify_spec(wl.width, bs, rng, topk=wl.topk, steps=TREE_STEPS, device=device)


def build_row(group: Group, wl: Workload, seed: int = 0) -> Row:
    """``wl``'s batch over the group's requests: the last ``W`` of each request's tokens are
    this forward's (``out_cache_loc`` and ``positions`` name them, as ``materialize`` would),
    and q is drawn for ``wl``'s heads."""
    base, mem, w = group.base, group.mem, wl.width
    if min(group.lens) < w:
        raise ValueError(f"{wl.name}: a request of {min(group.lens)} tokens is shorter than W={w}")
    device = base.seq_lens.device
    mode = ForwardMode.DECODE if wl.mode == "decode" else ForwardMode.TARGET_VERIFY
    req = base.req_pool_indices
    idx = base.seq_lens.long()[:, None] - w + torch.arange(w, device=device)            # [bs, W]
    loc = mem.req_to_token[req.long()[:, None], idx].reshape(-1).to(torch.int64)       # [bs*W]
    batch = ForwardBatch(forward_mode=mode, batch_size=group.bs, req_pool_indices=req,
                         seq_lens=base.seq_lens, seq_lens_cpu=base.seq_lens_cpu, out_cache_loc=loc,
                         positions=idx.reshape(-1), spec_info=_spec(wl, group.bs, random.Random(seed), device),
                         raw_bs=group.bs)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    dtype = group.dtype
    q = torch.randn(group.bs * w, wl.heads, wl.qk_dim, generator=gen, device=device, dtype=dtype)
    return Row(wl, group.bs, group.kv, wl.config(dtype), mem, batch, q, group.lens, group.dist)


def roofline(wl: Workload, bs: int, kv: int, us: Optional[float], env: dict, lens: Optional[list] = None) -> dict:
    """bytes, flops, intensity and bound of a row (over ``lens`` where given); GB/s, % copy and TFLOPs of a time."""
    nbytes, flops = wl.nbytes(bs, kv, lens), wl.flops(bs, kv, lens)
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


def matrix(quick: bool = False, only: Optional[str] = None, smoke: bool = False) -> list:
    """Issue #10's uniform grid as ``[(family, bs, kv, [workloads])]``, quick points first
    (``sweep_matrix.points(grid="issue10")``; bench_sweep.py and the probes' callers read it)."""
    from sweep_matrix import points  # sweep_matrix builds on this module
    return [(p.family, p.bs, p.kv, list(p.wls)) for p in points("issue10", quick=quick, only=only, smoke=smoke)]
