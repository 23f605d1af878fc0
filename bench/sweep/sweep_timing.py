"""How the sweep times one call (medians over a few dozen calls, L2 flushed before each).

* ``gpu_us(fn)``: CUDA events around each call, a 256 MiB memset (the L2 flush) queued
  before it, calls back to back: GPU time only, the host launch hides behind the flush
  (``triton.testing.do_bench``'s method). Used for graph replay (``graph.replay``) and,
  as ``eager_gpu_us``, for the eager call.
* ``eager_us(fn)``: the L2 flushed and the device drained (synchronize) before each call,
  then events around it: the latency of one eager call from an idle GPU, host launch
  included (what a runner that launches attention outside its graphs waits for).
* ``host_us(fn)``: ``perf_counter`` around each of ``HOST_ITERS + 1`` calls made back to back
  while the device runs the ones before (drained once before them), the median of all but the
  first (made from an idle GPU): the host cost of one call as a runner launching layer after
  layer pays it (``HOST_TIMING``). Not drained before each call: after a long kernel a drained
  call's host time grows by a varying amount, back to back it is steady (bench/RESULTS.md,
  'Timing noise').
* ``interleaved_us(makers, timer)``: ``timer`` (``gpu_us``, ``host_us`` or ``eager_us``) of several
  implementations of one row in rounds, each round timing every implementation in turn, each
  round starting one implementation later, and each keeps its least round: the lent machines
  have slow spells of seconds, and implementations timed one after the other could each land in
  a different one (bench/RESULTS.md, 'Timing noise').
* ``settle(makers, seconds)``: before the graph rounds of a row whose calls draw the card to its
  power cap (``settle_seconds``: intensity at least half the ridge; on an H100, ridge about 263,
  the MLA-128 rows; on a card of more bandwidth per flop, such as an H200, the MLA-16 verify rows
  too), every implementation's replay in turn (each after the L2 flush) for ``SETTLE_S``, so that
  the rounds start under the same load: unsettled, they began at whatever clock the work before
  them left (bench/RESULTS.md, 'Power-bound rows').

On the CPU (``--smoke``) every time is one ``perf_counter`` span.
"""
from __future__ import annotations

import statistics
import time

import torch

from attn_backends.graph_gc import collector_off

TARGET_US = 20_000        # per timing: about this much device time, within the bounds below
MIN_ITERS, MAX_ITERS = 8, 30
HOST_ITERS = 25           # calls a host median takes (26 made: a few launches each, far below the launch queue's depth)
HOST_TIMING = "queued"    # the host method (``sweep_report.HOST``): calls back to back, see ``host_us``
ROUNDS_TIMING = "settled"  # interleaved rounds, power-capped rows settled first (``sweep_report.TIMING``)
HOST_ROUNDS = 3
SETTLE_S = 1.0            # back-to-back replays before a power-capped row's graph rounds


def settle_seconds(intensity, ridge) -> float:
    """``SETTLE_S`` for a row of at least half the card's ridge intensity (flop/byte; on an H100
    the MLA-128 decode and verify rows), else 0 (either unknown: 0)."""
    return SETTLE_S if intensity and ridge and intensity >= ridge / 2 else 0.0


class Clock:
    def __init__(self, device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if self.cuda else None
        self.settled: dict = {}           # {name: seconds} of the latest ``interleaved_us``' settling

    def flush(self) -> None:
        """The L2 flush queued before each timed call."""
        self._flush.zero_()

    def _iters(self, fn) -> int:
        """Two warm-up calls; the second, synchronized, sizes the number of timed calls."""
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        est = (time.perf_counter() - t0) * 1e6
        return int(min(MAX_ITERS, max(MIN_ITERS, TARGET_US // max(est, 1.0))))

    def _cpu_us(self, fn) -> float:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    def gpu_us(self, fn) -> float:
        """Median GPU time of back-to-back calls (L2 flushed before each)."""
        return self._events_us(fn, drain=False)

    def eager_us(self, fn) -> float:
        """Median time of one call from an idle GPU (host launch included)."""
        return self._events_us(fn, drain=True)

    def _events_us(self, fn, drain: bool) -> float:
        if not self.cuda:
            return self._cpu_us(fn)
        n = self._iters(fn)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
        for start, end in ev:
            self._flush.zero_()
            if drain:
                torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in ev)

    def host_us(self, fn) -> float:
        """Median host time of one call among ``HOST_ITERS`` made back to back, the device busy
        with the ones before it (``HOST_TIMING``); the first, from a drained device, left out."""
        if not self.cuda:
            return self._cpu_us(fn)
        fn()
        torch.cuda.synchronize()
        spans = []
        for _ in range(HOST_ITERS + 1):
            t0 = time.perf_counter()
            fn()
            spans.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        return statistics.median(spans[1:])

    def settle(self, makers: dict, seconds: float) -> dict:
        """Every ``makers[name]()`` call in turn (L2 flushed before each), passes until ``seconds``
        have gone, the device drained after each pass; ``{name: seconds it took part}`` (the
        whole span for those that never failed). A call that raises is left out, its error
        recorded by the rounds that follow; a fault raised by the drain ends the settling (the
        rounds then time, and tie to its implementation, whatever fails)."""
        start, calls, ran = time.perf_counter(), {}, {}
        for name, make in makers.items():
            try:
                calls[name] = make()
            except Exception:  # noqa: BLE001 - recorded by the rounds that follow
                ran[name] = 0.0
        while calls and time.perf_counter() < start + seconds:
            for name, call in list(calls.items()):
                try:
                    if self.cuda:
                        self._flush.zero_()
                    call()
                except Exception:  # noqa: BLE001 - recorded by the rounds that follow
                    del calls[name]
                    ran[name] = time.perf_counter() - start
            try:
                if self.cuda:
                    torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - an asynchronous fault: the rounds tie it to its call
                break
        return {name: ran.get(name, time.perf_counter() - start) for name in makers}

    def interleaved_us(self, makers: dict, timer, rounds: int = HOST_ROUNDS, settle_s: float = 0.0) -> tuple:
        """``({name: [timer(call) of each round]}, {name: error})``; ``makers[name]()`` gives the
        call to time, made anew each round (a FlashInfer wrapper planned again: the wrappers share
        one workspace). Round r starts at the r-th implementation (then in order, wrapping), so
        that none is always timed first, after ``settle_s`` seconds of ``settle`` (what each took
        part in it: ``self.settled``). An implementation that raises is timed no further; the
        others go on."""
        out, errors, names = {name: [] for name in makers}, {}, list(makers)
        self.settled = self.settle(makers, settle_s) if settle_s > 0 else {}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                make = makers[name]
                if name in errors:
                    continue
                try:
                    out[name].append(timer(make()))
                except Exception as e:  # recorded with the implementation's row, never hidden
                    errors[name] = f"{type(e).__name__}: {e}"[:300]
        return out, errors

    def copy_gbs(self, nbytes: int = 1 << 30) -> float:
        """Device-to-device copy of 1 GiB, read + write bytes per second (GB/s)."""
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device).random_(0, 255)
        dst = torch.empty_like(src)
        us = self.gpu_us(lambda: dst.copy_(src))
        return 2 * nbytes / us / 1e3

    def matmul_tflops(self, n: int = 8192) -> float:
        """bf16 ``[n, n] @ [n, n]``: the dense tensor-core rate this card reaches."""
        a = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        c = torch.empty_like(a)
        us = self.gpu_us(lambda: torch.mm(a, b, out=c))
        return 2 * n ** 3 / us / 1e6


def capture(fn, warmup: bool = True) -> tuple:
    """``fn`` captured in a CUDA graph (after one warm-up call on a side stream, so that
    lazy initialisation happens outside the capture): ``(graph, output of the capture)``."""
    if warmup:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with collector_off(), torch.cuda.graph(g):
        out = fn()
    return g, out
