"""Recorded launches (``kernels/launch_record.py``), with a stand-in kernel that logs its launches:
what a replay substitutes, what it refuses and when a recording is unusable. The real kernels'
replays are checked against the float64 reference in tests/backends/test_triton_backends.py (CUDA)."""
import gc
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
    monkeypatch.setattr(launch_record, "_stream", lambda: (0, 7))


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


def test_kept_inputs_are_checked_once_per_tensor_and_derived_ones_not_at_all():
    """The backend's recording: KV buffers (kept) checked the first time each tensor object comes
    at its position, then by identity; the output (derived) never; q on every replay."""
    k, table = _Kernel(_attn), torch.arange(6, dtype=torch.int32)
    q, kv, out = _tensors(0)
    with recording() as launches:
        _wrapper(k, q, kv, out, table)
    rec = Recorded(launches, (q, kv, out), kept=(1,), derived=(2,))
    q2, kv2, out2 = _tensors(1)
    assert rec.replay((q2, kv2, out2)) and rec.kept[1][id(kv2)] is kv2      # a new KV buffer: checked, kept
    assert not rec.replay((q2, kv2.double(), out2)), "a KV buffer of another dtype was replayed"
    assert not rec.replay((q2.double(), kv2, out2)), "q is checked on every replay"
    assert rec.replay((q2, kv2, torch.empty(9, 3))), "the output's facts are the caller's to derive"
    assert not rec.replay((q2, kv2, torch.empty(33)[1:])), "a misaligned output was replayed"
    assert rec.replays == 2
    kv3 = kv2.clone()
    assert rec.replay((q2, kv3, out2))
    key = id(kv3)
    k.compiled.calls.clear()                          # the stand-in kernel's log of its arguments
    del kv3
    gc.collect()
    assert key not in rec.kept[1], "the recording keeps a KV buffer alive"


def test_a_view_of_a_calls_tensor_or_no_compiled_kernel_makes_the_recording_unusable():
    table = torch.arange(6, dtype=torch.int32)
    rec = _record(_Kernel(_attn), _tensors(0), table, view_q=True)     # the wrapper launched a view of q
    assert not rec.usable and not rec.replay(_tensors(0))
    rec = _record(_Kernel(_attn, compiled=False), _tensors(0), table)  # the interpreter compiles nothing
    assert not rec.usable and not rec.replay(_tensors(0))


def test_launches_outside_a_recording_are_not_kept_and_recordings_nest():
    """An inner recording's launches belong to the outer one too (a backend whose recorded call
    records another's would otherwise replay without them)."""
    k, table = _Kernel(_attn), torch.arange(6, dtype=torch.int32)
    _wrapper(k, *_tensors(0), table)
    with recording() as outer:
        with recording() as inner:
            _wrapper(k, *_tensors(0), table)
        _wrapper(k, *_tensors(1), table)
    assert len(inner) == 1 and len(outer) == 2 and k.direct == 3


def test_another_stream_or_device_one_tensor_in_two_roles_and_compile_options(monkeypatch):
    """A replay on another stream or device is refused (the wrapper's workspace belongs to the
    recording's stream); a recording where one tensor is two inputs is unusable (its positions
    would alias on replay); keywords that name no parameter are compile options, not arguments."""
    k, table = _Kernel(_attn), torch.arange(6, dtype=torch.int32)
    rec = _record(k, _tensors(0), table)
    for where in ((0, 8), (1, 7)):
        monkeypatch.setattr(launch_record, "_stream", lambda w=where: w)
        assert not rec.replay(_tensors(1))
    monkeypatch.setattr(launch_record, "_stream", lambda: (0, 7))
    assert rec.replay(_tensors(1))
    q, kv, out = _tensors(0)
    with recording() as launches:
        launch(k, (4,), q, q, table, out, 8, 0.5, debug=True, num_stages=2)
    assert not Recorded(launches, (q, q, out)).usable
    assert Recorded(launches, (q, out)).calls[0][2][4:] == [8, 0.5, 16, 0]


def test_a_launch_hook_gets_triton_s_own_runner(monkeypatch):
    """With a profiler's launch hook set, a replay launches through Triton's runner (which
    calls the hooks with their launch metadata) on the current stream."""
    k, table = _Kernel(_attn), torch.arange(6, dtype=torch.int32)
    rec = _record(k, _tensors(0), table)
    via = []
    monkeypatch.setattr(_Compiled, "__getitem__", lambda self, grid: lambda *a, stream=None: via.append(stream))
    monkeypatch.setattr(launch_record.knobs.runtime, "launch_enter_hook", lambda meta: None)
    assert rec.replay(_tensors(1)) and via == [7] and not k.compiled.calls


class _Runner:
    """Triton's CudaLauncher surface: ``launch`` (the C function its ``__call__`` ends in) and the
    facts that call adds (scratch sizes, cooperative grid, programmatic dependent launch)."""

    def __init__(self, scratch: int) -> None:
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.direct, self.via_call = [], []

    def launch(self, *args):
        self.direct.append(args)

    def __call__(self, *args):
        self.via_call.append(args)


@pytest.mark.parametrize("scratch", [0, 64])
def test_replay_calls_the_c_launch_directly_unless_the_runner_adds_scratch(scratch):
    """Without scratch memory a replay calls the C launch with what Triton's runner would pass it
    (grid, stream, function, cooperative and PDL flags, no scratch, metadata, no hooks, the
    arguments); with scratch it goes through the runner, which allocates it."""
    k, table = _Kernel(_attn), torch.arange(6, dtype=torch.int32)
    k.compiled.run = runner = _Runner(scratch)
    rec = _record(k, _tensors(0), table)
    second = _tensors(1)
    assert rec.replay(second)
    c = k.compiled
    if scratch:
        assert not runner.direct and len(runner.via_call) == 1
        assert runner.via_call[0][:9] == (4, 2, 1, 7, c.function, c.packed_metadata, None, None, None)
        return
    assert not runner.via_call and len(runner.direct) == 1
    args = runner.direct[0]
    assert args[:13] == (4, 2, 1, 7, c.function, False, True, None, None, c.packed_metadata, None, None, None)
    assert args[13:17] == (second[0].data_ptr(), second[1].data_ptr(), table.data_ptr(), second[2].data_ptr()), \
        "the C launch takes each tensor as its address"
    assert args[17:] == (8, 0.5, 16, 1)


def test_the_direct_launch_passes_what_triton_s_runner_passes():
    """Triton's own ``CudaLauncher.__call__`` (its C launch recorded, no module compiled) and the
    replay's direct call hand the C launch the same arguments, the replay each tensor as its
    address (the C launch reads an int as the address, and asks the driver about a tensor's)."""
    from triton.backends.nvidia.driver import CudaLauncher

    class _Real(CudaLauncher):
        def __init__(self) -> None:                    # no compiled module: launch records its arguments
            self.num_ctas, self.global_scratch_size, self.profile_scratch_size = 1, 0, 0
            self.global_scratch_align = self.profile_scratch_align = 1
            self.launch_cooperative_grid, self.launch_pdl, self.seen = False, True, []
            self.launch = lambda *a: self.seen.append(a)

    k, table = _Kernel(_attn), torch.arange(6, dtype=torch.int32)
    k.compiled.run = runner = _Real()
    rec = _record(k, _tensors(0), table)
    second = _tensors(1)
    c = k.compiled
    runner(4, 2, 1, 7, c.function, c.packed_metadata, None, None, None,
           second[0], second[1], table, second[2], 8, 0.5, 16, 1)     # what Triton's launch path passes
    assert rec.replay(second) and len(runner.seen) == 2
    assert tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in runner.seen[0]) == runner.seen[1]
    assert not any(isinstance(a, torch.Tensor) for a in runner.seen[1])


def test_a_launch_hook_takes_triton_s_runner_over_the_direct_launch(monkeypatch):
    k, table = _Kernel(_attn), torch.arange(6, dtype=torch.int32)
    k.compiled.run = runner = _Runner(0)
    rec = _record(k, _tensors(0), table)
    via = []
    monkeypatch.setattr(_Compiled, "__getitem__", lambda self, grid: lambda *a, stream=None: via.append(stream))
    monkeypatch.setattr(launch_record.knobs.runtime, "launch_enter_hook", lambda meta: None)
    assert rec.replay(_tensors(1)) and via == [7] and not runner.direct


class _Scaled(_Kernel):
    """A stand-in attention kernel that computes: ``out = q[..., :Dv] * scale`` (direct launch
    and compiled replay alike), so that a replay's output shows which q and scale it used."""

    def __init__(self) -> None:
        super().__init__(_attn)
        self.compiled.run = lambda *a: (self.compiled.calls.append(a[9:]), self._compute(a[9:]))

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.direct += 1
            self._compute(args)
            return self.compiled
        return run

    @staticmethod
    def _compute(args) -> None:
        q, out, scale = args[0], args[3], args[5]
        out.copy_(q[..., :out.shape[-1]] * scale)


class _Rig:
    """Two ``triton`` backend instances over one CPU memory whose ``_launch`` runs the stand-in
    kernel through :func:`launch`, a padded decode batch and three q tensors."""

    def __init__(self, monkeypatch) -> None:
        from test_torch_native import named_batches

        from attn_backends import ModelConfig, get_backend
        from attn_backends.backends.triton_backend import TritonBackend
        from attn_backends.check.scenarios import make_memory, materialize

        self.k = k = _Scaled()
        monkeypatch.setenv("TRITON_INTERPRET", "1")     # CPU tensors: the backend serves them on a CUDA host too

        def _launch(self, q, kv, out, layer, meta):
            launch(k, (q.shape[0], 1), q, kv[0], meta.layout.page_table, out, q.stride(0), layer.scaling,
                   num_warps=4)

        self.launch_fn, self.cls = _launch, TritonBackend
        monkeypatch.setattr(TritonBackend, "_launch", _launch)
        self.cfg = ModelConfig(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16)
        mem = make_memory(self.cfg, num_pages=20, max_reqs=6, max_context_len=128, seed=0)
        self.be = [get_backend("triton", self.cfg, mem) for _ in range(2)]
        self.m = materialize(named_batches()["decode_padded"](), mem, self.be[0].get_cuda_graph_seq_len_fill_value())
        g = torch.Generator().manual_seed(0)
        self.qs = [torch.randn(self.m.batch.num_tokens, 4, 16, generator=g) for _ in range(3)]

    def counts(self) -> tuple:
        return self.k.direct, len(self.k.compiled.calls)


def test_the_backends_eager_step_records_once_and_replays(monkeypatch):
    """``TritonBackendBase._run`` with the stand-in kernel: one recording per step and softmax
    scale, shared by the backend instances of one step (one instance per layer); a q of other
    strides records anew; a step built again starts a new book."""
    from dataclasses import replace

    from attn_backends.step import Step, eager_step

    rig = _Rig(monkeypatch)
    be, m, qs = rig.be, rig.m, rig.qs

    def step(batch, calls):
        for b in be:
            b.init_forward_metadata(batch)
        for inst, layer, q in calls:
            out = be[inst].forward(q, None, None, layer, batch, save_kv_cache=False)
            assert torch.equal(out, q * layer.scaling), "the output of another call's q or scale"

    l0, l1 = rig.cfg.layer(0), rig.cfg.layer(1)
    kept = Step(be[0].memory, be[0].get_cuda_graph_seq_len_fill_value())   # a step kept across batches
    batch = kept.build(m.batch)
    step(batch, [(0, l0, qs[0]), (1, l1, qs[1]), (0, l0, qs[2])])
    assert rig.counts() == (1, 2), "one recording, then replays in both instances"
    strided = torch.randn(m.batch.num_tokens, 5, 16)[:, :4]
    step(batch, [(1, l1, strided), (0, replace(l0, scaling=0.5), qs[0]), (0, l0, qs[1])])
    assert rig.counts() == (4, 2), "other strides and another scale record anew"
    step(kept.build(m.batch), [(0, l0, qs[1]), (1, l1, qs[2])])           # the step built again
    assert rig.counts() == (5, 3), "a step built again replayed the old layout's launches"
    step(eager_step(m.batch, be), [(0, l0, qs[1]), (1, l1, qs[2])])       # a new step
    assert rig.counts() == (6, 4), "a new step must record anew"


def test_graph_metadata_records_once_per_key_outside_a_capture(monkeypatch):
    """Graph metadata launches directly inside a capture; outside one (the breakable runner's
    attention) it records once per key and every later call and step replays; a failed first call
    leaves no book in the metadata."""
    import attn_backends.backends.triton_common as tc

    rig = _Rig(monkeypatch)
    b, m, qs, l0 = rig.be[0], rig.m, rig.qs, rig.cfg.layer(0)
    b.init_cuda_graph_state(8, 8)
    b.init_forward_metadata_capture_cuda_graph(m.batch.graph_inputs())
    monkeypatch.setattr(tc, "stream_capturing", lambda: True)
    b.forward(qs[0], None, None, l0, m.batch, save_kv_cache=False)
    assert not b.forward_metadata.book and rig.counts() == (1, 0), "graph metadata recorded in a capture"
    monkeypatch.setattr(tc, "stream_capturing", lambda: False)       # the breakable runner's attention
    b.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())

    def _failing(self, q, kv, out, layer, meta):
        raise ValueError("a wrapper's check refused the call")

    monkeypatch.setattr(rig.cls, "_launch", _failing)
    with pytest.raises(ValueError, match="refused"):
        b.forward(qs[0], None, None, l0, m.batch, save_kv_cache=False)
    assert not b.forward_metadata.book, "a failed first call left a book in the metadata"
    monkeypatch.setattr(rig.cls, "_launch", rig.launch_fn)
    for q in qs:
        out = b.forward(q, None, None, l0, m.batch, save_kv_cache=False)
        assert torch.equal(out, q * l0.scaling)
    b.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())   # the next step's replay
    b.forward(qs[0], None, None, l0, m.batch, save_kv_cache=False)
    assert rig.counts() == (2, 3), "graph metadata outside a capture: one recording per key"


def test_pow2_is_tritons_next_power_of_2():
    """``launch_record.pow2`` (the launchers' host arithmetic) equals ``triton.next_power_of_2`` from 0 up to 2^33."""
    import triton

    from attn_backends_kernels.launch_record import pow2
    values = list(range(0, 4097)) + [2 ** e + d for e in range(12, 34) for d in (-1, 0, 1)]
    assert [pow2(n) for n in values] == [triton.next_power_of_2(n) for n in values]
    assert pow2(torch.tensor(5)) == 8


def test_cdiv_is_tritons_cdiv():
    """``launch_record.cdiv`` (the launchers' host arithmetic) equals ``triton.cdiv`` on grids' numerators and tiles."""
    import triton

    from attn_backends_kernels.launch_record import cdiv
    numerators = list(range(0, 300)) + [2 ** 31 - 1, 2 ** 31, 2 ** 33 + 5]
    pairs = [(a, b) for a in numerators for b in (1, 2, 3, 7, 16, 64, 128)]
    assert [cdiv(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]
    assert cdiv(torch.tensor(17), 16) == 2
