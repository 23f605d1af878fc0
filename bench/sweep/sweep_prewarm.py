"""Before any timing: build every FlashInfer JIT module and every Triton kernel the sweep
will launch, in parallel processes (one per module, one per workload of ours).

A fresh machine compiles each FlashInfer kernel family for 20-70 s and each of our Triton
variants (one per split count) for about a second; in parallel the wall time is about the
slowest one. The main process then finds them in the on-disk caches (FlashInfer's JIT
directory, Triton's cache). Logs go to ``OUT/prewarm/<job>.log``.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from sweep_flashinfer import PREWARM, Peer, fi_inputs, new_workspace, refusal
from sweep_ours import Ours
from sweep_rows import BY_NAME, build_group, build_row

PREWARM_KV = 4096      # >= 64 pages at page 64: the split counts (up to 64) are those of every row


def jobs(groups, with_fi: bool, sm: int) -> list:
    names = sorted({w.name for _, _, _, wls in groups for w in wls})
    out = [f"ours:{n}" for n in names]
    families = {fam for fam, *_ in groups}
    if with_fi:
        out += [c for c, wl in PREWARM.items()
                if BY_NAME[wl].family in families and refusal(c, BY_NAME[wl], sm) is None]
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
            cmd = [sys.executable, script, "--prewarm", job, "--bs", ",".join(map(str, batches))]
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
    """One job, in its own process: our workload at every batch size, or one FlashInfer
    configuration once (its ``plan()`` builds the module)."""
    if job.startswith("ours:"):
        wl = BY_NAME[job[5:]]
        for bs in batches:
            t0 = time.time()
            row = build_row(build_group(wl, bs, PREWARM_KV, device), wl)
            ours = Ours(row)
            ours.eager()()
            ours.graph()
            torch.cuda.synchronize()
            print(f"{job} bs={bs}: {time.time() - t0:.1f} s", flush=True)
            del row, ours
            torch.cuda.empty_cache()
        return
    from sweep import import_flashinfer
    flashinfer, error = import_flashinfer()
    if flashinfer is None:
        raise RuntimeError(f"flashinfer: {error}")
    wl = BY_NAME[PREWARM[job]]
    row = build_row(build_group(wl, 2, PREWARM_KV, device), wl)
    inp = fi_inputs(row, Ours(row).layout())
    t0 = time.time()
    Peer(flashinfer, job, inp, new_workspace(device)).fn()()
    torch.cuda.synchronize()
    print(f"{job}: plan + run {time.time() - t0:.1f} s", flush=True)
