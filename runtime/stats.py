"""What an engine run measured: tokens, time, accept lengths and graph replays vs eager
fallbacks per model and mode."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    tokens: int = 0                 # emitted tokens, all steps
    decode_tokens: int = 0          # emitted by decode / speculative steps
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    accept_hist: Counter = field(default_factory=Counter)   # accept_len -> request-rounds

    @property
    def rounds(self) -> int:
        return sum(self.accept_hist.values())

    @property
    def mean_accept(self) -> float:
        return sum(a * n for a, n in self.accept_hist.items()) / self.rounds if self.rounds else 0.0

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    def tokens_per_second(self, decode_only: bool = False) -> float:
        tok, sec = (self.decode_tokens, self.decode_seconds) if decode_only else (self.tokens, self.seconds)
        return tok / sec if sec > 0 else 0.0

    def summary(self, executors: list, num_draft_tokens: int = 0) -> str:
        lines = [f"tokens: {self.tokens} in {self.seconds:.2f} s ({self.tokens_per_second():.1f} tok/s; "
                 f"decode {self.decode_tokens} in {self.decode_seconds:.2f} s, "
                 f"{self.tokens_per_second(decode_only=True):.1f} tok/s)"]
        if num_draft_tokens:
            hist = " ".join(f"{a}:{self.accept_hist.get(a, 0)}" for a in range(1, num_draft_tokens + 1))
            lines.append(f"accept length: mean {self.mean_accept:.2f} over {self.rounds} request-rounds "
                         f"(histogram {hist})")
        lines.append("graph replays / eager fallbacks per mode:")
        for ex in executors:
            for mode, c in sorted(ex.counts.items()):
                lines.append(f"  {ex.name + ' ' + mode:20s} {c['graph']:6d} / {c['eager']}")
        return "\n".join(lines)
