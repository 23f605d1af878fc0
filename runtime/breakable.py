"""Breakable runner: one capture of the whole forward that breaks at each attention call.

The graph segments between attention calls are replayed in order and attention runs eagerly
between them (what a backend that cannot be captured needs, and what a user debugging a layer
wants). Metadata, guards, padding and slicing are those of the full-graph runner: attention
reads the step's layout, built once per step for every layer."""
from __future__ import annotations

from attn_backends import ForwardMode

from .full_graph import UniformGraphRunner


class BreakableGraphRunner(UniformGraphRunner):
    modes = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
    segmented = True
