"""Python's cyclic garbage collector kept out of CUDA graph captures.

An unreachable reference cycle that holds a CUDA graph (or any object whose finalizer makes a CUDA call) is
destroyed whenever the collector next runs; run inside a capture, that destruction is a CUDA call the capture does
not permit, and the capture fails ("operation not permitted when stream is capturing", then "operation failed due
to a previous error during capture"; pytorch/pytorch#161037). torch no longer collects on entering
``torch.cuda.graph`` since 2.9 (``torch.compiler.config.force_cudagraph_gc``); seen, likely so, in the sweep
after FlashInfer's rows (bench/RESULTS.md, 'Ragged batches', session 65)."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_off():
    """The collector off until the block ends, then as it was (also where the block raised): dead cycles wait for
    its next run after the capture. Not a collection first: a full one costs about 0.1 s on this package's heap,
    and the suites capture hundreds of graphs."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
