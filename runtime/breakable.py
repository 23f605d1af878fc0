"""Breakable runner: one capture of the whole forward that breaks at each attention call.

The graph segments between attention calls are replayed in order; attention runs eagerly
between them with eager metadata of the padded batch, so any backend works, graph-capable
or not. Guards, padding and slicing are those of the full-graph runner."""
from __future__ import annotations

from attn_backends import ForwardMode

from .full_graph import UniformGraphRunner


class BreakableGraphRunner(UniformGraphRunner):
    modes = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
    segmented = True

    def _capture_metadata(self, backend, static_batch) -> None:
        backend.init_forward_metadata(static_batch)      # I13: the capture batch is validated too

    def _prepare_replay(self, static_batch) -> None:
        for b in self.backends:                          # I12: every backend refreshed
            b.init_forward_metadata(static_batch)
