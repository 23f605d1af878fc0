"""Recorded launches (``kernels/launch_record.py``), with a stand-in kernel that logs its launches:
what a replay substitutes, what it refuses and when a recording is unusable. The real kernels'
replays are checked against the float64 reference in tests/test_triton_backends.py (CUDA)."""
import inspect

import pytest
import torch

from attn_backends_kernels import launch_record
from attn_backends_kernels.launch_record import Recorded, launch, recording


class _Compiled:
    """A CompiledKernel's launch surface: ``run`` as Triton's runner calls it (three grid
    dimensions, stream, function, metadata, launch metadata, two hooks, then every argument)."""
    packed_metadata, function = object(), object()

    def __init__(self) -> None:
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, stream=None: self.run(grid[0], grid[1], grid[2], stream, self.function,
                                                   self.packed_metadata, None, None, None, *args)

    def run(self, g0, g1, g2, stream, function, meta, launch_meta, enter, exit_, *args):
        assert stream == 7 and function is self.function and meta is self.packed_metadata
        self.calls.append(((g0, g1, g2), args))


@pytest.fixture(autouse=True)
def _stream(monkeypatch):
    monkeypatch.setattr(launch_record, "_stream", lambda: 7)


class _Kernel:
    """``kernel[grid](*args, **kw)`` as a JITFunction takes it; returns ``compiled``."""

    def __init__(self, fn, compiled=True) -> None:
        self.signature, self.__name__ = inspect.signature(fn), fn.__name__
        self.compiled = _Compiled() if compiled else None
        self.direct = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.direct += 1
            return self.compiled
        return run


def _attn(q_ptr, kv_ptr, table_ptr, out_ptr, n, scale, BLOCK=16, MASK=0):
    pass


def _wrapper(kernel, q, kv, out, table, view_q=False):
    """A kernel wrapper: one launch with a step tensor (``table``), ints and constexprs."""
    launch(kernel, (q.shape[0], 2), q[1:] if view_q else q, kv, table, out, q.stride(0), 0.5, MASK=1, num_warps=4)


def _tensors(seed, dtype=torch.float32, rows=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g, dtype=dtype), torch.randn(32, 8, generator=g, dtype=dtype), \
        torch.empty(rows, 8, dtype=dtype)


def _record(kernel, inputs, table, **kw):
    with recording() as launches:
        _wrapper(kernel, *inputs, table, **kw)
    return Recorded(launches, inputs)


def test_replay_substitutes_the_calls_tensors_and_keeps_the_rest():
    k, table = _Kernel(_attn), torch.arange(6, dtype=torch.int32)
    first = _tensors(0)
    rec = _record(k, first, table)
    assert rec.usable and k.direct == 1
    second = _tensors(1)
    assert rec.replay(second) and rec.replays == 1 and k.direct == 1        # no second wrapper launch
    grid, args = k.compiled.calls[-1]
    assert grid == (4, 2, 1)                                             # the launcher takes three
    assert args[0] is second[0] and args[1] is second[1] and args[3] is second[2]
    assert args[2] is table and args[4:] == (8, 0.5, 16, 1), args[4:]        # ints, float, constexprs (default too)
    assert all(a is None for a in (rec.calls[0][2][i] for i in (0, 1, 3))), "the record holds a call's tensor"


@pytest.mark.parametrize("change", ["dtype", "shape", "stride", "alignment", "count"])
def test_replay_refuses_tensors_the_kernel_was_not_specialized_for(change):
    k = _Kernel(_attn)
    rec = _record(k, _tensors(0), torch.arange(6, dtype=torch.int32))
    q, kv, out = _tensors(1)
    if change == "dtype":
        q = q.double()
    elif change == "shape":
        q, out = torch.randn(5, 8), torch.empty(5, 8)
    elif change == "stride":
        q = torch.randn(4, 9)[:, :8]
    elif change == "alignment":
        q = torch.randn(33)[1:].view(4, 8)                                    # 4 bytes past a 16-byte boundary
    inputs = (q, kv) if change == "count" else (q, kv, out)
    assert not rec.replay(inputs) and rec.replays == 0 and not k.compiled.calls


def test_a_view_of_a_calls_tensor_or_no_compiled_kernel_makes_the_recording_unusable():
    table = torch.arange(6, dtype=torch.int32)
    rec = _record(_Kernel(_attn), _tensors(0), table, view_q=True)     # the wrapper launched a view of q
    assert not rec.usable and not rec.replay(_tensors(0))
    rec = _record(_Kernel(_attn, compiled=False), _tensors(0), table)  # the interpreter compiles nothing
    assert not rec.usable and not rec.replay(_tensors(0))


def test_launches_outside_a_recording_are_not_kept_and_recordings_nest():
    k, table = _Kernel(_attn), torch.arange(6, dtype=torch.int32)
    _wrapper(k, *_tensors(0), table)
    with recording() as outer:
        with recording() as inner:
            _wrapper(k, *_tensors(0), table)
        _wrapper(k, *_tensors(1), table)
    assert len(inner) == 1 and len(outer) == 1 and k.direct == 3


def test_a_launch_hook_gets_triton_s_own_runner(monkeypatch):
    """With a profiler's launch hook set, a replay launches through Triton's runner (which
    calls the hooks with their launch metadata) on the current stream."""
    k, table = _Kernel(_attn), torch.arange(6, dtype=torch.int32)
    rec = _record(k, _tensors(0), table)
    via = []
    monkeypatch.setattr(_Compiled, "__getitem__", lambda self, grid: lambda *a, stream=None: via.append(stream))
    monkeypatch.setattr(launch_record.knobs.runtime, "launch_enter_hook", lambda meta: None)
    assert rec.replay(_tensors(1)) and via == [7] and not k.compiled.calls
