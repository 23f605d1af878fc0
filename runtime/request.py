"""A generation request and its stopping rules (max tokens, stop tokens)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class SamplingParams:
    """Greedy decoding: stop after ``max_tokens`` new tokens or on (and including) a stop token."""

    max_tokens: int = 32
    stop_tokens: tuple = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    rid: int
    prompt: list
    params: SamplingParams
    output: list = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None     # "stop", "length" or "error"
    error: Optional[str] = None
    row: Optional[int] = None               # request row in the KV memory while running
    pages: int = 0                          # pages reserved for its worst case
    accept_lens: list = field(default_factory=list)   # speculative rounds: tokens per round

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def emit(self, tokens: list) -> int:
        """Append ``tokens`` up to the first stop token or ``max_tokens``; returns how many were kept."""
        kept = 0
        for t in tokens:
            self.output.append(int(t))
            kept += 1
            if int(t) in self.params.stop_tokens:
                self.finish_reason = "stop"
            elif len(self.output) >= self.params.max_tokens:
                self.finish_reason = "length"
            if self.finished:
                break
        return kept

    def fail(self, message: str) -> None:
        self.finish_reason, self.error, self.status = "error", message, Status.FINISHED
