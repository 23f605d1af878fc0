"""Before any timing: build every FlashInfer JIT module and every Triton kernel the sweep
will launch, in parallel processes (one per module, one per workload of ours and, for GQA, of
our batch-invariant mode: its kernels are other Triton variants).

A fresh machine compiles each FlashInfer kernel family for 20-70 s and each of our Triton
variants (one per split count) for about a second; in parallel the wall time is about the
slowest one. The main process then finds them in the on-disk caches (FlashInfer's JIT
directory, Triton's cache). Logs go to ``OUT/prewarm/<job>.log``. FlashInfer's GQA modules are
built per head dim (``fi_decode:d64``), its MLA modules once.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from sweep_flashinfer import PREWARM, Peer, fi_inputs, new_workspace, refusal
from sweep_ours import INVARIANT, Ours, has_invariant
from sweep_rows import BY_NAME, VARIANTS, WORKLOADS, build_group, build_row

PREWARM_KV = 4096      # >= 64 pages at page 64: the split counts (up to 64) are those of every row


def config_of(job: str) -> str:
    """The FlashInfer configuration of a prewarm job (``fi_decode:d64`` -> ``fi_decode``)."""
    return job.split(":")[0]


def job_workload(job: str):
    """The workload a FlashInfer job plans: ``PREWARM``'s, at the job's head dim and variant (a JIT
    module per head dim, KV dtype, window and cap: ``fi_decode:d128:fp8``, ``fi_decode:d128:w``)."""
    wl = BY_NAME[PREWARM[config_of(job)]]
    if ":d" not in job:
        return wl
    dim = int(job.split(":d")[1].split(":")[0])
    wl = next(w for w in WORKLOADS if w.family == "gqa" and w.mode == wl.mode and w.qk_dim == dim)
    for tag in job.split(":")[2:]:
        wl = _with(wl, {"fp8": "fp8", "w": "w4096", "cap": "cap"}[tag])
    return wl


def _with(wl, tag: str):
    """``wl`` with one more variant (``sweep_rows.VARIANTS`` or fp8): a prewarm job's module."""
    extra = dict(kv_dtype=torch.float8_e4m3fn) if tag == "fp8" else VARIANTS[tag]
    return replace(wl, name=f"{wl.name}_{tag}", **extra)


def jobs(groups, with_fi: bool, sm: int, invariant: bool = False) -> list:
    """Ours per workload of ``groups`` (``sweep_matrix.Point``), our batch-invariant mode per GQA
    workload (``invariant``), FlashInfer per configuration (and head dim, for GQA) that can run one
    of them."""
    wls = {w.name: w for p in groups for w in p.wls}
    out = [f"ours:{n}" for n in sorted(wls)]
    out += [f"{INVARIANT}:{n}" for n in sorted(wls) if invariant and has_invariant(wls[n])]
    if not with_fi:
        return out
    dims = sorted({f"d{w.qk_dim}{w.variant}" for p in groups for w in p.wls if w.family == "gqa" and not w.sinks})
    families = {p.family for p in groups}
    for c, name in PREWARM.items():
        wl = BY_NAME[name]
        for job in ([f"{c}:{d}" for d in dims] if wl.family == "gqa" else [c]):
            if wl.family in families and refusal(c, job_workload(job), sm) is None:
                out.append(job)
    return out


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def launch(job_names, out_dir: Path, batches, timeout_s: float) -> dict:
    """Run the jobs in parallel; kill (by process group) those still running at the deadline
    or when the sweep itself is stopped (SIGTERM, Ctrl-C)."""
    log_dir = out_dir / "prewarm"
    log_dir.mkdir(parents=True, exist_ok=True)
    script = str(Path(__file__).with_name("sweep.py"))
    logs = {job: log_dir / f"{job.replace(':', '_')}.log" for job in job_names}
    procs, result, t0 = {}, {}, time.time()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for job in job_names:
            cmd = [sys.executable, script, "--prewarm", job, "--prewarm-bs", ",".join(map(str, batches))]
            with open(logs[job], "w") as log:
                procs[job] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        for job, p in procs.items():
            try:
                rc = p.wait(timeout=max(1.0, t0 + timeout_s - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                rc = p.wait()
            result[job] = {"rc": rc, "s": round(time.time() - t0, 1)}
            if rc != 0:
                lines = logs[job].read_text(errors="replace").splitlines()
                result[job]["tail"] = " | ".join(lines[-6:])[-600:]
    finally:
        signal.signal(signal.SIGTERM, previous)
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return result


def run_job(job: str, batches, device: str) -> None:
    """One job, in its own process: our workload (``ours:``, or ``ours_invariant:`` for our
    batch-invariant mode) at every batch size, or one FlashInfer configuration once (its ``plan()``
    builds the module)."""
    mode, _, name = job.partition(":")
    if mode in ("ours", INVARIANT):
        wl = BY_NAME[name]
        for bs in batches:
            t0 = time.time()
            row = build_row(build_group(wl, bs, PREWARM_KV, device), wl)
            ours = Ours(row, invariant=mode == INVARIANT)
            ours.eager()()
            ours.graph()
            torch.cuda.synchronize()
            print(f"{job} bs={bs}: {time.time() - t0:.1f} s", flush=True)
            del row, ours
            torch.cuda.empty_cache()
        return
    from sweep_args import import_flashinfer
    flashinfer, error = import_flashinfer()
    if flashinfer is None:
        raise RuntimeError(f"flashinfer: {error}")
    wl = job_workload(job)
    row = build_row(build_group(wl, 2, PREWARM_KV, device), wl)
    inp = fi_inputs(row, Ours(row).layout())
    t0 = time.time()
    Peer(flashinfer, config_of(job), inp, new_workspace(device)).fn()()
    torch.cuda.synchronize()
    print(f"{job}: plan + run {time.time() - t0:.1f} s", flush=True)
