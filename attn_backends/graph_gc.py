"""Python's cyclic garbage collector kept out of CUDA graph captures.

An unreachable reference cycle that holds a CUDA graph (or an event, a stream, memory freed outside torch's
allocator) is destroyed whenever the collector next runs; run inside a capture, that destruction is a CUDA call
the capture does not permit, and the capture fails ("operation not permitted when stream is capturing", then
"operation failed due to a previous error during capture"). torch no longer collects on entering
``torch.cuda.graph`` (``torch.compiler.config.force_cudagraph_gc``); seen in the sweep after FlashInfer's rows
(bench/RESULTS.md, 'Ragged batches', session 65)."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collected_before_capture():
    """Collect, then keep the collector off until the block ends (as it was after): the dead cycles of
    earlier steps go before the capture begins, none during it."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
