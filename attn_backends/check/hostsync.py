"""Detect host synchronisation in capture/replay preparation (I15), on any device.

Device-side inputs are wrapped in :class:`GuardedTensor`, a tensor subclass that raises
:class:`HostSyncError` on every operation that would need the device value on the host
(``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``.cpu()``, boolean-mask indexing,
``nonzero``...). Results of operations on guarded tensors stay guarded, so a value derived
from a device input cannot be read back either. On CUDA, ``torch.cuda.set_sync_debug_mode``
("error") is switched on as well.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch


class HostSyncError(RuntimeError):
    pass


_ALWAYS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
    torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select, torch.masked_select,
    torch.Tensor.unique, torch.unique, torch.Tensor.__repr__, torch.Tensor.__format__,
    torch.Tensor.any, torch.any, torch.Tensor.all, torch.all, torch.equal,
}


def _to_host(args, kwargs) -> bool:
    """``t.to(<cpu>)`` moving a tensor that is not already on the host."""
    if args[0].device.type == "cpu":
        return False
    for a in list(args[1:]) + list(kwargs.values()):
        if isinstance(a, torch.device) and a.type == "cpu":
            return True
        if isinstance(a, str) and a.startswith("cpu"):
            return True
    return False


class GuardedTensor(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if func in _ALWAYS:
            raise HostSyncError(f"host sync in graph preparation: {name}() on a device tensor")
        if func is torch.Tensor.to and _to_host(args, kwargs):
            raise HostSyncError("host sync in graph preparation: .to('cpu') on a device tensor")
        if func is torch.Tensor.__getitem__ and len(args) > 1:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx):
                raise HostSyncError("host sync in graph preparation: boolean-mask indexing")
        if func is torch.repeat_interleave and "output_size" not in kwargs:
            raise HostSyncError("host sync in graph preparation: repeat_interleave without output_size")
        return super().__torch_function__(func, types, args, kwargs)


def guard(t):
    return t.as_subclass(GuardedTensor) if isinstance(t, torch.Tensor) else t


STEP_INPUTS = ("requests", "req_pool_indices", "seq_lens", "accept_lens", "tree_flat", "raw_bs_dev",
               "draft_step_dev", "tokens")


@contextlib.contextmanager
def no_host_sync(memory, simulate_capture: bool = False, steps=()):
    """Guard ``memory.req_to_token`` and the device inputs of the ``steps`` for the
    duration; optionally pretend a capture is on."""
    pool = memory.req_pool
    plain = pool.req_to_token
    pool.req_to_token = guard(plain)
    saved = [(p, n, getattr(p, n)) for p in steps for n in STEP_INPUTS if getattr(p, n, None) is not None]
    for p, n, t in saved:
        setattr(p, n, guard(t))
    stack = contextlib.ExitStack()
    if simulate_capture:
        stack.enter_context(mock.patch("attn_backends.layout.stream_capturing", return_value=True))
    cuda = plain.is_cuda
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with stack:
            yield
    finally:
        pool.req_to_token = plain
        for p, n, t in saved:
            setattr(p, n, t)
        if cuda:
            torch.cuda.set_sync_debug_mode("default")


def unguard_interpreted_launches() -> None:
    """For adapters of engines whose Triton kernels run under ``TRITON_INTERPRET=1``: an interpreted
    launch copies its tensor arguments to the host and back (it emulates the device on the CPU); on a
    GPU a launch reads device memory on the device and is no host sync. The I15 guard would count the
    interpreter's copies (or break its numpy conversion), so guarded arguments reach an interpreted
    kernel as plain tensors; the engine's Python around the launch stays guarded. Idempotent: every
    adapter of a process shares the one patch."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter
    cls = interpreter.InterpretedFunction
    if getattr(cls.run, "_unguarded", False):
        return
    run = cls.run

    def plain(a):
        return a.as_subclass(torch.Tensor) if isinstance(a, GuardedTensor) else a

    def unguarded_run(self, *args, **kwargs):
        return run(self, *map(plain, args), **{k: plain(v) for k, v in kwargs.items()})

    unguarded_run._unguarded = True
    cls.run = unguarded_run
