"""Runs several `attn-backends check` invocations and scripts in one process, so that a test pays
SGLang's import (5-8 s on 2 cores) once per version, not once per backend and mode. One SGLang
version per process: its folder is the one on PYTHONPATH.

    python tests/adapters/sglang_jobs.py JOBS.json RESULTS.json

JOBS.json maps a name to ``{"backend": ..., "mode": null | MODE, "cases": N}`` (a check, written
with --json to a file beside RESULTS.json) or ``{"script": CODE}`` (run with exec, its stdout kept).
RESULTS.json maps each name to ``{"rc", "stdout", "json"}`` (a check) or ``{"rc", "stdout",
"error"}`` (a script)."""
import contextlib
import io
import json
import sys
import traceback
from pathlib import Path


def run_check(job: dict, out: Path) -> dict:
    from attn_backends.check.cli import main
    argv = ["check", "--backend", job["backend"], "--device", "cpu", "--suite", "layout",
            *(["--mode", job["mode"]] if job.get("mode") else []), "--cases", str(job["cases"]), "--json", str(out)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    return {"rc": rc, "stdout": buf.getvalue(), "json": json.loads(out.read_text()) if out.exists() else None}


def run_script(code: str) -> dict:
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(code, "<job>", "exec"), {"__name__": "__job__"})
        return {"rc": 0, "stdout": buf.getvalue(), "error": None}
    except Exception:     # the test reads the traceback; the next job still runs
        return {"rc": 1, "stdout": buf.getvalue(), "error": traceback.format_exc()}


def main(jobs_path: str, results_path: str) -> int:
    jobs = json.loads(Path(jobs_path).read_text())
    results, where = {}, Path(results_path).parent
    for name, job in jobs.items():
        results[name] = run_script(job["script"]) if "script" in job else run_check(job, where / f"{name}.json")
    Path(results_path).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
