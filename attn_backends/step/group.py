"""The steps of a multi-step draft: one step per draft forward, loaded together."""
from __future__ import annotations

from ..batch import GraphKey
from ..validation import LayoutError
from .buffers import RowCopies
from .step import Step


class StepGroup:
    """``num_steps`` steps over one KV memory (draft step ``s`` reads ``steps[s]``), whose real rows
    are written in one ``_foreach_copy_`` launch where the sources allow (contiguous rows)."""

    def __init__(self, memory, fill: int, num_steps: int, **kw) -> None:
        self.steps = [Step(memory, fill, **kw) for _ in range(num_steps)]

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):
        return iter(self.steps)

    def __getitem__(self, s: int) -> Step:
        return self.steps[s]

    def load_rows(self, key: GraphKey, raw_bs: int, req_pool_indices, seq_lens, seq_np, tokens) -> None:
        """:meth:`Step.load_rows` of every step (``steps[s]`` gets row ``s`` of ``seq_lens`` /
        ``seq_np`` and ``tokens[s]``) in one launch: every step is checked before anything is written."""
        steps = self.steps
        if not len(steps) == len(seq_lens) == len(seq_np) == len(tokens):
            raise LayoutError(f"{len(steps)} steps: seq_lens, host, token rows "
                              f"{len(seq_lens), len(seq_np), len(tokens)}")
        checked = [p.checked_rows(key, raw_bs, seq_np[s][:raw_bs]) for s, p in enumerate(steps)]
        dst, src, rest = [], [], []
        for p, (_, step), seq, tok in zip(steps, checked, seq_lens, tokens):
            d, s_, r = p.row_copies(key, raw_bs, req_pool_indices, seq, step, tok)
            dst, src, rest = dst + d, src + s_, rest + r
        RowCopies.launch(dst, src, rest)
        for p, (seq, step) in zip(steps, checked):
            p.rows_written(key, raw_bs, seq, step)
