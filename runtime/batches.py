"""ForwardBatch builders of the engine: one per mode, from request rows and positions whose
slots are already allocated in the :class:`KVMemory`. ``seq_lens`` counts the KV tokens after
the forward (the layout contract of ``attn_backends/layout.py``); uniform modes give every request ``W`` rows."""
from __future__ import annotations

from typing import Optional

import torch

from attn_backends import CaptureHiddenMode, ForwardBatch, ForwardMode, KVMemory, SpecInfo

from .kv_bookkeeping import slots_window

I32, I64 = torch.int32, torch.int64


def extend_batch(memory: KVMemory, rows: list, starts: list, tokens: list,
                 hidden: CaptureHiddenMode = CaptureHiddenMode.NULL) -> ForwardBatch:
    """EXTEND of ``tokens[i]`` at positions ``starts[i]..`` of request row ``rows[i]``."""
    dev = memory.device
    lens = [len(t) for t in tokens]
    seq = torch.tensor([s + n for s, n in zip(starts, lens)], dtype=I32)
    ext = torch.tensor(lens, dtype=I32)
    loc = torch.cat([memory.req_to_token[r, s:s + n] for r, s, n in zip(rows, starts, lens)]).long()
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]).to(dev)
    ids = torch.tensor([t for ts in tokens for t in ts], dtype=I64, device=dev)
    return ForwardBatch(ForwardMode.EXTEND, len(rows), torch.tensor(rows, dtype=I32, device=dev), seq.to(dev), seq,
                        loc, pos, ext.to(dev), ext, capture_hidden_mode=hidden, input_ids=ids)


def device_rows(rows: list, device) -> torch.Tensor:
    """``[len(rows), n]`` int64 on ``device`` from lists of ``n`` host ints, in one copy (from
    pinned memory on CUDA, so it does not wait for the queued work; the caching host allocator
    keeps the staging block until the copy has run)."""
    if torch.device(device).type != "cuda":
        return torch.tensor(rows, dtype=I64)
    return torch.tensor(rows, dtype=I64, pin_memory=True).to(device, non_blocking=True)


def uniform_batch(mode: ForwardMode, memory: KVMemory, rows: torch.Tensor, starts: torch.Tensor,
                  starts_cpu: torch.Tensor, input_ids: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                  spec: Optional[SpecInfo] = None, hidden: CaptureHiddenMode = CaptureHiddenMode.NULL,
                  loc: Optional[torch.Tensor] = None) -> ForwardBatch:
    """DECODE, TARGET_VERIFY or DRAFT_EXTEND: request ``i`` writes ``W`` rows at positions
    ``starts[i] .. starts[i] + W - 1``; ``offsets [bs, W]`` (tree verify: each node's level) sets
    the positions the model sees, ``starts[i] + offsets`` (default: ``0..W-1``); ``loc [bs, W]``
    the slots of those positions when the caller has them (default: read from ``req_to_token``).

    rows ``[bs]`` int32, starts ``[bs]`` int64 and input_ids ``[bs * W]`` int64 on the device,
    starts_cpu ``[bs]`` int32 on the host: nothing here copies from the host, so building the
    batch never waits for the forwards already queued.
    """
    w = 1 if mode == ForwardMode.DECODE else spec.num_draft_tokens
    bs = int(starts_cpu.shape[0])
    if loc is None:
        loc = slots_window(memory, rows, starts, w)                                  # [bs, W]
    if offsets is None:
        offsets = torch.arange(w, device=starts.device)
    pos = starts[:, None] + offsets
    seq = torch.add(starts, w, out=torch.empty(bs, dtype=I32, device=starts.device))
    return ForwardBatch(mode, bs, rows, seq, starts_cpu + w, loc.reshape(-1), pos.reshape(-1),
                        spec_info=spec, capture_hidden_mode=hidden, input_ids=input_ids)
