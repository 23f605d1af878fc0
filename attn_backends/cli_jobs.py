"""``attn-backends check --jobs N``: the layout suite's cases of one backend over N processes.

Worker ``k`` runs every N-th case of the serial order from the k-th on
(``run_suite(shard=(k, N))``), with the seeds a serial run gives those cases, and sends back its
checks and failures; the parent adds them up and puts the failures back in the serial order (by
mode, then by seed, which grows with the case's index), so the table, the failures and
``--json`` are those of ``--jobs 1``. That holds for backends whose results do not depend on the
cases run before in the same process (process-wide caches): each worker runs a different subset.

The workers start with ``spawn`` (CUDA does not survive a fork) and inherit the parent's
``sys.path``, working folder and environment (``TRITON_INTERPRET``); a backend registered at run
time (``attn_backends.register``, ``hybrid.compose``) exists only in the parent, so
:func:`usable` keeps such a run in one process. On a GPU the workers share the device, each in
its own CUDA context, and compile kernels side by side: there the time of a check is mostly
Triton compiling the kernels its random cases need.

A worker that raises or dies ends the run at once, as a crash ends a run in one process: the
others are stopped, and the report keeps the checks of the workers that had finished. A worker
whose parent is gone (killed, even by SIGKILL) exits; an interrupted parent stops its workers.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import warnings
from multiprocessing.connection import wait
from typing import Callable, Optional

from . import registry
from .testing.report import SuiteReport

POLL_S = 0.5


def usable(backend: str) -> bool:
    """Whether spawned workers can load ``backend``: not a name registered in this process."""
    return backend not in registry._extra


def _exit_with_parent() -> None:
    """In a worker: exit when the parent process ends, however it ends."""
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True).start()


def _worker(conn, counter, backend: str, device: str, cases: int, seed: int, modes: Optional[list],
            part: int, parts: int) -> None:
    _exit_with_parent()
    warnings.filterwarnings("ignore", message="Synchronization debug mode")   # once, in the parent

    def one_more(done: int, total: int) -> None:      # progress: the cases all workers finished
        with counter.get_lock():
            counter.value += 1

    try:
        from .testing.suite import run_suite
        rep = run_suite(backend, device=device, cases=cases, seed=seed, modes=modes, progress=one_more,
                        shard=(part, parts))
        msg = ("ok", ({k: list(v) for k, v in rep.counts.items()}, rep.failures, dict(rep.cases)))
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it as one process would
        msg = ("error", e)
    try:
        conn.send(msg)
    except Exception as e:  # noqa: BLE001 - an exception that does not pickle: its type and text
        conn.send(("error", RuntimeError(f"{type(msg[1]).__name__}: {msg[1]}" if msg[0] == "error" else
                                         f"the worker's result does not pickle: {e}")))
    conn.close()


def merge(report: SuiteReport, shards: list, modes: list) -> SuiteReport:
    """Add the workers' ``(counts, failures, cases)`` into ``report``, the failures in the serial
    order: by ``modes`` (the run's modes in running order), then by seed (a stable sort keeps one
    case's failures in the order it found them)."""
    failures = []
    for counts, fails, cases in shards:
        for key, (passed, failed) in counts.items():
            report.counts[key][0] += passed
            report.counts[key][1] += failed
        for key, n in cases.items():
            report.cases[key] += n
        failures += fails
    rank = {m: i for i, m in enumerate(modes)}
    report.failures += sorted(failures, key=lambda f: (rank[f.mode], f.seed))
    return report


def run_layout_jobs(backend: str, jobs: int, modes: list, *, device: str, cases: int, seed: int,
                    progress: Optional[Callable[[int, int], None]], report: SuiteReport) -> SuiteReport:
    """The layout suite of ``backend`` (a name or target a worker can load, see :func:`usable`)
    over ``modes`` (the run's modes in running order) in ``jobs`` processes, at most one a case.
    The first worker that raises ends the run, and its exception is raised here; one that dies
    is a RuntimeError with its exit code."""
    ctx = mp.get_context("spawn")
    counter, total = ctx.Value("q", 0), len(modes) * cases
    parts = max(1, min(jobs, total))
    conns, procs = {}, []
    try:
        for k in range(parts):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(send, counter, backend, device, cases, seed, modes, k, parts),
                            name=f"attn-backends check worker {k}", daemon=True)
            p.start()
            send.close()
            conns[k], procs = recv, procs + [p]
        shards, error = {}, None
        while conns and error is None:
            for conn in wait(list(conns.values()), timeout=POLL_S):
                k = next(i for i, c in conns.items() if c is conn)
                del conns[k]
                try:
                    status, got = conn.recv()
                except EOFError:    # it ended without a word: killed, or it crashed the interpreter
                    procs[k].join()
                    status, got = "error", RuntimeError(
                        f"worker {k} of --jobs {parts} died (exit code {procs[k].exitcode})")
                if status == "ok":
                    shards[k] = got
                elif error is None:
                    error = got
            if progress:
                progress(min(counter.value, total), total)
    finally:                        # an error, an interrupt, or the end: no worker outlives the run
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
    merge(report, [shards[k] for k in sorted(shards)], modes)   # what the finished workers found
    if error is not None:
        raise error
    return report
