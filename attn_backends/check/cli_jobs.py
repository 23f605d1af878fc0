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
:func:`usable` keeps a run in one process while any is registered. On a GPU the workers share the device, each in
its own CUDA context, and compile kernels side by side: there the time of a check is mostly
Triton compiling the kernels its random cases need.

A worker that raises or dies ends the run at once, as a crash ends a run in one process: the
others are stopped, and the report keeps the checks of the workers that had finished. The
exception is raised in the parent with the worker's traceback as its cause (an exception that
does not unpickle becomes a RuntimeError of its name and text). A worker whose parent is gone
(killed, even by SIGKILL) exits; an interrupted parent stops its workers. Progress is counted in
one slot per worker, without a lock that a dying worker could leave held.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
import traceback
import warnings
from multiprocessing.connection import wait
from typing import Callable, Optional

from .. import registry
from .report import SuiteReport

POLL_S = 0.5


def usable() -> bool:
    """Whether spawned workers see the backends this process sees: no name registered at run
    time (a worker would not know it, and a registration may replace the reference)."""
    return not registry._extra


def _exit_with_parent() -> None:
    """In a worker: exit when the parent process ends, however it ends."""
    parent = mp.parent_process()
    if parent is not None:
        threading.Thread(target=lambda: (parent.join(), os._exit(1)), daemon=True).start()


class RemoteTraceback(Exception):
    """The traceback of a worker's exception, as its cause (``concurrent.futures`` does the same)."""

    def __str__(self) -> str:
        return self.args[0]


def _portable(e: BaseException) -> Optional[BaseException]:
    """``e`` if it survives pickling both ways (an exception whose ``args`` are not its
    ``__init__``'s does not), else None: the parent then raises a RuntimeError of its name and text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any failure to rebuild it
        return None


def _error(exc: Optional[BaseException], name: str, text: str, tb: str = "") -> tuple:
    """What a worker sends for an exception (``exc`` None where it does not pickle)."""
    return "error", (exc, name, text, tb)


def _worker(conn, done, backend: str, device: str, cases: int, seed: int, modes: Optional[list],
            part: int, parts: int, kv_dtype=None) -> None:
    _exit_with_parent()
    warnings.filterwarnings("ignore", message="Synchronization debug mode")   # once, in the parent

    def progress(n: int, total: int) -> None:   # this worker's cases done, in its own slot: no lock
        done[part] = n

    try:
        from .suite import run_suite
        rep = run_suite(backend, device=device, cases=cases, seed=seed, modes=modes, progress=progress,
                        shard=(part, parts), kv_dtype=kv_dtype)
        msg = ("ok", ({k: list(v) for k, v in rep.counts.items()}, rep.failures, dict(rep.cases),
                       dict(rep.feature_cases), dict(rep.not_run)))
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it as one process would
        msg = _error(_portable(e), type(e).__name__, str(e), traceback.format_exc())
    try:
        conn.send(msg)
    except Exception as e:  # noqa: BLE001 - a result that does not pickle
        conn.send(_error(None, "RuntimeError", f"worker {part}: its result does not pickle: {e}"))
    conn.close()


def merge(report: SuiteReport, shards: list, modes: list) -> SuiteReport:
    """Add the workers' ``(counts, failures, cases, feature cases, checks not run)`` into ``report``, the
    failures in the serial order: by ``modes`` (the run's modes in running order), then by seed (a stable sort keeps one
    case's failures in the order it found them)."""
    failures = []
    for counts, fails, cases, feature_cases, not_run in shards:
        for key, (passed, failed) in counts.items():
            report.counts[key][0] += passed
            report.counts[key][1] += failed
        for key, n in cases.items():
            report.cases[key] += n
        for key, n in feature_cases.items():
            report.feature_cases[key] += n
        for key, (n, reason) in not_run.items():
            report.not_run.setdefault(key, [0, reason])[0] += n
        failures += fails
    rank = {m: i for i, m in enumerate(modes)}
    report.failures += sorted(failures, key=lambda f: (rank[f.mode], f.seed))
    return report


def run_layout_jobs(backend: str, jobs: int, modes: list, *, device: str, cases: int, seed: int,
                    progress: Optional[Callable[[int, int], None]], report: SuiteReport,
                    kv_dtype=None) -> SuiteReport:
    """The layout suite of ``backend`` (a name or target a worker can load, see :func:`usable`)
    over ``modes`` (the run's modes in running order) in ``jobs`` processes, at most one a case.
    The first worker that raises ends the run, and its exception is raised here; one that dies
    is a RuntimeError with its exit code."""
    ctx = mp.get_context("spawn")
    total = len(modes) * cases
    parts = max(1, min(jobs, total))
    done = ctx.Array("q", parts, lock=False)          # each worker writes its own slot only
    conns, procs, shards, error, shown = {}, [], {}, None, -1
    try:
        for k in range(parts):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(send, done, backend, device, cases, seed, modes, k, parts, kv_dtype),
                            name=f"attn-backends check worker {k}")
            p.start()
            send.close()
            conns[k], procs = recv, procs + [p]
        while conns and error is None:
            ready = wait(list(conns.values()) + [procs[k].sentinel for k in conns], timeout=POLL_S)
            for k in [k for k, c in conns.items() if c in ready or procs[k].sentinel in ready]:
                conn = conns.pop(k)
                try:                # a worker's end (its result, or its death) makes its pipe ready
                    status, got = conn.recv() if conn.poll() else ("died", None)
                except (EOFError, OSError):       # it ended without a word, or in the middle of one
                    status, got = "died", None
                except Exception as e:  # noqa: BLE001 - a result this process cannot unpickle
                    status, got = _error(None, "RuntimeError", f"worker {k}: unreadable result: {e}")
                if status == "died":
                    procs[k].join()
                    status, got = _error(None, "RuntimeError",
                                         f"worker {k} of --jobs {parts} died (exit code {procs[k].exitcode})")
                if status == "ok":
                    shards[k] = got
                elif error is None:
                    error = got
            n = min(sum(done), total)
            if progress and n != shown:
                progress(n, total)
                shown = n
    finally:                        # an error, an interrupt, or the end: no worker outlives the run
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():        # deaf to SIGTERM, or stuck in a driver call
                p.kill()
                p.join()
    merge(report, [shards[k] for k in sorted(shards)], modes)   # what the finished workers found
    if error is not None:
        exc, name, text, tb = error
        exc = exc if exc is not None else type(name, (RuntimeError,), {})(text)
        if tb:
            raise exc from RemoteTraceback(tb)
        raise exc
    return report
