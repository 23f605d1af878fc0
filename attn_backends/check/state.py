"""Fingerprints of the mutable state of a backend, a step, a runner or a KV memory: what
"a public call that raises leaves everything exactly as it was" is checked against.

A fingerprint is a plain dict of host values and tensor bytes; :func:`state_diff` names every
entry that differs. Tensors are compared bit for bit (NaN equals NaN)."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch


def tensor_bits(t: torch.Tensor) -> tuple:
    """(shape, dtype, device, data_ptr, bytes) of ``t``: equal exactly when nothing moved or changed."""
    flat = t.detach().contiguous().reshape(-1)
    data = flat.view(torch.uint8) if flat.numel() else flat
    return tuple(t.shape), t.dtype, str(t.device), t.data_ptr(), data.cpu().clone()


def _step(step) -> dict:
    out = {"step_id": step.step_id, "loaded": getattr(step, "_loaded", None),
           "cache": sorted(map(repr, step.cache)),
           "captured": {k: (id(e), id(e.layout), id(e.graph), e.need, e.pad, e.layout.max_seq_len_q,
                            e.layout.max_seq_len_k) for k, e in step._captured.items()}}
    if step.max_bs:
        out.update({name: tensor_bits(t) for name, t in step.tensors().items()})
        out["seq_lens_cpu"] = tensor_bits(step.seq_lens_cpu)
    return out


def _backend(be) -> dict:
    out = {"forward_metadata": id(be.forward_metadata)}
    meta = getattr(be, "_graph_meta", None)
    if meta is not None:
        out["graph_meta"] = {k: (id(m), tuple((f.name, id(getattr(m, f.name))) for f in dataclasses.fields(m)))
                             for k, m in meta.items()}
        own = be._steps
        out["graph_size"] = own._size
        out["own_step"] = None if own.graph_step is None else (id(own.graph_step), _step(own.graph_step))
    return out


def _memory(mem) -> dict:
    pool = mem.pool
    bufs = pool.kv if mem.is_mla else pool.k + pool.v
    return {"req_to_token": tensor_bits(mem.req_to_token), "pool": [tensor_bits(b) for b in bufs],
            "free_pages": list(mem.pages._free), "free_rows": list(mem.req_pool._free),
            "lens": dict(mem._lens), "pages": {r: list(p) for r, p in mem._pages.items()}}


def _runner(r) -> dict:
    steps = list(r.steps) if hasattr(r, "steps") else [r.step]
    out = {"replay_count": r.replay_count, "graphs": {k: id(v) for k, v in r.graphs.items()},
           "steps": [_step(p) for p in steps], "backends": [_backend(b) for b in r.backends]}
    out["static_raw_bs"] = {k: [sb.raw_bs for sb in (v[2] if isinstance(v[2], list) else [v[2]])]
                            for k, v in r.graphs.items() if not isinstance(k, int)}
    for name in ("positions", "embeds"):
        t = getattr(r, name, None)
        if isinstance(t, torch.Tensor):
            out[name] = tensor_bits(t)
    return out


def fingerprint(obj: Any) -> dict:
    """The mutable state of a runner, a backend, a step or a KV memory."""
    if hasattr(obj, "replay_count"):
        return _runner(obj)
    if hasattr(obj, "_captured"):
        return _step(obj)
    if hasattr(obj, "req_pool") and hasattr(obj, "pages"):
        return _memory(obj)
    return _backend(obj)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def state_diff(before: dict, after: dict, prefix: str = "") -> list:
    """The entries of two fingerprints that differ (empty: the same state)."""
    out = []
    for k in sorted(set(before) | set(after), key=str):
        a, b = before.get(k), after.get(k)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) and not _same(a, b):
            a, b = dict(enumerate(a)), dict(enumerate(b))
        if isinstance(a, dict) and isinstance(b, dict) and not _same(a, b):
            out += state_diff(a, b, f"{prefix}{k}.")
        elif not _same(a, b):
            out.append(f"{prefix}{k}")
    return out
