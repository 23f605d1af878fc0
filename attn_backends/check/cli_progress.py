"""Progress of a suite run: cases done and time left.

On a terminal, a ``tqdm`` bar; elsewhere (CI logs, ``| tee``, a file) one plain line every
``every`` seconds, and one when the suite ends, so that a long run shows life without
filling a log with carriage returns.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Optional, TextIO

BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} cases [{elapsed} elapsed, {remaining} left]"


def duration(seconds: float) -> str:
    """``7s``, ``6m05s``, ``1h02m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _columns(stream: TextIO, most: int = 100) -> int:
    """The terminal's width, at most ``most``; ``most`` where the terminal reports none (a
    pseudo-terminal without a size reports 0 columns, and tqdm would draw nothing)."""
    try:
        cols = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        cols = 0
    return min(cols, most) if cols > 0 else most


class TerminalBar:
    """A ``progress(done, total)`` callback drawing a tqdm bar on ``stream``."""

    def __init__(self, label: str, stream: TextIO) -> None:
        self.label, self.stream, self.bar = label, stream, None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm  # here: `list` and `--help` need no tqdm
            self.bar = tqdm(total=total, desc=self.label, unit="case", file=self.stream,
                            bar_format=BAR_FORMAT, ncols=_columns(self.stream))
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class PeriodicLines:
    """A ``progress(done, total)`` callback printing a plain line every ``every`` seconds."""

    def __init__(self, label: str, stream: TextIO, every: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.stream, self.every, self.clock = label, stream, every, clock
        self.start = self.last = clock()

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        spent = now - self.start
        if done >= total:
            self._line(f"{done}/{total} cases in {duration(spent)}")
        elif now - self.last >= self.every:
            left = spent / done * (total - done) if done else float("nan")
            eta = f"about {duration(left)} left" if done else "time left not known yet"
            self._line(f"{done}/{total} cases ({100 * done // max(total, 1)}%), {duration(spent)} elapsed, {eta}")
            self.last = now

    def _line(self, text: str) -> None:
        print(f"{self.label}: {text}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


def progress_for(label: str, stream: TextIO, every: float) -> Optional[object]:
    """A bar on a terminal, periodic lines elsewhere (``every`` > 0), else None."""
    if stream.isatty():
        return TerminalBar(label, stream)
    return PeriodicLines(label, stream, every) if every > 0 else None
