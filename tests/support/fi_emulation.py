"""FlashInfer on the CPU, for tests where ``import flashinfer`` works (it imports without a GPU;
Python 3.12 with the wheels of ``/work/main/.whl``): the real wrappers' Python code runs
(constructors, ``plan()`` with its checks and buffer copies, ``run()``), and only the JIT kernel
modules are replaced by PyTorch emulations that read exactly the arguments the CUDA kernels read
in flashinfer 0.7.2.post1:

* prefill ``paged_run`` (also tensor-core decode): ``qo_indptr``, ``kv_indptr``, ``kv_indices``,
  ``kv_last_page_len`` buffers, the mask mode, and for ``MaskMode.CUSTOM`` the packed mask at
  byte ``mask_indptr[i]``, bit ``qo * kv_len + kv`` little-endian (``include/flashinfer/
  attention/variants.cuh``); causal rows aligned bottom-right;
* CUDA-core decode ``run``: ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``, one row each;
* both as ``variants.cuh``'s ``DefaultAttention`` built with the module's ``use_sliding_window`` and
  ``use_logits_soft_cap`` flags (a module built without one ignores its run argument): the window
  keeps ``kv + qo_len + window_left >= kv_len + qo`` (query rows, whatever the mask;
  ``window_left < 0``: ``kv_len``), the cap makes a score ``cap * tanh(q.k * sm_scale / cap)``;
  ``run(sinks=)`` reaches no fa2 kernel (``prefill.py`` ``paged_run``), so it is read nowhere;
* the ``AttentionSink`` JIT variant of ``BatchAttentionWithAttentionSinkWrapper``
  (``jit/attention/variants.py``; the wrapper's JIT build replaced): its additional arguments
  ``sink [H]`` and ``sm_scale`` after the common ones; the kernel's causal rows and the variant's
  row window, no custom-mask bits (its mask reads none), no cap; ``exp(sink[h])`` in the denominator;
* MLA ``run``: the plan's host CSR arrays, which the real plan copies into the int workspace
  (``scheduler.cuh`` ``MLAPlan``): the emulated plan writes them there and the run reads them
  back, so a missing re-plan shows; ``kv_indices`` from the wrapper's buffer. The module is
  built for the plan's q and KV dtypes (``get_batch_mla_module``); with an e4m3 KV it widens
  each tile to the query's dtype and multiplies latent by ``ckv_scale`` and rope by
  ``kpe_scale``, both rounded to that dtype, the product too (``mla.cuh`` /
  ``mla_hopper.cuh`` ``repack_fp8_kv_to_bf16``); other KV dtypes read no scale.

The ``*Emulated`` backend classes below are the real backends with CPU allowed in their
capabilities, for the suites.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections import deque

import pytest
import torch

from attn_backends.backends.flashinfer_backend import FlashInferBackend
from attn_backends.backends.flashinfer_mla import FlashInferMLABackend

PLANS: list = []          # (kind, batch size, graph form) of every emulated plan() call, in order
PLAN_ARGS: deque = deque(maxlen=4)   # the arguments of the last scheduler calls, as passed (they hold workspaces)
HOST: dict = {}           # id(a wrapper's int workspace) -> (kv_indptr, kv_lens or None) its last plan was given


def _planned(args, indptr_at: int, lens_at=None) -> None:
    """Record the host lengths a scheduler call was given (``args[1]``: the wrapper's int workspace)."""
    HOST[id(args[1])] = (args[indptr_at].clone(), None if lens_at is None else args[lens_at].clone())


def _check_host(a, kvp, last, ps: int) -> None:
    """The real kernels run the schedule their plan made from host lengths over the device
    buffers: a plan whose host ``kv_indptr`` / KV lengths differ from the device's splits the
    work wrongly (a light replan copies nothing to the device), so the emulation refuses it."""
    held = HOST.get(id(a[1]))
    if held is None:
        return
    n, (indptr, lens) = len(last), held
    dev = kvp[:n + 1].to(torch.int64)
    if not torch.equal(indptr[:n + 1].to(torch.int64), dev):
        raise AssertionError(f"planned kv_indptr {indptr[:n + 1].tolist()} != the device's {dev.tolist()}")
    dev_lens = (dev[1:] - dev[:-1] - 1) * ps + last[:n].to(torch.int64)
    if lens is not None and not torch.equal(lens[:n].to(torch.int64), dev_lens):
        raise AssertionError(f"planned KV lengths {lens[:n].tolist()} != the device's {dev_lens.tolist()}")


def _kv_rows(cache, indptr, indices, last, ps, i):
    pages = indices[int(indptr[i]):int(indptr[i + 1])].long()
    kv = (len(pages) - 1) * ps + int(last[i])
    return cache[pages].reshape(-1, *cache.shape[2:])[:kv].float(), kv


def _attend(q, k, v, visible, scale, cap=0.0, sink=None):
    """``q [n, H, D]`` against ``k [kv, Hk, D]``, ``v [kv, Hk, Dv]`` (GQA by head groups); ``sink [H]``."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    raw = torch.einsum("nhd,khd->hnk", q.float(), k)
    # DefaultAttention: logits tanh(raw * sm_scale / cap), then the softmax's scale cap instead of sm_scale
    s = cap * torch.tanh(raw * (scale / cap)) if cap > 0 else raw * scale
    s = s.masked_fill(~visible[None], float("-inf"))
    if sink is None:
        return torch.einsum("hnk,khd->nhd", torch.softmax(s, -1), v)
    col = sink.float()[:, None, None].expand(-1, s.shape[1], 1)             # a column with no value
    return torch.einsum("hnk,khd->nhd", torch.softmax(torch.cat([s, col], -1), -1)[..., :-1], v)


def _visible(n, kv, mode, mask, moff, window_left=-1):
    qo, kvi = torch.arange(n)[:, None], torch.arange(kv)[None, :]
    wl = window_left if window_left >= 0 else kv
    in_window = kvi + n + wl >= kv + qo                    # rows, not positions: variants.cuh
    if mode == 2:                          # CUSTOM: packed bits from byte mask_indptr[i]
        e = torch.arange(n * kv)
        bits = (mask[moff + e // 8].long() >> (e % 8)) & 1
        return bits.view(n, kv).bool() & in_window
    if mode == 1:                          # CAUSAL, bottom-right
        return (kvi <= kv - n + qo) & in_window
    return torch.ones(n, kv, dtype=torch.bool) & in_window


class _Prefill:
    def __init__(self, *module_args):      # get_batch_prefill_module(backend, dtypes..., swa, softcap, fp16_qk)
        self.window, self.cap = module_args[8], module_args[9]

    def plan(self, *args):
        PLANS.append(("prefill", args[7], args[11]))
        PLAN_ARGS.append(args)
        _planned(args, 4, 5)
        return [0]

    def paged_run(self, *a):
        q, k, v, qo, kvp, kvi, last, out = a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10]
        mode, mask, moff_all, scale = a[12], a[16], a[17], a[23]
        wl, cap = (a[14] if self.window else -1), (a[22] if self.cap else 0.0)
        ps = k.shape[1]
        _check_host(a, kvp, last, ps)
        for i in range(len(last)):
            kk, kv = _kv_rows(k, kvp, kvi, last, ps, i)
            vv, _ = _kv_rows(v, kvp, kvi, last, ps, i)
            lo, hi = int(qo[i]), int(qo[i + 1])
            vis = _visible(hi - lo, kv, mode, mask, int(moff_all[i]) if mode == 2 else 0, wl)
            out[lo:hi] = _attend(q[lo:hi], kk, vv, vis, scale, cap).to(out.dtype)


class _SinkPrefill:
    """The JIT module of ``get_batch_prefill_jit_module(name, get_customize_batch_prefill_module(
    backend, *jit_args, **jit_kwargs))``, for the ``AttentionSink`` variant alone."""

    def __init__(self, backend, jit_args, jit_kwargs):
        assert jit_args[11] == "AttentionSink" and list(jit_args[7]) == ["sink"], jit_args[11]
        self.dtypes = jit_args[1:3]

    def plan(self, *args):
        PLANS.append(("sink_prefill", args[7], args[11]))
        PLAN_ARGS.append(args)
        _planned(args, 4, 5)
        return [0]

    def paged_run(self, *a):
        q, k, v, qo, kvp, kvi, last, out = a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10]
        mode, wl, sink, scale = a[12], a[14], a[16], a[17]
        if (q.dtype, k.dtype) != tuple(self.dtypes):
            raise RuntimeError(f"a sink module built for {self.dtypes} handed {q.dtype}, {k.dtype}")
        ps = k.shape[1]
        _check_host(a, kvp, last, ps)
        for i in range(len(last)):
            kk, kv = _kv_rows(k, kvp, kvi, last, ps, i)
            vv, _ = _kv_rows(v, kvp, kvi, last, ps, i)
            lo, hi = int(qo[i]), int(qo[i + 1])
            vis = _visible(hi - lo, kv, 1 if mode == 1 else 0, None, 0, wl)     # CUSTOM: no bits read
            out[lo:hi] = _attend(q[lo:hi], kk, vv, vis, scale, 0.0, sink).to(out.dtype)


class _Decode:
    def __init__(self, *module_args):      # get_batch_decode_module(dtypes..., pos, swa, softcap)
        self.window, self.cap = module_args[7], module_args[8]

    def plan(self, *args):
        PLANS.append(("decode", args[4], args[8]))
        PLAN_ARGS.append(args)
        _planned(args, 3)
        return [0]

    def run(self, *a):
        q, k, v, kvp, kvi, last, out, scale = a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[16]
        wl, cap = (a[12] if self.window else -1), (a[15] if self.cap else 0.0)
        _check_host(a, kvp, last, k.shape[1])
        for i in range(len(last)):
            kk, kv = _kv_rows(k, kvp, kvi, last, k.shape[1], i)
            vv, _ = _kv_rows(v, kvp, kvi, last, k.shape[1], i)
            out[i:i + 1] = _attend(q[i:i + 1], kk, vv, _visible(1, kv, 0, None, 0, wl), scale, cap).to(out.dtype)


def _widen(cache, pages, kv, dtype_kv, dtype_q, scale):
    """``[kv, 1, D]`` float32 rows of an MLA cache as the kernel reads them into its tile."""
    if cache.dtype != dtype_kv:
        raise RuntimeError(f"a kernel built for {dtype_kv} handed a {cache.dtype} cache")
    rows = cache[pages].reshape(-1, cache.shape[-1])[:kv]
    if dtype_kv == torch.float8_e4m3fn:
        rows = rows.to(dtype_q) * torch.tensor(scale, dtype=dtype_q)
    return rows.float()[:, None]


class _MLA:
    def __init__(self, backend, dtype_q, dtype_kv, *rest):
        self.dtype_q, self.dtype_kv = dtype_q, dtype_kv

    def plan_with_staged_workspace_bytes(self, fws, iws, pinned, qo, kvp, kvl, heads, ckv, causal):
        PLANS.append(("mla", len(kvl), None))
        PLAN_ARGS.append((fws, iws, pinned, qo, kvp, kvl, heads, ckv, causal))
        meta = torch.cat([torch.tensor([len(kvl)]), qo, kvp, kvl]).to(torch.int32)
        iws.view(torch.int32)[:meta.numel()] = meta      # what the kernel reads comes from the plan
        return [0], 0

    def run(self, fws, iws, plan_info, q_nope, q_pe, ckv, kpe, kvi, out, lse, mode, heads, ps, scale, base_e,
            ckv_scale, kpe_scale, ckv_scale_arr, *profiler):
        assert ckv_scale_arr is None, "per-token scales are not emulated"
        w = iws.view(torch.int32)
        bs = int(w[0])
        qo, kvp, kvl = w[1:bs + 2], w[bs + 2:2 * bs + 3], w[2 * bs + 3:3 * bs + 3]
        for i in range(bs):
            pages = kvi[int(kvp[i]):int(kvp[i + 1])].long()
            kv = int(kvl[i])
            c = _widen(ckv, pages, kv, self.dtype_kv, self.dtype_q, ckv_scale)     # [kv, 1, 512]
            r = _widen(kpe, pages, kv, self.dtype_kv, self.dtype_q, kpe_scale)
            lo, hi = int(qo[i]), int(qo[i + 1])
            vis = _visible(hi - lo, kv, mode, None, 0)
            qq = torch.cat([q_nope[lo:hi], q_pe[lo:hi]], -1)
            out[lo:hi] = _attend(qq, torch.cat([c, r], -1), c, vis, scale).to(out.dtype)


def _no_pin(real):
    def empty(*a, **k):
        k.pop("pin_memory", None)
        return real(*a, **k)
    return empty


def install(monkeypatch) -> None:
    """Swap FlashInfer's kernel modules and device queries for the CPU emulations."""
    pytest.importorskip("flashinfer", reason="flashinfer is not importable here (Python 3.12 wheels)")
    PLANS.clear()
    PLAN_ARGS.clear()
    HOST.clear()
    monkeypatch.setattr(torch, "empty", _no_pin(torch.empty))
    dec, pre = importlib.import_module("flashinfer.decode"), importlib.import_module("flashinfer.prefill")
    monkeypatch.setattr(dec, "get_batch_decode_module", _Decode)
    monkeypatch.setattr(dec, "get_batch_prefill_module", _Prefill)
    monkeypatch.setattr(pre, "get_batch_prefill_module", _Prefill)
    monkeypatch.setattr(pre, "get_customize_batch_prefill_module", lambda backend, *a, **k: (backend, a, k))
    monkeypatch.setattr(pre, "get_batch_prefill_jit_module", lambda name, spec: _SinkPrefill(*spec))
    common = importlib.import_module("flashinfer.mla._batch_mla._backends._fa_common")
    props = type("Props", (), {"shared_memory_per_multiprocessor": 233472, "shared_memory_per_block_optin": 232448})
    monkeypatch.setattr(common, "get_compute_capability", lambda d: (9, 0))
    monkeypatch.setattr(common, "get_device_properties", lambda d: props())
    monkeypatch.setattr(common, "get_device_sm_count", lambda d: 132)
    for name in ("fa2_backend", "fa3_backend"):
        mod = importlib.import_module(f"flashinfer.mla._batch_mla._backends.{name}")
        monkeypatch.setattr(mod, "get_batch_mla_module", lambda *a: _MLA(*a))


def _on_cpu(cls):
    return dataclasses.replace(cls.capabilities, devices=("cpu", "cuda"))


class EmulatedFlashInfer(FlashInferBackend):
    name = "fi_emulated"
    capabilities = _on_cpu(FlashInferBackend)


class EmulatedFlashInferMLA(FlashInferMLABackend):
    name = "fi_mla_emulated"
    capabilities = _on_cpu(FlashInferMLABackend)
