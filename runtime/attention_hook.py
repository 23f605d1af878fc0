"""The one call site of attention in the models, and the hook a breakable capture uses.

A model calls :func:`attention_call`; normally that is ``backend.forward``. While a
:class:`Splitter` is active (a breakable capture), the call is handed to it so it can close
the current graph segment, run attention eagerly and open the next segment.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Protocol


class Splitter(Protocol):
    def on_attention(self, backend, q, k, v, layer, batch): ...


_active: Optional[Splitter] = None


def attention_call(backend, q, k, v, layer, batch):
    if _active is not None:
        return _active.on_attention(backend, q, k, v, layer, batch)
    return backend.forward(q, k, v, layer, batch)


@contextlib.contextmanager
def splitting(splitter: Splitter):
    """Route attention calls to ``splitter``; refuses nesting."""
    global _active
    if _active is not None:
        raise RuntimeError("a breakable capture is already active; captures do not nest")
    _active = splitter
    try:
        yield splitter
    finally:
        _active = None
