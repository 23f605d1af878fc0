"""Recorded launches: the Triton launches of one kernel-wrapper call, replayed with other
tensors at a fraction of the host cost (the eager path's "validate once per step").

``kernel[grid](...)`` binds and specializes every argument on every call: for an attention
kernel of some 25 arguments that is most of an eager call's host time. Within one eager step
everything a wrapper checks and computes is the same for every layer except the per-call
tensors (q, the layer's KV buffers, the output). So a backend runs the wrapper once per step
under :func:`recording`, wraps what it launched in a :class:`Recorded`, and later calls of the
step replay the compiled kernels directly with the per-call tensors substituted.

A replay is refused (:meth:`Recorded.replay` returns False: the caller runs the wrapper again)
unless every per-call tensor matches the recorded one in dtype, shape, strides, device and
16-byte alignment (with every int argument replayed as it was recorded, these are all the facts
Triton specializes a compiled kernel on) and the current stream and device are the recording's.
A recording may name long-lived inputs (``kept``: checked once per tensor object) and inputs
the caller derives from the others (``derived``: only their alignment checked); see
:class:`Recorded`.
The wrapper's own tensors (the split workspace it allocated on that stream) are reused by every
replay, in that stream's order. A recording is unusable (every replay refused) when a launch's
tensor argument is a view of a per-call tensor made inside the wrapper (it would be replayed
stale), when one tensor plays two roles (``k is v``), or under the interpreter (no compiled
kernel). Only launches made through :func:`launch` are recorded: a wrapper recorded this way
does every piece of per-call work in its kernels (no torch op on q or the output).
"""
from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch
from triton import knobs

_state = threading.local()

try:                                       # what Triton's driver itself reads the stream with
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:                        # a torch without CUDA: nothing is ever replayed there
    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


def pow2(n: int) -> int:
    """``triton.next_power_of_2`` for the launchers' host arithmetic (0 -> 0): triton's is a constexpr function,
    1.6 us a call on the host, a few of them every eager launch."""
    n = int(n)
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for the launchers' host arithmetic: triton's is a constexpr function too, 1.7 us a host call."""
    return -(-int(a) // int(b))


def _hooked(hook) -> bool:
    """Whether a launch hook is set (Triton 3.6 keeps an empty ``HookChain`` when none is)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _stream() -> tuple:
    """``(device index, stream handle)`` of the current CUDA stream (the handle is what Triton's
    launcher takes; the legacy default stream is 0 on every device, hence the index). The raw
    handle, not ``torch.cuda.current_stream()``, which builds a Stream object each call: about a
    sixth of an eager call's host time on an H200 (the call's total: bench/RESULTS.md, 'Eager host
    time')."""
    index = torch.cuda.current_device()
    return index, _raw_stream(index)


def _direct(compiled, grid: tuple, stream: int, full: list):
    """``(launch, arguments, lead)``: the compiled kernel's C launch function and the arguments of
    a call to it (the kernel's own from index ``lead``), where Triton's Python runner adds nothing
    of a call's (no scratch memory to allocate); None where it would (then replay calls the
    runner). The arguments are every one Triton's runner
    passes before the kernel's own, then the kernel's, with each tensor as its device address: the
    C launch reads an int as the address itself, where for a tensor it calls ``data_ptr()`` and asks
    the driver whether the address is a device one (``cuPointerGetAttribute``), a round trip per
    pointer on every call. The tensors are the recording's own (``full`` holds them, alive) and a
    replay passes the addresses of its per-call tensors, whose device it has checked."""
    run = compiled.run
    fn = getattr(run, "launch", None)
    if fn is None or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None
    lead = (*grid, stream, compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
            compiled.packed_metadata, None, None, None)
    return fn, [*lead, *(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in full)], len(lead)


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, recorded when a :func:`recording` is active."""
    compiled = kernel[grid](*args, **kwargs)
    book = getattr(_state, "book", None)
    if book is not None:
        book.append((kernel, compiled, tuple(grid) + (1,) * (3 - len(grid)), args, kwargs))   # the launcher takes 3
    return compiled


class recording:
    """``with recording() as launches:`` collects the launches made inside the block."""

    def __enter__(self) -> list:
        self._outer = getattr(_state, "book", None)
        _state.book = []
        return _state.book

    def __exit__(self, *exc) -> None:
        inner, _state.book = _state.book, self._outer
        if self._outer is not None:              # an outer recording replays the inner launches too
            self._outer.extend(inner)


def _facts(t: torch.Tensor) -> tuple:
    """What a compiled kernel is specialized on (and the device): :meth:`Recorded.replay` compares
    the same tuple, built inline."""
    return t.dtype, t.shape, t.stride(), t.get_device(), t.data_ptr() % 16 == 0


class Recorded:
    """The launches of one wrapper call over the per-call tensors ``inputs``, replayable.

    ``kept``: positions of inputs that are long-lived tensors (a layer's KV buffers): a replay
    checks the facts of each tensor object once at a position and then only its identity (a weak
    reference: the recording keeps no tensor alive), so a tensor whose shape or strides are
    changed in place afterwards (``resize_``, ``set_``, ``as_strided_``) would be replayed with
    its old facts. ``derived``: positions of inputs whose facts follow from the others' by the
    caller's construction (an output it allocates from q's rows, heads, dtype and device,
    contiguous): only their 16-byte alignment is checked. Every other input is checked in full
    on every replay.
    """

    def __init__(self, launches: list, inputs: tuple, kept: tuple = (), derived: tuple = ()) -> None:
        self.facts = tuple(_facts(t) for t in inputs)
        self.checked = [i for i in range(len(inputs)) if i not in kept and i not in derived]
        self.derived = tuple(derived)
        self.kept = {i: weakref.WeakValueDictionary({id(inputs[i]): inputs[i]}) for i in kept}
        self.calls: Optional[list] = []           # (compiled, grid, args, [(position, input index)], direct)
        self.replays = 0
        if not launches or len({id(t) for t in inputs}) < len(inputs):
            self.calls = None                     # one tensor in two roles (k is v): positions would alias
            return
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        for kernel, compiled, grid, args, kwargs in launches:
            if compiled is None or not hasattr(compiled, "packed_metadata"):
                self.calls = None                 # the interpreter: nothing compiled to call
                return
            full = _ordered(kernel, args, kwargs)
            slots = []
            for pos, a in enumerate(full):
                if not isinstance(a, torch.Tensor):
                    continue
                hit = [i for i, t in enumerate(inputs) if a is t]
                if hit:
                    slots.append((pos, hit[0]))
                elif a.untyped_storage().data_ptr() in storages:
                    self.calls = None             # a view of a per-call tensor: it would go stale
                    return
            for pos, _ in slots:
                full[pos] = None                  # substituted on every replay: hold no call's tensor (kept: weakly)
            compiled[grid]                        # loads the module and function handles
            self.calls.append((compiled, grid, full, slots))
        self.stream = _stream()                   # the workspace the wrapper made is this stream's
        self.calls = [(c, g, full, slots, _direct(c, g, self.stream[1], full)) for c, g, full, slots in self.calls]

    @property
    def usable(self) -> bool:
        return bool(self.calls)

    def replay(self, inputs: tuple) -> bool:
        """Launch the recorded kernels over ``inputs``; False (nothing launched) unless they
        match the recorded tensors in every fact a compiled kernel is specialized on (kept and
        derived inputs as the class says)."""
        if not self.calls or len(inputs) != len(self.facts):
            return False
        ptrs = [t.data_ptr() for t in inputs]
        facts = self.facts
        for i in self.checked:
            t = inputs[i]
            if (t.dtype, t.shape, t.stride(), t.get_device(), ptrs[i] % 16 == 0) != facts[i]:
                return False
        for i in self.derived:
            if (ptrs[i] % 16 == 0) != facts[i][4]:
                return False
        for i, seen in self.kept.items():
            t = inputs[i]
            if seen.get(id(t)) is not t:
                if _facts(t) != facts[i]:
                    return False
                seen[id(t)] = t
        where = _stream()
        if where != self.stream:                  # another stream or device: record there anew
            return False
        stream, hooked = where[1], _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)
        for compiled, grid, full, slots, direct in self.calls:
            if direct is not None and not hooked:  # the C launch Triton's runner ends in, called directly
                fn, args, lead = direct
                args = list(args)
                for pos, i in slots:
                    args[lead + pos] = ptrs[i]
                fn(*args)
                continue
            args = list(full)
            for pos, i in slots:
                args[pos] = inputs[i]
            if hooked:                            # a profiler's launch hooks: Triton's own runner
                compiled[grid](*args, stream=stream)
            else:                                 # that runner, for a kernel with scratch memory
                compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)
        self.replays += 1
        return True


def _ordered(kernel, args: tuple, kwargs: dict) -> list:
    """Every parameter of ``kernel`` in order (constexprs included: the compiled launcher takes
    them and skips them), from positional ``args``, keyword ``kwargs`` and the defaults; a
    keyword that names no parameter is a compile option (``num_warps``, ``debug``, ...), which
    the compiled kernel already holds."""
    out = list(args)
    for p in list(kernel.signature.parameters.values())[len(args):]:
        if p.name in kwargs:
            out.append(kwargs[p.name])
        elif p.default is not p.empty:
            out.append(p.default)
        else:
            raise TypeError(f"{_name(kernel)}: no value for parameter {p.name}")
    return out


def _name(kernel) -> str:
    return getattr(kernel, "__name__", type(kernel).__name__)
