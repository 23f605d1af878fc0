"""A prototype GQA decode chunk pass whose warps each walk their own keys, against ours (issue #40's uniform rows).

Our chunk pass (``decode_attention._decode_chunk_kernel``) gives a tile of 32 keys to 4 warps that split the keys
between them, so every tile's row maxima, sums and probabilities cross warps through shared memory (9 barriers,
18 shared loads and stores, 12 shuffles in a 287-instruction loop on sm_90; bench/RESULTS.md, 'Ragged batches',
session 61): it issues about 1.76x FlashInfer's instructions for the same bytes. FlashInfer's decode gives each warp
its own keys and merges the warps once. Here: the same chunk schedule (``chunk_kernels.chunk_of``, the merge pass),
each step ``WARPS`` sub-tiles of ``KEYS`` keys, one a warp (a batched ``tl.dot`` whose batch dimension the warps
split), each warp its own running maximum, sum and output, merged after the walk.

    TRITON_INTERPRET=1 python bench/probes/warp_split_decode.py --check     # CPU (interpreter); without it on a GPU
    python bench/probes/warp_split_decode.py --offline   # sm_90 compile, any machine: registers, loop instructions
    python bench/probes/warp_split_decode.py --rows 28/4x128:32,32/8x64:32 --dists uniform,ragged,longtail  # GPU

The GPU mode times graph replays (``triton.testing.do_bench``, L2 flushed) of the prototype at chunk budgets of
``--programs`` programs an SM against ``decode_attention_fwd``'s chunk pass at the backend's split count (its rules)
and FlashInfer's decode, on ``ragged_decode.py``'s rows, bf16 or e4m3 caches (``--kv-dtypes``; an FP8 cache read as
ours reads it). A probe: nothing here is wired into a backend.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl

import attn_backends_kernels  # noqa: F401 - the interpreter's patches
from attn_backends.kv_cache import to_cache
from attn_backends_kernels.chunk_kernels import chunk_of
from attn_backends_kernels.decode_attention import decode_attention_fwd, decode_block_n
from attn_backends_kernels.kv_walk import NO_MASK, fp8_query, head_and_item, slot64, widen_fp8
from attn_backends_kernels.schedule import chunk_launch, chunk_workspace, slots_per_request

PAGE = 16


@triton.jit
def _warp_tile(q, k_ptr, v_ptr, pt_row, tok, end, kvh, stride_ks, stride_kh, stride_vs, stride_vh, offs_d, row_scale,
               v_scale, m_i, l_i, acc, PAGE_SIZE: tl.constexpr):
    """One step of the walk: tokens ``tok [WARPS, KEYS]`` (a warp's a row) into each warp's running state."""
    ok = tok < end
    slot = tl.load(pt_row + tok // PAGE_SIZE, mask=ok, other=0) * PAGE_SIZE + tok % PAGE_SIZE
    k = tl.load(k_ptr + slot[:, None, :] * stride_ks + kvh * stride_kh + offs_d[None, :, None],
                mask=ok[:, None, :], other=0.0)                                  # [WARPS, D, KEYS]
    if k.dtype.is_fp8():
        k = k.to(q.dtype)
    s = tl.where(ok[:, None, :], tl.dot(q, k) * row_scale, float("-inf"))      # [WARPS, BLOCK_H, KEYS]
    m_new = tl.maximum(m_i, tl.max(s, 2))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)      # a warp that saw nothing yet: finite
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, :, None])
    l_i = l_i * alpha + tl.sum(p, 2)
    v = tl.load(v_ptr + slot[:, :, None] * stride_vs + kvh * stride_vh + offs_d[None, None, :],
                mask=ok[:, :, None], other=0.0)                                  # [WARPS, KEYS, D]
    if v.dtype.is_fp8():
        if q.dtype == tl.float16:
            v = widen_fp8(v)
        acc = acc * alpha[:, :, None] + tl.dot(p.to(q.dtype), v.to(q.dtype)) * v_scale
    else:
        acc = acc * alpha[:, :, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _warp_split_kernel(q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, o_ptr, lse_ptr, out_ptr, scale_log2, v_scale,
                       bs, num_chunks, stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_pb,
                       stride_oc, stride_oh, stride_lc, stride_lh, stride_xb, stride_xh,
                       GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                       WARPS: tl.constexpr, KEYS: tl.constexpr, MIN_TILES: tl.constexpr, FIXED_TILES: tl.constexpr,
                       BLOCK_BS: tl.constexpr, HEADS_FIRST: tl.constexpr):
    """Program (KV head, chunk c) of the chunk schedule at ``WARPS * KEYS``-token tiles; int32 slots (the host
    checks ``slot64``). An FP8 cache as the chunk pass reads it: q made float16 per row (``fp8_query``), K widened
    to it, V by ``widen_fp8``, K's scale in ``scale_log2`` and V's on the product."""
    TILE: tl.constexpr = WARPS * KEYS
    kvh, c, num_kvh = head_and_item(HEADS_FIRST)
    b, first, count, start, end, total = chunk_of(seq_lens_ptr, c, bs, num_chunks, 0, 1, seq_lens_ptr, TILE,
                                                  MIN_TILES, FIXED_TILES, BLOCK_BS, NO_MASK, False)
    if c < total:
        offs_h = tl.arange(0, BLOCK_H)
        ok_h = offs_h < GROUP
        heads = kvh * GROUP + offs_h
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=ok_h[:, None], other=0.0)
        row_scale = scale_log2
        if k_ptr.dtype.element_ty.is_fp8() and q.dtype == tl.bfloat16:
            q, row_scale = fp8_query(q, k_ptr, scale_log2)
            row_scale = row_scale[None, :, :]              # [1, BLOCK_H, 1]: a scale a row
        q = tl.broadcast_to(q[None, :, :], (WARPS, BLOCK_H, D))
        sub = tl.arange(0, WARPS)[:, None] * KEYS + tl.arange(0, KEYS)[None, :]      # [WARPS, KEYS]: a warp's keys
        m_i = tl.full([WARPS, BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([WARPS, BLOCK_H], tl.float32)
        acc = tl.zeros([WARPS, BLOCK_H, D], tl.float32)
        pt_row = page_table_ptr + b.to(tl.int64) * stride_pb
        for n0 in range(start, end, TILE):
            m_i, l_i, acc = _warp_tile(q, k_ptr, v_ptr, pt_row, n0 + sub, end, kvh, stride_ks, stride_kh, stride_vs,
                                       stride_vh, offs_d, row_scale, v_scale, m_i, l_i, acc, PAGE_SIZE)
        m = tl.max(m_i, 0)                    # the warps merged once
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(m_i - m[None, :])
        l_sum = tl.sum(l_i * w, 0)
        seen = l_sum > 0
        o = tl.where(seen[:, None], tl.sum(acc * w[:, :, None], 0) / tl.where(seen, l_sum, 1.0)[:, None], 0.0)
        tile = ok_h[:, None]
        if count == 1:                        # a whole request: its output, no partial
            tl.store(out_ptr + b * stride_xb + heads[:, None] * stride_xh + offs_d[None, :], o, mask=tile)
        else:
            jj = c.to(tl.int64)
            tl.store(o_ptr + jj * stride_oc + heads[:, None] * stride_oh + offs_d[None, :], o, mask=tile)
            lse = tl.where(seen, m + tl.log2(tl.where(seen, l_sum, 1.0)), float("-inf"))
            tl.store(lse_ptr + jj * stride_lc + heads * stride_lh, lse, mask=ok_h)


def warp_split_decode(q, k, v, page_table, seq_lens, scale, splits, out, workspace, warps=4, keys=16, stages=2,
                      launch=None, k_scale=1.0, v_scale=1.0):
    """GQA decode of ``q [bs, H, D]`` over 16-token pages into ``out``, the batch's KV in about ``bs * splits``
    chunks (the chunk schedule), merged by the merge pass; an FP8 cache's per-tensor ``k_scale`` / ``v_scale``.
    ``launch(kernel, grid, args, kwargs)``: instead of launching (the offline compile)."""
    bs, H, D = q.shape
    Hkv = k.shape[1]
    if slot64(k, v):
        raise ValueError(f"warp_split_decode: a cache past 2^31 elements ({tuple(k.shape)}); the prototype has int32 "
                         f"slots only")
    cl = chunk_launch("warp_split_decode", out, workspace, bs, splits, 1, Hkv, page_table, PAGE, "chunks",
                      warps * keys, None, min_tokens=64)
    args = (q, k, v, page_table, seq_lens, cl.part, cl.lse, out, scale * k_scale * 1.4426950408889634, v_scale, bs,
            cl.budget,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), page_table.stride(0),
            cl.part.stride(0), cl.part.stride(1), cl.lse.stride(0), cl.lse.stride(1), out.stride(0), out.stride(1))
    kw = dict(GROUP=H // Hkv, BLOCK_H=max(16, triton.next_power_of_2(H // Hkv)), D=D, PAGE_SIZE=PAGE, WARPS=warps,
              KEYS=keys, num_warps=warps, num_stages=stages, **cl.consts)
    if launch is not None:
        return launch(_warp_split_kernel, cl.grid, args, kw)
    _warp_split_kernel[cl.grid](*args, **kw)
    cl.merge_pass(seq_lens, None, out)
    return out


def batch(lens: list, H: int, Hkv: int, D: int, dtype, device, seed: int = 0, kv_dtype=None, scales=(1.0, 1.0)) -> dict:
    """Random q, K and V over shuffled pages (page 0 NaN, unused), the page table and lengths; K and V as a cache of
    ``kv_dtype`` (None: ``dtype``) holds them at ``scales``."""
    g = torch.Generator().manual_seed(seed)
    counts = [-(-n // PAGE) for n in lens]
    perm = (torch.randperm(sum(counts), generator=g) + 1).int()
    table = torch.zeros(len(lens), max(counts) + 1, dtype=torch.int32)
    at = 0
    for i, c in enumerate(counts):
        table[i, :c], at = perm[at:at + c], at + c
    slots = (sum(counts) + 1) * PAGE
    k, v = (torch.randn(slots, Hkv, D, generator=g).to(dtype) for _ in range(2))
    k[:PAGE] = v[:PAGE] = float("nan")
    k, v = (to_cache(x, kv_dtype or dtype, s) for x, s in zip((k, v), scales))
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    return dict(q=q.to(device), k=k.to(device), v=v.to(device), table=table.to(device),
                lens=torch.tensor(lens, dtype=torch.int32, device=device), scales=scales)


def reference(b: dict) -> torch.Tensor:
    """Float64 attention of each request's heads over its tokens (the cache dequantized)."""
    q, k, v = b["q"].double(), b["k"].double() * b["scales"][0], b["v"].double() * b["scales"][1]
    group, out = q.shape[1] // k.shape[1], torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for i, n in enumerate(b["lens"].tolist()):
        pages = b["table"][i, :-(-n // PAGE)].long()
        slots = (pages[:, None] * PAGE + torch.arange(PAGE, device=q.device)).flatten()[:n]
        kk, vv = k[slots].repeat_interleave(group, 1), v[slots].repeat_interleave(group, 1)     # [n, H, D]
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i], kk) * q.shape[2] ** -0.5, -1)
        out[i] = torch.einsum("hn,nhd->hd", p, vv)
    return out


def check(device: str) -> float:
    """The prototype against float64 on ragged batches (CPU: float32 q, the interpreter's ``tl.dot``, and one bf16 q
    on an e4m3 cache, the FP8 path a bf16 model takes: q made float16 per row; GPU: bf16 q); the outputs float32;
    returns the largest relative error seen."""
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    cases = [([100, 37, 260], 8, 2, 16, 2, 4, 16, None, None), ([300, 5, 70, 129], 4, 1, 32, 3, 2, 16, None, None),
             ([300, 5, 70, 129], 8, 2, 32, 3, 4, 16, fp8, None), ([300, 5, 70, 129], 8, 2, 32, 3, 4, 16, fp8, bf16)]
    if device != "cpu":
        cases += [([16384, 700, 33, 2048] * 6, 28, 4, 128, 2, 4, 16, None, None),
                  ([32768] + [300] * 23, 32, 8, 64, 3, 4, 32, None, None),
                  ([16384, 700, 33, 2048] * 6, 28, 4, 128, 2, 4, 32, fp8, None)]
    worst = 0.0
    for lens, H, Hkv, D, splits, warps, keys, kv, q_dtype in cases:
        dtype = q_dtype or (torch.float32 if device == "cpu" else bf16)
        b = batch(lens, H, Hkv, D, dtype, device, kv_dtype=kv, scales=(0.5, 2.0) if kv else (1.0, 1.0))
        out = torch.full(b["q"].shape, float("nan"), device=device)
        ws = chunk_workspace(len(lens), slots_per_request("chunks", splits, b["table"].shape[1] * PAGE), 1, H, Hkv, D,
                             device)
        warp_split_decode(b["q"], b["k"], b["v"], b["table"], b["lens"], D ** -0.5, splits, out, ws, warps, keys,
                          k_scale=b["scales"][0], v_scale=b["scales"][1])
        ref = reference(b)
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        print(f"check {len(lens)} requests {H}/{Hkv} d{D} q {str(dtype)[6:]} cache {str(b['k'].dtype)[6:]} splits "
              f"{splits} warps {warps} keys {keys}: rel err {err:.2e}")
        worst = max(worst, err if err == err else float("inf"))
    return worst


def loop_instructions(cubin: bytes) -> int:
    """Instructions of the longest loop that holds an MMA (the KV walk) in ``cubin``'s SASS (cuobjdump)."""
    import offline_sm90
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([os.path.join(offline_sm90._BIN, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True, check=True).stdout
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(to, 16), at) for at, t in ins for to in re.findall(r"\bBRA\b.*?(0x[0-9a-f]+)", t) if int(to, 16) < at]
    bodies = [[t for a, t in ins if lo <= a <= hi] for lo, hi in loops]
    return max((len(b) for b in bodies if any("HMMA" in t for t in b)), default=0)


def offline(shapes: list, kv_dtypes: list) -> list:
    """sm_90 compiles of the prototype and of our chunk pass at GQA ``(H, Hkv, D)`` shapes, bf16 q, caches of
    ``kv_dtypes``, 32 requests of 16384 tokens: ``[(label, registers, spill bytes, shared bytes, loop instructions,
    warp-instructions a key)]``."""
    import offline_sm90
    rows = []
    for (H, Hkv, D), kv in ((s, kv) for s in shapes for kv in kv_dtypes):
        bs, n, dt, name = 32, 16384, torch.bfloat16, f"{H}/{Hkv} d{D} {str(kv)[6:]}"
        q, out = torch.zeros(bs, H, D, dtype=dt), torch.zeros(bs, H, D, dtype=dt)
        k = torch.zeros(bs * n + PAGE, Hkv, D, dtype=kv)
        table = torch.arange(bs * n // PAGE, dtype=torch.int32).view(bs, -1)
        lens = torch.full((bs,), n, dtype=torch.int32)
        for warps, keys, stages in ((4, 16, 2), (4, 32, 2), (8, 16, 2)):
            def compile_only(kernel, grid, args, kw, label=f"{name} warps {warps} keys {keys}"):
                c = offline_sm90.compile_sm90(kernel, args, kw)
                r, loop = offline_sm90.resources(c), loop_instructions(c.asm["cubin"])
                rows.append((label, r["regs"], r["stack"], r["smem"], loop, loop * warps / (warps * keys)))
            warp_split_decode(q, k, k, table, lens, 0.1, 2, out, None, warps, keys, stages, launch=compile_only)
        kept = []
        real = offline_sm90.compile_sm90
        offline_sm90.compile_sm90 = lambda kernel, a, kw: kept.append(real(kernel, a, kw)) or kept[-1]
        try:
            with offline_sm90.offline() as launches:
                offline_sm90.gqa_decode_call(H, Hkv, D, 6, bs=bs, n=n, kv=kv)()
        finally:
            offline_sm90.compile_sm90 = real
        r, c = next((launch[2], c) for launch, c in zip(launches, kept) if launch[0] == "_decode_chunk_kernel")
        loop, tile = loop_instructions(c.asm["cubin"]), decode_block_n(kv, D, "chunks")
        rows.append((f"{name} ours (4 warps, {tile} keys)", r["regs"], r["stack"], r["smem"], loop, loop * 4 / tile))
    return rows


def backend_splits(bs: int, Hkv: int, max_len: int, kv_dtype) -> int:
    """The ``triton`` backend's split count for a plain decode chunk launch (``TritonBackend._split_rule``,
    ``_split_plan`` with ``EXACT_CHUNK_SPLITS``, ``_splits``' doubling below ``DOUBLE_CHUNKS_BELOW`` on 16-bit
    caches): the count its chunk budget is ``bs`` times."""
    from attn_backends.backends.triton_backend import TritonBackend
    from attn_backends.backends.triton_common import WIDE_MAX_KV_SPLITS, choose_num_kv_splits
    fp8 = kv_dtype.itemsize == 1
    S = choose_num_kv_splits(bs * Hkv, torch.device("cuda"), -(-max_len // PAGE), 12 if fp8 else 6, 1, 2, None, 1,
                             WIDE_MAX_KV_SPLITS + 1)
    return 2 * S if S < TritonBackend.DOUBLE_CHUNKS_BELOW and not fp8 else S


def time_row(spec: str, dist: str, programs: list, fi, fi_ws, kv_dtype=torch.bfloat16) -> str:
    """Graph us of the prototype at ``programs`` an SM, of our chunk pass at the backend's split count
    (``backend_splits``) and of FlashInfer's decode (where loaded) on one of ``ragged_decode.py``'s rows; the
    prototype's outputs checked against ours (a mismatch printed)."""
    import ragged_decode as rd
    heads, rest = spec.split("x")
    (H, Hkv), (D, bs) = map(int, heads.split("/")), map(int, rest.split(":"))
    lens = rd.lengths(dist, bs)
    pg = rd.paged(lens, Hkv, D, torch.Generator().manual_seed(bs))
    kb, vb, sc = rd.kv_pair(pg["num_pages"] * PAGE, Hkv, D, kv_dtype)
    q = torch.randn(bs, H, D, device="cuda", dtype=torch.bfloat16)
    S = backend_splits(bs, Hkv, max(lens), kv_dtype)
    ours_out, ours_ws = torch.empty_like(q), chunk_workspace(bs, slots_per_request("chunks", S, pg["table"].shape[1]
                                                                                  * PAGE), 1, H, Hkv, D, "cuda")
    times = {f"ours chunks S={S}": rd.graph_us(lambda: decode_attention_fwd(   # the kernel's rules: bound and fit
        q, kb, vb, pg["table"], pg["lens"], PAGE, D ** -0.5, S, ours_out, ours_ws, schedule="chunks", merge="pass",
        k_scale=sc[0], v_scale=sc[1]))}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for per_sm in programs:
        splits = max(1, round(per_sm * sms / (bs * Hkv)))
        for warps, keys in ((4, 16), (4, 32)):
            out = torch.empty_like(q)
            ws = chunk_workspace(bs, slots_per_request("chunks", splits, pg["table"].shape[1] * PAGE), 1, H, Hkv, D,
                                 "cuda")
            call = (lambda out=out, ws=ws, splits=splits, warps=warps, keys=keys: warp_split_decode(
                q, kb, vb, pg["table"], pg["lens"], D ** -0.5, splits, out, ws, warps, keys, k_scale=sc[0],
                v_scale=sc[1]))
            name = f"warps {warps}x{keys} S={splits}"
            try:                              # never run on a GPU before: a form that fails is shown, not fatal
                times[name] = rd.graph_us(call)
            except Exception as e:  # noqa: BLE001 - printed with the row (a device fault ends the run anyway)
                print(f"{spec} {dist} {kv_dtype} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            err = ((out.float() - ours_out.float()).abs().max() / ours_out.float().abs().max()).item()
            if not err < 2e-2:
                print(f"{spec} {dist} {kv_dtype} {name}: differs from ours, relative {err:.2e}", flush=True)
    if fi is not None:
        for name, (out, fn) in rd.flashinfer_calls(pg, q, kb, vb, fi, fi_ws, sc).items():
            times[name] = rd.graph_us(fn)
    return f"{spec} {dist:<8} {str(kv_dtype)[6:]} " + " ".join(f"{k} {v:.1f}" for k, v in times.items())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="against float64 (CPU under TRITON_INTERPRET=1, or GPU)")
    p.add_argument("--offline", action="store_true", help="sm_90 compiles: registers, loop instructions a key")
    p.add_argument("--shapes", default="28/4x128,32/8x64,8/1x128", help="--offline's GQA shapes")
    p.add_argument("--kv-dtypes", default="bf16", help="cache dtypes (--offline's and the rows'): bf16, fp8 (e4m3)")
    p.add_argument("--rows", default="28/4x128:32,32/8x64:32,8/1x128:48", help="GPU rows, H/Hkv x D : bs")
    p.add_argument("--dists", default="uniform,ragged,longtail")
    p.add_argument("--programs", default="2,4", help="the prototype's chunk budgets, programs an SM")
    p.add_argument("--no-flashinfer", action="store_true")
    args = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    kvs = [{"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[k] for k in args.kv_dtypes.split(",")]
    if args.check:
        interpreting = os.environ.get("TRITON_INTERPRET") == "1"
        worst = check("cuda" if torch.cuda.is_available() and not interpreting else "cpu")
        return 0 if worst < 2e-2 else 1
    if args.offline:
        shapes = [tuple(map(int, s.replace("x", "/").split("/"))) for s in args.shapes.split(",")]
        print("| config | registers | spill | shared | loop instructions | warp-instructions a key |")
        print("|---|---:|---:|---:|---:|---:|")
        for label, regs, stack, smem, loop, per_key in offline(shapes, kvs):
            print(f"| {label} | {regs} | {stack} | {smem} | {loop} | {per_key:.1f} |")
        return 0
    import ragged_decode as rd
    fi, fi_ws = rd.load_flashinfer(args.no_flashinfer)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for spec, dist, kv in ((s, d, k) for s in args.rows.split(",") for d in args.dists.split(",") for k in kvs):
        print(time_row(spec, dist, [float(x) for x in args.programs.split(",")], fi, fi_ws, kv), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
