"""Validation of a batch before any kernel runs: host checks always (shapes, lengths, the spec),
device values where a sync is allowed (eager on the CPU, graph capture). Every error names the
value and the limit."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .batch import ForwardMode, SpecInfo, query_width

if TYPE_CHECKING:
    from .layout import LayoutInputs


class LayoutError(ValueError):
    """A batch that no kernel may be launched on; the message names value and limit."""


def validate(inp: LayoutInputs) -> None:
    """Raise LayoutError for a batch no kernel may run on. Host checks always; device
    values only when ``inp.check_device_values`` (they sync)."""
    _check_shapes(inp)
    seqs = inp.seq_lens_cpu[:inp.raw_bs].tolist()   # a host tensor: no device sync; lists are fast
    if inp.mode == ForwardMode.EXTEND:
        _check_extend(inp, seqs)
    else:
        check_lengths(inp.mode, inp.spec_info, seqs, inp.max_context_len)
        _check_spec(inp)
    if inp.check_device_values:
        _check_device_values(inp, seqs)


def _check_shapes(inp: LayoutInputs) -> None:
    bs = inp.bs
    if bs < 1:
        raise LayoutError(f"bs={bs} must be >= 1")
    for name in ("seq_lens", "seq_lens_cpu"):
        t = getattr(inp, name)
        if tuple(t.shape) != (bs,):
            raise LayoutError(f"{name} has shape {tuple(t.shape)}, expected ({bs},) like req_pool_indices")
    if inp.seq_lens_cpu.device.type != "cpu":
        raise LayoutError(f"seq_lens_cpu must be a host tensor, got device {inp.seq_lens_cpu.device}")
    mem = inp.req_to_token.device
    for name in ("req_pool_indices", "seq_lens"):
        if getattr(inp, name).device.type != mem.type:
            raise LayoutError(f"{name} is on {getattr(inp, name).device}, the KV memory on {mem}")
    for name in ("req_pool_indices", "seq_lens", "seq_lens_cpu"):
        dtype = getattr(inp, name).dtype
        if dtype not in (torch.int32, torch.int64):
            raise LayoutError(f"{name} dtype {dtype} is not int32/int64")
    if not 1 <= inp.raw_bs <= bs:
        raise LayoutError(f"raw_bs={inp.raw_bs} outside 1..bs={bs}")
    if inp.mode == ForwardMode.IDLE:
        raise LayoutError("IDLE batches carry no tokens and get no attention metadata")


def check_lengths(mode: ForwardMode, spec: Optional[SpecInfo], seqs: list, max_context_len: int,
                  need: Optional[int] = None) -> None:
    """Host checks of the real rows' seq_lens in a uniform mode (also run on every replay);
    ``need``: the least valid seq_len when the caller knows it (the replay's fast path)."""
    if need is not None and min(seqs) >= need and max(seqs) <= max_context_len:
        return
    if max(seqs) > max_context_len:
        raise LayoutError(f"seq_len={max(seqs)} exceeds max_context_len={max_context_len}")
    w = query_width(mode, spec)
    need = w * spec.draft_step if (spec is not None and spec.is_draft_decode) else w
    if min(seqs) < need:
        i = next(i for i, n in enumerate(seqs) if n < need)
        step = f", draft_step={spec.draft_step}" if need != w else ""
        raise LayoutError(f"request {i}: seq_len={seqs[i]} < {need} query tokens (W={w}{step}); "
                          "seq_lens must include this forward's tokens")


def _check_extend(inp: LayoutInputs, seqs: list) -> None:
    if max(seqs) > inp.max_context_len:
        raise LayoutError(f"seq_len={max(seqs)} exceeds max_context_len={inp.max_context_len}")
    ext = inp.extend_seq_lens_cpu
    if ext is None or inp.extend_seq_lens is None:
        raise LayoutError("EXTEND needs extend_seq_lens and extend_seq_lens_cpu")
    if tuple(ext.shape) != (inp.bs,):
        raise LayoutError(f"extend_seq_lens_cpu has shape {tuple(ext.shape)}, expected ({inp.bs},)")
    seq = torch.tensor(seqs, dtype=torch.int64)
    bad = (ext[:inp.raw_bs] < 1) | (ext[:inp.raw_bs].to(torch.int64) > seq)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise LayoutError(f"request {i}: extend_seq_len={int(ext[i])} outside 1..seq_len={int(seq[i])}")


def _check_spec(inp: LayoutInputs) -> None:
    mode, spec = inp.mode, inp.spec_info
    w = query_width(mode, spec)
    if mode == ForwardMode.TARGET_VERIFY and spec.topk > 1:
        tm = spec.tree_mask
        if tm is None or tm.dim() != 3 or tm.shape[1:] != (w, w) or tm.shape[0] < inp.raw_bs:
            raise LayoutError(f"tree verify needs tree_mask [bs, {w}, {w}], got "
                              f"{None if tm is None else tuple(tm.shape)}")
        if inp.check_device_values and not bool(tm[:inp.raw_bs].diagonal(dim1=1, dim2=2).all()):
            raise LayoutError("tree_mask diagonal must be True: every draft token sees itself")
    if mode == ForwardMode.DRAFT_EXTEND and spec.accept_lens is not None and inp.check_device_values:
        acc = spec.accept_lens[:inp.raw_bs]
        if bool(((acc < 1) | (acc > w)).any()):
            raise LayoutError(f"accept_lens {acc.tolist()} outside 1..N={w} (valid tokens incl. the bonus)")


def check_request_rows(req: torch.Tensor, rows: int, stand_in: bool = False) -> None:
    """The real requests' rows ``req`` lie in the table of ``rows`` rows and off the reserved row 0
    (padding's, all zeros: a request there would read the reserved slot 0 as its KV). ``stand_in``:
    a capture batch standing wholly on row 0 before any request exists (a step's own, or a
    caller's all-zero one, as SGLang captures), which replays rewrite. Reads device values (a sync)."""
    if bool(((req < 0) | (req >= rows)).any()):
        raise LayoutError(f"req_pool_indices {req.tolist()} outside 0..{rows - 1}")
    if not stand_in and bool((req == 0).any()):
        raise LayoutError(f"req_pool_indices {req.tolist()}: request {req.tolist().index(0)} is on row 0, "
                          f"reserved for padding (real requests use rows 1..{rows - 1})")


def _check_device_values(inp: LayoutInputs, seqs: list) -> None:
    req = inp.req_pool_indices[:inp.raw_bs]
    # static inputs are a step's (a caller's rows are checked before a StandaloneStep loads them)
    check_request_rows(req, inp.req_to_token.shape[0], stand_in=inp.static)
    if inp.seq_lens[:inp.raw_bs].tolist() != seqs:
        raise LayoutError("seq_lens and seq_lens_cpu disagree")
    pos = torch.arange(inp.max_context_len, device=req.device)
    used = pos[None, :] < inp.seq_lens[:inp.raw_bs, None]
    slots = inp.req_to_token[req.long()]
    bad = ((slots < 0) | (slots >= inp.num_slots)) & used
    if bool(bad.any()):
        i, t = (int(x) for x in bad.nonzero()[0])
        raise LayoutError(f"req_to_token: request {i} (row {int(req[i])}), position {t}: slot "
                          f"{int(slots[i, t])} outside the pool 0..{inp.num_slots - 1}")
