"""``attn-backends check --jobs N``: the layout suite's cases of one backend over N processes.

Worker ``k`` runs every N-th case of the serial order from the k-th on
(``run_suite(shard=(k, N))``), with the seeds a serial run gives those cases, and returns its
checks and failures; the parent adds them up and puts the failures back in the serial order (a
case's seed grows with its mode and its index), so the table, the failures and ``--json`` are
those of ``--jobs 1``. The workers start with ``spawn`` (CUDA does not survive a fork) and
inherit the parent's ``sys.path``, working folder and environment (``TRITON_INTERPRET``). On a
GPU they share the device, each in its own CUDA context, and compile kernels side by side:
there the time of a check is mostly Triton compiling the kernels its random cases need.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Optional

from .testing.report import SuiteReport

POLL_S = 0.5
_done = None    # in a worker: the cases all workers have finished (a shared counter)


def _init(counter) -> None:
    global _done
    _done = counter


def _one_more(done: int, total: int) -> None:
    with _done.get_lock():
        _done.value += 1


def _run_shard(backend: str, device: str, cases: int, seed: int, modes: Optional[list], part: int,
               parts: int) -> tuple:
    from .testing.suite import run_suite
    rep = run_suite(backend, device=device, cases=cases, seed=seed, modes=modes, progress=_one_more,
                    shard=(part, parts))
    return {k: list(v) for k, v in rep.counts.items()}, rep.failures, dict(rep.cases)


def merge(report: SuiteReport, shards: list) -> SuiteReport:
    """Add the workers' ``(counts, failures, cases)`` into ``report``, the failures in the
    serial order (by seed; a stable sort keeps one case's failures in the order it found them)."""
    failures = []
    for counts, fails, cases in shards:
        for key, (passed, failed) in counts.items():
            report.counts[key][0] += passed
            report.counts[key][1] += failed
        for key, n in cases.items():
            report.cases[key] += n
        failures += fails
    report.failures += sorted(failures, key=lambda f: f.seed)
    return report


def run_layout_jobs(backend: str, jobs: int, total: int, *, device: str, cases: int, seed: int,
                    modes: Optional[list], progress: Optional[Callable[[int, int], None]],
                    report: SuiteReport) -> SuiteReport:
    """The layout suite of ``backend`` (a name or target string a worker can load) in ``jobs``
    processes (at most one a case); ``total``: the cases in all, for ``progress``. A worker's
    exception is raised here once every worker has ended, after the others' checks are added;
    a worker that dies is a RuntimeError."""
    ctx = mp.get_context("spawn")
    counter = ctx.Value("q", 0)
    parts = max(1, min(jobs, total))
    with cf.ProcessPoolExecutor(parts, mp_context=ctx, initializer=_init, initargs=(counter,)) as pool:
        futures = [pool.submit(_run_shard, backend, device, cases, seed, modes, k, parts) for k in range(parts)]
        pending = set(futures)
        while pending:
            pending = cf.wait(pending, timeout=POLL_S)[1]
            if progress:
                progress(min(counter.value, total), total)
    errors = [f.exception() for f in futures if f.exception() is not None]
    merge(report, [f.result() for f in futures if f.exception() is None])   # what the others found
    if errors:
        if isinstance(errors[0], BrokenProcessPool):
            raise RuntimeError(f"a worker process of --jobs {jobs} died: {errors[0]}") from None
        raise errors[0]
    return report
