"""Where two outputs differ, for the numbers checks of both suites (I9n of the layout suite, I9 of
the runner suite): the request, its query row, the head and the worst element, with our value and
the reference's, and which rows and heads are off at all. A mask bug then reads from the message: a
causal off-by-one is off in every row of a request but its last, a transposed tree mask in the
rows whose ancestors differ from their descendants.

Also the layout suite's I9n check itself (:class:`NumbersCheck`).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..batch import ForwardMode
from ..config import ModelConfig
from ..registry import get_backend_class

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
MAX_LISTED = 6          # requests listed among the rows off tolerance; the rest counted


def spans_of(counts) -> list:
    """``[(first row, rows)]`` of each request from its row count (rows packed in request order)."""
    out, start = [], 0
    for c in counts:
        out.append((start, int(c)))
        start += int(c)
    return out


def batch_spans(batch) -> list:
    """The query rows of each real request of ``batch``: ragged in EXTEND, W each otherwise."""
    if batch.forward_mode == ForwardMode.EXTEND:
        return spans_of(batch.extend_seq_lens_cpu[:batch.raw_bs].tolist())
    return spans_of([batch.width] * batch.raw_bs)


def _ranges(idx: list) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, i = [], 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        out.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}")
        i = j + 1
    return ", ".join(out)


def _where_row(row: int, spans: Optional[list]) -> str:
    for i, (start, n) in enumerate(spans or []):
        if start <= row < start + n:
            return f"request {i}'s row" if n == 1 else f"request {i}, query row {row - start} of {n}"
    return f"row {row}"


def _rows_off(bad_rows: torch.Tensor, spans: Optional[list]) -> str:
    """Which rows hold an element off tolerance, per request."""
    rows = bad_rows.nonzero()[:, 0].tolist()
    parts = []
    for i, (start, n) in enumerate(spans or []):
        mine = [r - start for r in rows if start <= r < start + n]
        if mine:
            parts.append(f"request {i}" if n == 1 else f"request {i} rows {_ranges(mine)} of {n}")
    if not parts:                   # no requests named: the rows of the tensor
        return f"rows off: {_ranges(rows)} of {bad_rows.numel()}"
    more = f"; {len(parts) - MAX_LISTED} more requests" if len(parts) > MAX_LISTED else ""
    return "rows off: " + "; ".join(parts[:MAX_LISTED]) + more


def mismatch(got: torch.Tensor, want: torch.Tensor, tol: float, spans: Optional[list] = None) -> Optional[str]:
    """None when ``got`` is within ``tol`` of ``want`` relative to the largest reference value
    (``tol`` 0: bitwise); else where they differ. ``got``/``want``: ``[rows, heads, dim]`` (an
    attention output) or ``[rows, n]`` (logits, hidden states), the same shape; ``spans`` the
    ``(first row, rows)`` of each request (:func:`spans_of`); NaN counts as the worst error."""
    if not tol and torch.equal(got, want):
        return None                    # a pass reads nothing back to the host
    a, b = got.detach().double(), want.detach().double()
    diff = (a - b).abs().nan_to_num(nan=float("inf"))
    scale = float(b.abs().nan_to_num(nan=0.0).max().clamp(min=1e-6)) if b.numel() else 1.0
    err = float(diff.max()) / scale if diff.numel() else 0.0
    if tol and err <= tol:
        return None
    a, b, diff = a.cpu(), b.cpu(), diff.cpu()     # the message: a failure's only
    bad = diff > tol * scale if tol else (a != b) | a.isnan() | b.isnan()
    flat = int(diff.reshape(-1).argmax())
    pos = torch.unravel_index(torch.tensor(flat), diff.shape)
    pos = [int(p) for p in pos]
    inner = (["head", "element"] if diff.dim() == 3 else ["element"] * (diff.dim() - 1))
    place = ", ".join([_where_row(pos[0], spans)] + [f"{n} {p}" for n, p in zip(inner, pos[1:])])
    head = f"relative error {err:.3g} > {tol:g}" if tol else "not bitwise equal"
    msg = (f"{head}, worst at {place}: ours {float(a[tuple(pos)]):.6g}, reference {float(b[tuple(pos)]):.6g}; "
           f"{_rows_off(bad.reshape(bad.shape[0], -1).any(1), spans)}")
    if diff.dim() == 3:
        heads = bad.any(2).any(0).nonzero()[:, 0].tolist()
        msg += f"; heads off: {_ranges(heads)} of {diff.shape[1]}"
    return msg


class NumbersCheck:
    """I9n: a backend's output on its current metadata against the reference backend's on the
    same batch, over the real rows (KV read from the pool only: nothing is stored). On CUDA every
    batch of the case; on the CPU, where a Triton kernel runs in the interpreter (seconds a call),
    the case's first eager batch and its first replay only."""

    def __init__(self, cfg: ModelConfig, mem, seed: int, sinks: Optional[torch.Tensor] = None) -> None:
        self.cfg, self.mem = cfg, mem
        self.layer = cfg.layer(0, sinks=sinks)      # the case's window, cap and sinks
        self.last_q: Optional[torch.Tensor] = None
        self.ref = get_backend_class("torch_native")(cfg, mem)
        self.gen = torch.Generator().manual_seed(seed)
        self.once = torch.device(mem.device).type == "cpu"
        self.done: set = set()

    def due(self, what: str) -> bool:
        """Whether this case checks the numbers of ``what`` ("eager", "replayed") now."""
        due = not (self.once and what in self.done)
        self.done.add(what)
        return due

    def check(self, backend, batch, what: str) -> list:
        n = batch.num_tokens
        q = torch.randn(n, self.cfg.num_q_heads, self.cfg.qk_dim, generator=self.gen)
        q = self.last_q = q.to(self.mem.device, self.cfg.dtype)
        layer = self.layer
        try:
            got = backend.forward(q, None, None, layer, batch, save_kv_cache=False)
        except Exception as e:  # noqa: BLE001 - a crash on a valid batch is the finding
            return [f"{what} forward failed: {type(e).__name__}: {e}"]
        self.ref.init_forward_metadata(batch)
        want = self.ref.forward(q, None, None, layer, batch, save_kv_cache=False)
        if tuple(got.shape) != tuple(want.shape):
            return [f"{what} output shape {tuple(got.shape)} != the reference's {tuple(want.shape)}"]
        spans = batch_spans(batch)
        real = sum(c for _, c in spans)
        tol = TOLERANCE.get(self.cfg.dtype, 2e-2)
        msg = mismatch(got[:real], want[:real], tol, spans)
        return [f"{what} output vs torch_native on the same batch ({str(self.cfg.dtype)[6:]}, {real} real rows): "
                f"{msg}"] if msg else []
