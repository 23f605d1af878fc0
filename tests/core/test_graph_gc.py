"""The collector kept out of CUDA graph captures (``attn_backends.graph_gc``): a dead reference cycle that holds a
CUDA graph, collected inside a capture, destroys it there, which CUDA refuses during a capture (the capture fails)."""
import gc
import weakref

import pytest
import torch

from attn_backends.graph_gc import collector_off


class _Cycle:
    def __init__(self, held=None) -> None:
        self.me, self.held = self, held


@pytest.mark.parametrize("enabled", [True, False])
def test_no_collection_inside_the_block_and_the_collector_as_it_was_after(enabled):
    """Inside the block the collector is off: a dead cycle made there survives the block's allocations with the
    collector set to run at every one; after the block the collector is as it was, also when the block raised, and
    a collection frees the cycle."""
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    gone = []
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)                # where the collector runs, it runs at every allocation
    try:
        with pytest.raises(RuntimeError), collector_off():
            assert not gc.isenabled()
            weakref.finalize(_Cycle(), gone.append, "inside")
            junk = [[i] for i in range(1000)]
            assert gone == [] and junk
            raise RuntimeError("a failed capture")
        assert gc.isenabled() == enabled
        gc.collect()
        assert gone == ["inside"]
    finally:
        gc.set_threshold(*old)
        (gc.enable if was else gc.disable)()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("via", ["runner", "segments", "step"])
def test_a_dead_graph_collected_during_a_capture_does_not_fail_it(via):
    """The captured call drops the last reference to a cycle that holds an earlier CUDA graph, then allocates,
    with the collector set to run at every allocation: without ``collector_off`` the cycle (and its graph) is
    destroyed inside the capture. Through the runner's ``CudaGraph``, ``SegmentedCudaGraph`` and the
    step's ``_capture``: the capture succeeds and replays."""
    from attn_backends.step.step import _capture
    from attn_backends_runtime.graphs import CudaGraph, SegmentedCudaGraph

    x = torch.zeros(8, device="cuda")
    earlier = []

    def make_graph():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            x.add_(1)
        earlier.append(g)

    make_graph()
    make_graph()                              # one for the warm-up call, one for the captured call
    out = torch.empty(8, device="cuda")

    def fn():
        _Cycle(earlier.pop())                 # dead at once: only the collector frees it, and its graph
        junk = [[i] for i in range(1000)]
        out.copy_(x * 2 + len(junk))
        return out

    old = gc.get_threshold()
    gc.freeze()                               # no long-lived objects: a full collection is never put off
    gc.set_threshold(1, 1, 1)
    try:
        if via == "step":
            graph = _capture(fn, None)
        else:
            graph = (CudaGraph if via == "runner" else SegmentedCudaGraph)(None)
            graph.capture(fn)
        out.zero_()                           # the warm-up wrote what the replay must write
        graph.replay()
        torch.cuda.synchronize()
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()
        gc.collect()                          # the dead cycles and their graphs, outside any capture
    assert torch.equal(out, x * 2 + 1000)
