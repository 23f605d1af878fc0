"""Our backend on one sweep row, through the backend contract only.

Eager: ``init_forward_metadata(batch)`` once, then ``forward(q, None, None, layer, batch,
save_kv_cache=False)`` per call: the work FlashInfer's ``run()`` does after one ``plan()``.
Graph: ``init_cuda_graph_state(bs, bs*W)``, ``init_forward_metadata_capture_cuda_graph``,
``forward`` captured in a CUDA graph, ``init_forward_metadata_replay_cuda_graph`` (once: the
metadata of all layers of a step, FlashInfer's ``plan()`` counterpart), then ``replay()``
per call (as tests/backends/test_cuda_graphs.py does).

``Ours(row, invariant=True)``: the same through ``triton``'s batch-invariant mode
(``BatchInvariantTritonBackend``, issue #40.5), GQA rows only (MLA has no such mode); its records
are ``INVARIANT``, never a FlashInfer configuration.
"""
from __future__ import annotations

from sweep_timing import capture

from attn_backends import get_backend

INVARIANT = "ours_invariant"      # the impl name of the batch-invariant mode's records
INVARIANT_BACKEND = "attn_backends.backends.triton_backend:BatchInvariantTritonBackend"


def has_invariant(wl) -> bool:
    """Whether the workload's backend has a batch-invariant mode (``triton``: GQA; not MLA)."""
    return wl.family == "gqa"


class Ours:
    def __init__(self, row, invariant: bool = False) -> None:
        if invariant and not has_invariant(row.wl):
            raise ValueError(f"invariant=True: workload {row.wl.name!r} is {row.wl.family}, the mode is GQA's only")
        self.row = row
        self.name = INVARIANT_BACKEND if invariant else row.wl.backend
        self.backend = get_backend(self.name, row.cfg, row.mem)
        self.backend.init_forward_metadata(row.batch)

    def layout(self) -> dict:
        """The eager layout (``forward_metadata.as_layout()``): FlashInfer's metadata is
        derived from the same page tables."""
        return self.backend.forward_metadata.as_layout()

    def eager(self):
        """The eager call, its arguments bound once as FlashInfer's ``run()`` arguments are
        (``row.layer`` builds an AttentionLayer on every read, which the bench would otherwise
        charge to ours: bench/RESULTS.md, 'Eager host time')."""
        be, q, layer, batch = self.backend, self.row.q, self.row.layer, self.row.batch
        return lambda: be.forward(q, None, None, layer, batch, save_kv_cache=False)

    def graph(self) -> tuple:
        """``(graph, static output)``: captured, then prepared for replay on the same batch."""
        r = self.row
        be = get_backend(self.name, r.cfg, r.mem)
        be.init_cuda_graph_state(r.bs, r.bs * r.wl.width)
        inputs = r.batch.graph_inputs()
        be.init_forward_metadata_capture_cuda_graph(inputs)
        layer = r.layer
        g, out = capture(lambda: be.forward(r.q, None, None, layer, r.batch, save_kv_cache=False))
        be.init_forward_metadata_replay_cuda_graph(inputs)
        self._graph_backend = be                 # keeps the static buffers the graph reads alive
        return g, out
