"""Compile our kernel wrappers' launches for Hopper (sm_90) on a machine without a GPU, and read
what the compiler made of them: registers, spilled bytes, shared memory, and whether the dots
became wgmma or mma.sync and the loads cp.async copies.

Triton's compiler and the ptxas it bundles need no GPU. Inside ``with offline() as launches:``
every launch a wrapper makes through ``launch_record.launch`` is specialized exactly as
Triton's runtime would specialize it on that call (argument types, 16-byte alignment,
divisibility by 16, values of 1) and compiled for sm_90 instead of launched; the wrapper acts
as if its tensors were on an sm_90 GPU (the MLA wrapper then picks a Gluon kernel for
a 64-row tile). Nothing is computed: outputs are left as they were.

``python bench/probes/offline_sm90.py [--json]`` prints the table for the MLA launch configurations
the backend uses at the sweep's shapes and for GQA wrappers whose split merge is fused, each
also with the merge separate (a few seconds each, cached by Triton afterwards; not
under ``TRITON_INTERPRET=1``, whose kernels are the interpreter's). A
kernel that spills (``stack`` > 0) or outgrows the 227 KiB of shared memory one sm_90 program
may use is visible here before any device time is spent; tests/kernels/test_offline_sm90.py
asserts it for the Gluon kernels.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)
SM90_MAX_SHARED = 232448          # bytes of dynamic shared memory an sm_90 program may use
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def available() -> bool:
    """Whether this Triton carries its NVIDIA backend's ptxas and cuobjdump."""
    return all(os.path.exists(os.path.join(_BIN, b)) for b in ("ptxas", "cuobjdump"))


def compile_sm90(kernel, args: tuple, kwargs: dict):
    """``kernel`` compiled for sm_90 as ``kernel[grid](*args, **kwargs)`` would specialize it."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, opts)
    source = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(kernel, signature, constexprs, attrs), target=TARGET,
                          options=options.__dict__)


def resources(compiled) -> dict:
    """Registers and spill stack per thread (from the cubin), shared memory, warps, and the
    counts of wgmma dots, mma.sync dots and cp.async copies in the kernel's TTGIR, of
    barriers (``bar.sync``), 16-byte global stores (``st.global...v4``) and grid dependency waits and
    triggers (``griddepcontrol``) in its PTX, and whether it launches as a programmatic dependent (``pdl``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-res-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    ttgir = compiled.asm["ttgir"]
    return dict(regs=int(found["REG"]), stack=int(found["STACK"]), smem=compiled.metadata.shared,
                warps=compiled.metadata.num_warps, wgmma=ttgir.count("warp_group_dot "),
                mma_sync=ttgir.count("tt.dot "), cp_async=ttgir.count("async_copy_global_to_local"),
                barriers=compiled.asm["ptx"].count("bar.sync"),
                v4_stores=len(re.findall(r"st\.global[.\w]*\.v4\.", compiled.asm["ptx"])),
                gdc_wait=compiled.asm["ptx"].count("griddepcontrol.wait"),
                gdc_trigger=compiled.asm["ptx"].count("griddepcontrol.launch_dependents"),
                pdl=bool(compiled.metadata.launch_pdl))


@contextlib.contextmanager
def offline():
    """``with offline() as launches:`` -- wrapper launches compiled for sm_90, not run; each
    appended as ``(kernel name, grid, resources)``."""
    import attn_backends_kernels.attention_core as core
    import attn_backends_kernels.decode_attention as decode
    import attn_backends_kernels.extend_attention as extend
    import attn_backends_kernels.mla.attention as mla
    import attn_backends_kernels.mla.balanced as balanced
    import attn_backends_kernels.mla.warpspec as warpspec
    import attn_backends_kernels.mla.wgmma as wgmma
    import attn_backends_kernels.pdl as pdl
    import attn_backends_kernels.schedule as schedule
    modules = (core, decode, extend, mla, balanced, schedule)
    launches: list = []

    def compile_instead(kernel, grid, *args, **kwargs):
        compiled = compile_sm90(kernel, args, kwargs)
        extra = {"prefetch": kwargs["PREFETCH"]} if "PREFETCH" in kwargs else {}     # the merge pass's form
        if "CHUNK_CAP" in kwargs:                                                       # a Gluon chunk pass's cap
            extra["cap"] = kwargs["CHUNK_CAP"]
        launches.append((kernel.__name__, tuple(grid), {**resources(compiled), **extra}))
        return compiled

    saved = ([m.launch for m in modules], wgmma.on_hopper, warpspec.hopper_device, pdl.pdl_device,
             balanced.device_sms)
    for m in modules:
        m.launch = compile_instead
    wgmma.on_hopper = lambda t: True
    warpspec.hopper_device = lambda device: True        # the split partials' dtype, as on sm_90
    pdl.pdl_device = lambda device: True                # merges as dependent launches, as on sm_90
    balanced.device_sms = lambda device: 132            # an H100's or H200's SMs (the chunk plan's)
    try:
        yield launches
    finally:
        for m, fn in zip(modules, saved[0]):
            m.launch = fn
        wgmma.on_hopper, warpspec.hopper_device, pdl.pdl_device, balanced.device_sms = saved[1:]


def mla_configs() -> dict:
    """``{label: thunk}``: the MLA wrapper at the sweep's shapes (bf16, page 64) with each Gluon
    kernel asked for and with the default, and the Gluon kernels' other masks, dtypes and page
    sizes."""
    import torch

    from attn_backends_kernels.mla.attention import mla_attention_fwd

    def call(H, W, splits, mask="causal", dtype=torch.bfloat16, page=64, kernel=None, block_h=None):
        bs, kv = 2, 256
        q = torch.zeros(bs * W, H, 576, dtype=dtype)
        buf = torch.zeros(bs * kv + 64, 1, 576, dtype=dtype)
        pt = torch.arange(bs * kv // page, dtype=torch.int32).view(bs, -1)
        lens = torch.full((bs,), kv, dtype=torch.int32)
        out = torch.zeros(bs * W, H, 512, dtype=dtype)
        cm = torch.ones(bs * W * W, dtype=torch.bool) if mask == "tree" else None
        draft = torch.zeros(bs, dtype=torch.int32) if mask == "draft" else None
        return lambda: mla_attention_fwd(q, buf, pt, lens, page, 0.1, splits, out, q_per_req=W,
                                         mask=mask, custom_mask=cm, draft_prefix_lens=draft,
                                         kernel=kernel, block_h=block_h)
    configs = {"mla16 decode": call(16, 1, 2), "mla16 decode page 16": call(16, 1, 2, page=16),
               "swap mla16 decode": call(16, 1, 2, kernel="swap"),
               "swap mla20 decode fp16 page 128": call(20, 1, 1, dtype=torch.float16, page=128, kernel="swap")}
    for kernel in ("wgmma", "seesaw", "chunked", "dbuf"):
        configs.update({f"{kernel} mla16 verify4": call(16, 4, 2, kernel=kernel),
                        f"{kernel} mla128 decode": call(128, 1, 1, kernel=kernel),
                        f"{kernel} mla128 verify4": call(128, 4, 2, kernel=kernel),
                        f"{kernel} mla16 draft4": call(16, 4, 1, "draft", kernel=kernel)})
    configs.update({"wgmma mla16 tree8 fp16 page 16": call(16, 8, 8, "tree", torch.float16, 16, "wgmma"),
                    "wgmma mla16 draft4 page 1": call(16, 4, 1, "draft", page=1, kernel="wgmma"),
                    "seesaw mla16 tree8 fp16 page 128": call(16, 8, 8, "tree", torch.float16, 128,
                                                             "seesaw"),
                    "chunked mla16 tree8 fp16 page 128": call(16, 8, 8, "tree", torch.float16, 128,
                                                              "chunked"),
                    "dbuf mla16 tree8 fp16 page 128": call(16, 8, 8, "tree", torch.float16, 128, "dbuf"),
                    "dbuf mla16 decode": call(16, 1, 2, kernel="dbuf", block_h=64),
                    "default mla16 verify4": call(16, 4, 2),
                    "default mla16 verify4 one split": call(16, 4, 1),
                    "default mla128 decode": call(128, 1, 2),
                    "default mla64 decode": call(64, 1, 2),
                    "default mla16 verify4 page 32": call(16, 4, 2, page=32),
                    "default mla16 verify4 page 16": call(16, 4, 2, page=16)})
    return {**configs, **mla_chunk_configs()}


def mla_chunk_configs() -> dict:
    """``{label: thunk}``: the MLA chunk pass (``mla.balanced``) and its merge at the sweep's shapes,
    on the Gluon kernels (the default) and on the Triton tile (``balanced triton ...``)."""
    import torch

    def chunked(H, W, splits=2, page=64, kernel=None, mask="causal", waves=False):   # the chunk pass, its merge
        from attn_backends_kernels.mla.balanced import mla_chunk_fwd
        bs, kv = 2, 256
        q, out = torch.zeros(bs * W, H, 576, dtype=torch.bfloat16), torch.zeros(bs * W, H, 512, dtype=torch.bfloat16)
        buf = torch.zeros(bs * kv + 64, 1, 576, dtype=torch.bfloat16)
        pt = torch.arange(bs * kv // page, dtype=torch.int32).view(bs, -1)
        lens = torch.full((bs,), kv, dtype=torch.int32)
        cm = torch.ones(bs * W * W, dtype=torch.bool) if mask == "tree" else None
        draft = torch.zeros(bs, dtype=torch.int32) if mask == "draft" else None
        return lambda: mla_chunk_fwd(q, buf, pt, lens, page, 0.1, splits, out, q_per_req=W, kernel=kernel, mask=mask,
                                     custom_mask=cm, draft_prefix_lens=draft, fit=waves, many_waves=waves)

    configs = {}
    configs.update({f"balanced{'' if kernel is None else ' triton'} {label}": chunked(H, W, kernel=kernel)
                    for label, H, W in (("mla16 decode", 16, 1), ("mla128 decode", 128, 1), ("mla16 verify4", 16, 4))
                    for kernel in (None, "triton")})
    configs.update({"balanced mla16 verify4 page 32": chunked(16, 4, page=32),      # seesaw's
                    "balanced mla16 verify4 page 16": chunked(16, 4, page=16),      # wgmma's
                    "balanced mla16 tree8 page 64": chunked(16, 8, mask="tree"),
                    "balanced mla16 draft4 page 64": chunked(16, 4, mask="draft"),
                    "balanced mla16 decode S10": chunked(16, 1, splits=10)})     # the merge's fat float32 16-chunk tile
    configs.update({f"balanced mla128 decode waves page {page}": chunked(128, 1, splits=4, page=page, waves=True)
                    for page in (64, 32, 16)})                                  # the capped chunk pass (CHUNK_CAP)
    configs["balanced mla16 decode waves"] = chunked(16, 1, splits=3, waves=True)       # the transposed one capped

    def planned(thunk):             # the chunk size planned first (``balanced.PLAN_WAVES``, ``mla.chunk_plan``)
        def run():
            from unittest import mock

            from attn_backends_kernels.mla import balanced
            with mock.patch.object(balanced, "PLAN_WAVES", True):
                thunk()
        return run
    configs["balanced mla128 decode waves planned"] = planned(chunked(128, 1, splits=4, waves=True))
    configs["balanced mla16 decode waves planned"] = planned(chunked(16, 1, splits=3, waves=True))
    return configs


def gqa_configs() -> dict:
    """``{label: thunk}``: the GQA wrappers (bf16, page 16, GQA 8 KV heads, d 128) at split counts
    the backend picks in the sweep, each with the merge fused into the split pass and kept
    separate (decode: ``FUSED_MERGE_BYTES = 0``; extend: its ``fuse`` knob): what the fused merge
    costs in registers, for the 16-row to 64-row tiles (``merge_chunk`` columns at a time)."""
    import torch

    from attn_backends_kernels import attention_core
    from attn_backends_kernels.decode_attention import decode_attention_fwd
    from attn_backends_kernels.extend_attention import extend_attention_fwd

    def call(H, W, splits, fused):
        bs, kv, dt = 2, 256, torch.bfloat16
        q, out = torch.zeros(bs * W, H, 128, dtype=dt), torch.zeros(bs * W, H, 128, dtype=dt)
        k, v = torch.zeros(bs * kv + 16, 8, 128, dtype=dt), torch.zeros(bs * kv + 16, 8, 128, dtype=dt)
        pt = torch.arange(bs * kv // 16, dtype=torch.int32).view(bs, -1)
        lens = torch.full((bs,), kv, dtype=torch.int32)
        cu = torch.arange(0, bs * W + 1, W, dtype=torch.int32)
        tree = dict(mask="tree", custom_mask=torch.ones(bs * W * W, dtype=torch.bool)) if W == 8 else {}

        def thunk():
            keep = attention_core.FUSED_MERGE_BYTES
            attention_core.FUSED_MERGE_BYTES = keep if fused else 0
            try:
                if W == 1:
                    decode_attention_fwd(q, k, v, pt, lens, 16, 0.1, splits, out)
                else:
                    extend_attention_fwd(q, k, v, pt, lens, cu, 16, 0.1, W, out, num_kv_splits=splits,
                                         fuse=fused, **tree)
            finally:
                attention_core.FUSED_MERGE_BYTES = keep
        return thunk
    shapes = {"gqa32 decode S64": (32, 1, 64), "gqa64 decode S32": (64, 1, 32),
              "gqa32 verify4 S8": (32, 4, 8), "gqa32 verify4 S4": (32, 4, 4), "gqa64 verify4 S4": (64, 4, 4),
              "gqa32 tree8 S4": (32, 8, 4), "gqa64 tree8 S4": (64, 8, 4), "gqa64 tree8 S2": (64, 8, 2)}
    return {f"{label} {way}": call(*shape, way == "fused") for label, shape in shapes.items()
            for way in ("fused", "separate")}


def gqa_decode_call(H, Hkv, D, splits, bs=24, n=256, kv=None, schedule="chunks", **kw):
    """A thunk of ``decode_attention_fwd`` over ``bs`` requests of ``n`` tokens in pages of 16 (zeros: nothing is
    computed offline), bf16 q and ``kv`` cache (None: bf16), ``splits`` a request; ``kw`` to the wrapper."""
    import torch

    from attn_backends_kernels.decode_attention import decode_attention_fwd
    from attn_backends_kernels.schedule import chunk_workspace, slots_per_request

    dt, kv = torch.bfloat16, kv or torch.bfloat16
    q, out = torch.zeros(bs, H, D, dtype=dt), torch.zeros(bs, H, D, dtype=dt)
    k, v = torch.zeros(bs * n + 16, Hkv, D, dtype=kv), torch.zeros(bs * n + 16, Hkv, D, dtype=kv)
    pt = torch.arange(bs * n // 16, dtype=torch.int32).view(bs, -1)
    lens = torch.full((bs,), n, dtype=torch.int32)
    ws = (chunk_workspace(bs, slots_per_request(schedule, splits, n), 1, H, Hkv, D, "cpu") if schedule != "split"
          else None)
    extra = dict(schedule=schedule, merge="pass") if schedule != "split" else {}
    return lambda: decode_attention_fwd(q, k, v, pt, lens, 16, 0.1, splits, out, ws, **extra, **kw)


def gqa_chunk_configs() -> dict:
    """``{label: thunk}``: GQA decode under the chunk schedule at the backend's defaults (tile, register
    bound: ``decode_attention.chunk_maxnreg``), bf16 pages of 16 but where named, at a budget of about 15.5
    programs an SM (the bound's band): what the bound's rule must keep free of spills."""
    import torch

    def call(H, Hkv, D, kv=None, bs=24, **feats):
        splits = round(15.5 * 132 / (bs * Hkv))          # decode_attention.OFFLINE_SMS: the tensors are on no GPU
        return gqa_decode_call(H, Hkv, D, splits, bs=bs, kv=kv, **feats)
    feats = dict(window=100, softcap=30.0, sinks=torch.zeros(32))
    return {"chunks 32/8 d128": call(32, 8, 128), "chunks 32/8 d128 bs16": call(32, 8, 128, bs=16),
            "chunks 32/8 d64": call(32, 8, 64), "chunks 32/1 d128": call(32, 1, 128),
            "chunks 28/4 d128": call(28, 4, 128), "chunks 8/1 d128": call(8, 1, 128),
            "chunks 64/8 d128": call(64, 8, 128), "chunks 32/8 d128 features": call(32, 8, 128, **feats),
            "chunks 32/8 d128 fp8": call(32, 8, 128, torch.float8_e4m3fn), "chunks 32/8 d256": call(32, 8, 256)}


def verify_chunk_configs() -> dict:
    """``{label: thunk}``: GQA verify N=4 under the chunk schedule, merged by the pass (bf16, pages of 16)."""
    import torch

    from attn_backends_kernels.extend_attention import extend_attention_fwd
    from attn_backends_kernels.schedule import chunk_workspace

    def call(H, Hkv, D, bs=24, W=4, n=512, splits=4):
        dt = torch.bfloat16
        q, out = torch.zeros(bs * W, H, D, dtype=dt), torch.zeros(bs * W, H, D, dtype=dt)
        k, v = (torch.zeros(bs * n + 16, Hkv, D, dtype=dt) for _ in range(2))
        pt = torch.arange(bs * n // 16, dtype=torch.int32).view(bs, -1)
        lens = torch.full((bs,), n, dtype=torch.int32)
        cu = torch.arange(0, bs * W + 1, W, dtype=torch.int32)
        ws = chunk_workspace(bs, splits, W, H, Hkv, D, "cpu")
        return lambda: extend_attention_fwd(q, k, v, pt, lens, cu, 16, 0.1, W, out, num_kv_splits=splits, workspace=ws,
                                            schedule="chunks", merge="pass")
    return {"chunks verify4 32/8 d128": call(32, 8, 128), "chunks verify4 8/1 d128": call(8, 1, 128)}


def resident_configs() -> dict:
    """``{label: thunk}``: the chunk pass at the compiler's registers (no bound, no fit), bf16, 24 requests: the
    programs an SM it holds, which ``decode_attention.chunk_resident`` states for the wave fit; "few N": at pow2(S)
    = N chunks a request with ``DECODE_FEW_LAST`` on (8), the others with it off."""
    from unittest import mock

    import attn_backends_kernels.decode_attention as decode
    return {f"resident {H}/{Hkv} d{D}" + (f" few{few}" if few else ""):
            mock.patch.object(decode, "DECODE_FEW_LAST", 8 if few else 0)(
                gqa_decode_call(H, Hkv, D, few or 4, maxnreg=None, fit=False)) for H, Hkv, D in
            ((32, 8, 128), (28, 4, 128), (12, 4, 128), (20, 4, 128), (24, 4, 128), (8, 1, 128), (64, 8, 128),
             (64, 4, 128), (32, 8, 64), (28, 4, 64), (32, 32, 128), (16, 8, 128)) for few in (0, 2, 4, 8)}


def deep_configs() -> dict:
    """``{label: thunk}``: the few-program GQA decode on 256 splits (``DEEP_MAX_KV_SPLITS``, 8/1 d128, bf16 and
    e4m3 caches): the split pass and the separate merge of 256 float32 partials a row (``merge_splits``)."""
    import torch
    return {label: gqa_decode_call(8, 1, 128, 256, bs=2, n=4096, kv=kv, schedule="split")
            for label, kv in (("deep 8/1 d128", torch.bfloat16), ("deep 8/1 d128 fp8", torch.float8_e4m3fn))}


def prefetch_configs() -> dict:
    """``{label: thunk}``: GQA's decode merge pass (its sum's walk prefetched: ``chunk_kernels.MERGE_PASS_PREFETCH``)
    at 16 and 64 chunks a load over 128 columns (the deep tiles off: ``MERGE_PASS_DEEP_FROM``)."""
    from unittest import mock

    import attn_backends_kernels.chunk_kernels as ck

    def tiles(thunk, block_c):
        return mock.patch.multiple(ck, MERGE_PASS_CHUNKS=block_c, MERGE_PASS_WIDE_CHUNKS=block_c,
                                   MERGE_PASS_DEEP_FROM=1 << 30)(thunk)
    gqa = gqa_chunk_configs()
    return {"prefetch c16 8/1 d128": tiles(gqa["chunks 8/1 d128"], 16),
            "prefetch c64 8/1 d128": tiles(gqa["chunks 8/1 d128"], 64),
            "prefetch c64 32/8 d64": tiles(gqa["chunks 32/8 d64"], 64)}


def measure(labels=None) -> list:
    """``[{config, kernel, grid, **resources}]`` of every launch of the chosen configs."""
    rows = []
    configs = {**mla_configs(), **gqa_configs(), **gqa_chunk_configs(), **verify_chunk_configs(), **prefetch_configs(),
               **deep_configs(),
               **resident_configs()}
    for label, thunk in configs.items():
        if labels and label not in labels:
            continue
        with offline() as launches:
            thunk()
        rows += [dict(config=label, kernel=name, grid=list(grid), **r) for name, grid, r in launches]
    return rows


def main(argv) -> int:
    if not available():
        print("this Triton has no bundled ptxas / cuobjdump (its NVIDIA backend)", file=sys.stderr)
        return 1
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled", file=sys.stderr)
        return 1
    rows = measure()
    if "--json" in argv:
        print("\n".join(json.dumps(r) for r in rows))
        return 0
    cols = ("regs", "stack", "smem", "warps", "wgmma", "mma_sync", "cp_async", "barriers", "v4_stores")
    print("| config | kernel | grid | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---:|" * len(cols))
    for r in rows:
        print(f"| {r['config']} | {r['kernel']} | {tuple(r['grid'])} | "
              + " | ".join(str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
