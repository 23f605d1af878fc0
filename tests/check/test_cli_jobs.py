"""``attn-backends check --jobs N``: the layout suite's cases over N worker processes give the
result of one process (the same checks, the same failures in the same order, the same --json);
a worker that raises or dies is a crashed suite, not a hang or a traceback; no worker outlives
its parent, killed or interrupted."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attn_backends import register
from attn_backends.check import cli, cli_jobs
from attn_backends.check.report import Failure, SuiteReport

ROOT = Path(__file__).resolve().parents[2]
BUGGY = f"{ROOT / 'tests' / 'support' / 'planted_bugs.py'}:NoPlusW"     # fails checks in most modes
BACKENDS = """
import os, time
from pathlib import Path
from attn_backends.backends.torch_native import TorchNativeBackend

class Dies(TorchNativeBackend):
    def init_cuda_graph_state(self, *args, **kwargs):
        os._exit(3)

class Raises(TorchNativeBackend):
    def init_cuda_graph_state(self, *args, **kwargs):
        raise RuntimeError("boom")

class TwoArgError(Exception):        # its args are not its __init__'s: unpickling it fails
    def __init__(self, what, where):
        super().__init__(f"{what} at {where}")

class RaisesTwoArg(TorchNativeBackend):
    def init_cuda_graph_state(self, *args, **kwargs):
        raise TwoArgError("bad", "here")

class Sleeps(TorchNativeBackend):
    def init_cuda_graph_state(self, *args, **kwargs):
        Path(f"pid.{os.getpid()}").write_text("")
        time.sleep(120)
"""
_one_process = {}


@pytest.fixture(autouse=True)
def _no_run_time_registrations(monkeypatch):
    """Jobs spread only where no name was registered at run time (``cli_jobs.usable``): a test
    before these in the same process (``hybrid.compose(name=...)``) must not turn them off."""
    monkeypatch.setattr(cli_jobs.registry, "_extra", {})


def _check_json(tmp_path, capsys, cases: int, jobs: int) -> tuple:
    path = tmp_path / f"out_{cases}_{jobs}.json"
    status = cli.main(["check", "--backend", BUGGY, "--suite", "layout", "--cases", str(cases), "--progress-every",
                       "0", "--json", str(path), "--jobs", str(jobs)])
    capsys.readouterr()
    res = json.loads(path.read_text())
    res.pop("command")
    for b in res["backends"]:
        b.pop("seconds")
    return status, res


@pytest.mark.parametrize("cases,jobs", [(1, 2), (3, 2), (2, 5), (3, 3)])
def test_jobs_give_the_result_of_one_process(tmp_path, capsys, monkeypatch, cases, jobs):
    """Jobs that divide the cases or not, more jobs than a mode's cases, and one case a mode
    (every mode's case then has the same seed)."""
    if cases not in _one_process:
        _one_process[cases] = _check_json(tmp_path, capsys, cases, 1)
    status1, one = _one_process[cases]
    spread, real = [], cli_jobs.run_layout_jobs
    monkeypatch.setattr(cli_jobs, "run_layout_jobs", lambda *a, **k: spread.append(1) or real(*a, **k))
    status, res = _check_json(tmp_path, capsys, cases, jobs)
    assert spread == [1]                  # the workers ran it
    assert status1 == status == 1
    fails = one["backends"][0]["failures"]
    assert len({f["mode"] for f in fails}) >= 3 and len({(f["mode"], f["seed"]) for f in fails}) >= 3
    assert sum(c["cases"] for c in res["backends"][0]["cases"]) == 6 * cases
    assert res == one                     # counts, cases, failures and their order


def test_progress_counts_every_case_of_every_worker(monkeypatch):
    seen = []
    rep = cli_jobs.run_layout_jobs("torch_native", 2, ["decode", "verify_chain"], device="cpu", cases=2, seed=0,
                                   progress=lambda done, total: seen.append((done, total)), report=SuiteReport())
    assert rep.ok and sum(rep.cases.values()) == 4
    assert seen[-1] == (4, 4) and all(a <= b for (a, _), (b, _) in zip(seen, seen[1:]))


@pytest.fixture
def backends_file(tmp_path, monkeypatch):
    (tmp_path / "jobs_backends.py").write_text(BACKENDS)
    monkeypatch.chdir(tmp_path)
    return "jobs_backends.py"


@pytest.mark.parametrize("cls,error", [("Raises", "RuntimeError: boom"),
                                       ("RaisesTwoArg", "TwoArgError: bad at here")])
def test_a_worker_that_raises_is_the_crash_one_process_reports(backends_file, capsys, cls, error):
    argv = ["check", "--backend", f"{backends_file}:{cls}", "--suite", "layout", "--mode", "decode", "--cases", "2",
            "--progress-every", "0"]
    assert cli.main(argv) == 1
    one = capsys.readouterr().out
    assert cli.main(argv + ["--jobs", "2"]) == 1
    out = capsys.readouterr().out
    line = f"FAIL {backends_file}:{cls}: the layout suite: {error}"
    assert line in one and line in out, (one, out)
    assert "Traceback" not in out
    assert cli.main(argv + ["--jobs", "2", "--verbose"]) == 1     # the worker's own frames, as the cause
    out = capsys.readouterr().out
    assert "in init_cuda_graph_state" in out and "RemoteTraceback" in out, out


def test_a_worker_that_dies_is_a_crashed_suite(backends_file, capsys):
    assert cli.main(["check", "--backend", f"{backends_file}:Dies", "--suite", "layout", "--mode", "decode",
                     "--cases", "2", "--jobs", "2", "--progress-every", "0"]) == 1
    out = capsys.readouterr().out
    head = f"FAIL {backends_file}:Dies: the layout suite: RuntimeError: worker "
    assert any(f"{head}{k} of --jobs 2 died (exit code 3)" in out for k in (0, 1)), out
    assert "Traceback" not in out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                              # a zombie (exited, not yet reaped by init) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_no_worker_outlives_its_parent(backends_file, tmp_path, sig):
    """The parent alone gets the signal (a CI runner cancelling it, the OOM killer; ^C reaches
    the whole process group): its sleeping workers exit within seconds, not after their cases."""
    parent = subprocess.Popen([sys.executable, "-m", "attn_backends.check.cli", "check", "--backend",
                               f"{backends_file}:Sleeps", "--suite", "layout", "--mode", "decode", "--cases", "2",
                               "--jobs", "2", "--progress-every", "0"], cwd=tmp_path, start_new_session=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)       # shell ignores it
    try:
        deadline = time.monotonic() + 60
        while len(pids := [int(p.suffix[1:]) for p in tmp_path.glob("pid.*")]) < 2:
            assert time.monotonic() < deadline and parent.poll() is None, parent.communicate()
            time.sleep(0.1)
        os.kill(parent.pid, sig)
        out, err = parent.communicate(timeout=30)
        if sig == signal.SIGINT:
            assert parent.returncode == 130 and "interrupted" in err, (out, err)
        deadline = time.monotonic() + 20
        while any(map(_alive, pids)):
            assert time.monotonic() < deadline, f"workers {pids} outlived the parent"
            time.sleep(0.1)
    finally:                              # whatever failed: nothing of the test lingers
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_one_case_and_a_run_time_registration_stay_in_the_one_process(capsys, monkeypatch):
    """A failure's replay command (``--cases 1 --mode M``) starts no worker; nor does a backend
    registered at run time, which a spawned worker would not know."""
    def no_workers(*args, **kwargs):
        raise AssertionError("workers started")
    monkeypatch.setattr(cli_jobs, "run_layout_jobs", no_workers)
    monkeypatch.setattr(cli_jobs.registry, "_extra", {})
    assert cli.main(["check", "--suite", "layout", "--mode", "decode", "--cases", "1", "--jobs", "4",
                     "--progress-every", "0"]) == 0
    register("mine_at_run_time", "attn_backends.backends.torch_native:TorchNativeBackend")
    assert cli.main(["check", "--backend", "mine_at_run_time", "--suite", "layout", "--mode", "decode",
                     "--cases", "2", "--jobs", "2", "--progress-every", "0"]) == 0
    assert capsys.readouterr().out.count(": ok,") == 2


def test_jobs_below_one_is_a_usage_error(capsys):
    assert cli.main(["check", "--jobs", "0"]) == 2
    assert "--jobs" in capsys.readouterr().err


def test_merge_adds_the_shards_and_restores_the_serial_order():
    def fail(mode, seed, inv):
        return Failure("b", mode, inv, "m", "c", seed)
    shards = [({("b", "decode", "I1"): [2, 1]}, [fail("verify_chain", 0, "I1"), fail("decode", 5, "I1")],
               {("b", "decode"): 2}, {("b", "decode", "window w=1"): 1}, {("b", "decode", "I9n"): [1, "why"]}),
              ({("b", "decode", "I1"): [1, 2], ("b", "decode", "I3"): [0, 1]},
               [fail("decode", 2, "I1"), fail("decode", 2, "I3"), fail("decode", 9, "I1"),
                fail("draft_decode", 0, "I5")],
               {("b", "decode"): 1}, {("b", "decode", "window w=1"): 2}, {("b", "decode", "I9n"): [2, "why"]})]
    rep = cli_jobs.merge(SuiteReport(), shards, ["decode", "draft_decode", "verify_chain"])
    assert rep.counts == {("b", "decode", "I1"): [3, 3], ("b", "decode", "I3"): [0, 1]}
    assert rep.cases == {("b", "decode"): 3}
    assert rep.feature_cases == {("b", "decode", "window w=1"): 3}
    assert rep.not_run == {("b", "decode", "I9n"): [3, "why"]}
    assert [(f.mode, f.seed, f.invariant) for f in rep.failures] == [
        ("decode", 2, "I1"), ("decode", 2, "I3"), ("decode", 5, "I1"), ("decode", 9, "I1"),
        ("draft_decode", 0, "I5"), ("verify_chain", 0, "I1")]
