"""Graph primitives: a real CUDA graph, a segmented (breakable) CUDA graph, and their eager
stand-ins for machines without CUDA.

All four share one protocol: ``capture(fn)`` runs ``fn`` once and returns its outputs, which
become the static outputs; ``replay()`` refreshes those same tensors in place. The
stand-ins re-run ``fn`` and copy its result into the captured outputs, so a runner's
buffer binding, padding and slicing run the same code with or without CUDA.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from attn_backends.graph_gc import collector_off

from .attention_hook import splitting


def copy_into(dst: Any, src: Any) -> None:
    """Copy a pytree of tensors (tuple/list/dict/None) into the same-shaped pytree ``dst``."""
    if dst is None:
        return
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for a, b in zip(dst, src):
            copy_into(a, b)
    elif isinstance(dst, dict):
        for k in dst:
            copy_into(dst[k], src[k])
    else:
        raise TypeError(f"cannot copy graph output of type {type(dst).__name__}")


class EagerGraph:
    """Stand-in for a CUDA graph: replay re-runs the captured function in place."""

    def __init__(self, pool=None) -> None:
        self.fn, self.out = None, None

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        copy_into(self.out, self.fn())


class CudaGraph:
    def __init__(self, pool) -> None:
        self.pool, self.graph, self.out = pool, None, None

    def capture(self, fn: Callable[[], Any]) -> Any:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, lazy inits happen outside capture
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with collector_off(), torch.cuda.graph(self.graph, pool=self.pool):
            self.out = fn()
        return self.out

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class _AttentionBreak:
    backend: Any
    q: torch.Tensor
    k: torch.Tensor
    v: Any
    layer: Any
    batch: Any
    o: torch.Tensor


class _Segments:
    """Common part of the breakable graphs: each attention call closes a segment; at replay
    the segments run in order with attention eager (current metadata) in between."""

    def __init__(self, pool=None) -> None:
        self.pool = pool
        self.breaks: list = []
        self.out = None

    def on_attention(self, backend, q, k, v, layer, batch):
        self._end_segment()
        o = backend.forward(q, k, v, layer, batch)
        self.breaks.append(_AttentionBreak(backend, q, k, v, layer, batch, o))
        self._begin_segment()
        return o

    def run_break(self, i: int) -> None:
        b = self.breaks[i]
        b.o.copy_(b.backend.forward(b.q, b.k, b.v, b.layer, b.batch))

    def capture(self, fn: Callable[[], Any]) -> Any:
        self._prepare(fn)
        with splitting(self):
            self._begin_segment()
            self.out = fn()
            self._end_segment()
        return self.out


class SegmentedCudaGraph(_Segments):
    def __init__(self, pool) -> None:
        super().__init__(pool)
        self.graphs: list = []
        self._ctx = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        with collector_off():        # every segment's capture, and the eager attention between
            try:
                return super().capture(fn)
            except BaseException:
                self._abandon_segment()
                raise

    def _abandon_segment(self) -> None:
        """A failed capture's open segment ended (best effort: its end may raise too), so that the stream leaves
        capture mode for what runs next."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            with contextlib.suppress(Exception):
                ctx.__exit__(None, None, None)

    def _prepare(self, fn) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)

    def _begin_segment(self) -> None:
        g = torch.cuda.CUDAGraph()
        self._ctx = torch.cuda.graph(g, pool=self.pool)
        self._ctx.__enter__()
        self.graphs.append(g)

    def _end_segment(self) -> None:
        self._ctx.__exit__(None, None, None)
        self._ctx = None

    def replay(self) -> None:
        for i, g in enumerate(self.graphs):
            g.replay()
            if i < len(self.breaks):
                self.run_break(i)


class EagerSegments(_Segments):
    """Stand-in: segments are re-run eagerly; attention breaks run exactly as on CUDA."""

    def _prepare(self, fn) -> None:
        self.fn = fn

    def _begin_segment(self) -> None:
        pass

    def _end_segment(self) -> None:
        pass

    def replay(self) -> None:
        with splitting(_Replayer(self)):
            copy_into(self.out, self.fn())


class _Replayer:
    def __init__(self, segs: EagerSegments) -> None:
        self.segs, self.i = segs, 0

    def on_attention(self, backend, q, k, v, layer, batch):
        b = self.segs.breaks[self.i]
        b.q.copy_(q), b.k.copy_(k)
        if v is not None:
            b.v.copy_(v)
        self.segs.run_break(self.i)
        self.i += 1
        return b.o


def make_graph(device: torch.device, pool=None, segmented: bool = False):
    if device.type == "cuda":
        return SegmentedCudaGraph(pool) if segmented else CudaGraph(pool)
    return EagerSegments(pool) if segmented else EagerGraph(pool)
