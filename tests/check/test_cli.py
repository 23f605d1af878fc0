"""The `attn-backends` command line (with a recording stand-in for the suites), its misuse
errors, and the README / CI set-up commands it documents."""
import io
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from attn_backends import registry
from attn_backends.check import cli, cli_report
from attn_backends.check import suite as real_suite
from attn_backends.check.cli_progress import PeriodicLines, duration, progress_for
from attn_backends.check.report import Failure, SuiteReport

ROOT = Path(__file__).resolve().parents[2]
SUITE = "attn_backends.check.suite"
DECODE_ONLY = (
    "from dataclasses import replace\n"
    "from attn_backends import ForwardMode\n"
    "from attn_backends.backends.torch_native import TorchNativeBackend\n"
    "class NeedsPkg(TorchNativeBackend):\n"
    "    capabilities = replace(TorchNativeBackend.capabilities, requires=('no_such_pkg_xyz',))\n"
    "class DecodeOnly(TorchNativeBackend):\n"
    "    capabilities = replace(TorchNativeBackend.capabilities, modes=frozenset({ForwardMode.DECODE}))\n")


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def fake_suite(monkeypatch):
    """Replace ``attn_backends.check.suite`` by a recorder: two passing decode cases, then
    ``fail`` failing ones (one per case); ``crash`` makes it raise."""
    calls = []
    mod = types.ModuleType(SUITE)
    mod.fail, mod.crash = 0, None
    mod.MODES, mod.declared_modes = real_suite.MODES, real_suite.declared_modes

    def run_suite(backend, *, device="cpu", cases=200, seed=0, modes=None, progress=None, report=None):
        calls.append(dict(backend=backend, device=device, cases=cases, seed=seed, modes=modes))
        mod.progress = progress
        if mod.crash:
            raise mod.crash
        report = report if report is not None else SuiteReport()
        for i in range(2):
            report.cases[(backend, "decode")] += 1
            report.check(backend, "decode", "I1", [], case="c", seed=seed + i)
            if progress:
                progress(i + 1, 2)
        for i in range(mod.fail):
            report.cases[(backend, "decode")] += 1
            report.check(backend, "decode", "I3", [f"pad row 3 holds {i}, expected 0"],
                         case="decode bs=4 raw_bs=3 prefixes=[1, 2, 3]", seed=seed + 17 + i, device=device)
        return report

    def extra_suite(backend, *, device, cases, seed, progress, report):
        mod.extra_calls.append(dict(backend=backend, cases=cases, seed=seed))
        report.cases[(backend, "fake_runner:decode")] += 1
        report.check(backend, "fake_runner:decode", "I8", ["returned tensor overwritten"] if mod.fail else [],
                     case="kind=decode", seed=seed)
        if progress:
            progress(1, 1)

    mod.run_suite, mod.calls, mod.extra_calls = run_suite, calls, []
    monkeypatch.setitem(sys.modules, SUITE, mod)
    monkeypatch.setattr(cli, "_extra_suites", lambda: [("fake_runner", lambda: extra_suite)])
    monkeypatch.setattr(sys, "path", list(sys.path))    # main() appends the current folder
    return mod


@pytest.fixture
def plugin_files(builtin_registry, tmp_path, monkeypatch):
    (tmp_path / "decode_only_mod.py").write_text(DECODE_ONLY)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register("needs_pkg", "decode_only_mod:NeedsPkg")
    registry.register("decode_only", "decode_only_mod:DecodeOnly")
    yield tmp_path
    monkeypatch.delitem(sys.modules, "decode_only_mod", raising=False)


# --------------------------------------------------------------------------- list

def _list_blocks(out: str) -> dict:
    """backend -> (its row, its notes joined into one line each)."""
    blocks, name = {}, None
    for line in out.splitlines()[3:]:
        if not line.startswith(" "):
            name = line.split()[0]
            blocks[name] = [line, []]
        elif line.startswith("    ") and not line.startswith("      "):
            blocks[name][1].append(line.strip())
        else:
            blocks[name][1][-1] += " " + line.strip()
    return blocks


def test_list_fits_100_columns_with_modes_origin_and_reasons(capsys, plugin_files):
    registry.register("ghost", "no_such_module_xyz:Ghost")
    assert cli.main(["list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 100, out
    blocks = _list_blocks(out)
    row, notes = blocks["torch_native"]
    assert re.match(r"torch_native\s+yes\s+MHA\+MLA\s+1,16,64\s+yes\s+uniform_batch\s+cpu,cuda$", row), row
    assert notes == ["modes: extend [piecewise], decode [full], verify [full], draft_extend [full]",
                     "KV caches: model's, fp8_e4m3, fp8_e5m2; attention: sliding windows, attention sinks, "
                     "logit softcapping"]
    assert {i.name for i in registry.list_backends("cpu")} == set(blocks)
    for info in registry.list_backends("cpu"):
        if not info.available:
            assert blocks[info.name][0].split()[1] == "no"
            assert f"not available: {info.reason}" in blocks[info.name][1]
    assert "plugin: no_such_module_xyz:Ghost" in blocks["ghost"][1]
    assert any("No module named 'no_such_module_xyz'" in n for n in blocks["ghost"][1])
    assert blocks["decode_only"][1][0] == "modes: decode [full]"


def test_list_on_cuda_without_a_gpu_says_why(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main(["list", "--device", "cuda"]) == 0
    notes = _list_blocks(capsys.readouterr().out)["torch_native"][1]
    assert "not available: CUDA is not available on this machine" in notes


# --------------------------------------------------------------------------- check, fake suite

def test_check_defaults_and_exit_0(fake_suite, capsys):
    assert cli.main(["check"]) == 0
    assert fake_suite.calls == [dict(backend="torch_native", device="cpu", cases=200, seed=0, modes=None)]
    assert fake_suite.extra_calls == [dict(backend="torch_native", cases=60, seed=0)]
    out = capsys.readouterr().out
    assert "torch_native, layout suite:" in out and "torch_native, fake_runner suite:" in out
    assert re.search(r"^I1\s+ok 2$", out, re.M) and not re.search(r"FAIL \d|^FAIL", out, re.M)
    assert re.search(r"^I1\s+layout equality", out, re.M)                     # the legend
    assert re.search(r"^torch_native: ok, 3 checks in \d+s$", out, re.M)


def test_check_says_when_no_other_suite_is_installed(fake_suite, capsys, monkeypatch):
    """Without the entry points (a checkout on the path, no install) only the layout suite runs,
    and check says so instead of printing a smaller count alone."""
    monkeypatch.setattr(cli, "_extra_suites", lambda: [])
    assert cli.main(["check"]) == 0
    err = capsys.readouterr().err
    assert "note: no suite of the entry-point group attn_backends.suites is installed" in err
    assert cli.main(["check", "--suite-cases", "0"]) == 0            # asked for the layout suite alone
    assert "note:" not in capsys.readouterr().err


def test_a_failure_prints_the_one_command_that_replays_its_case(fake_suite, capsys):
    fake_suite.fail = 1
    assert cli.main(["check", "--cases", "5", "--seed", "3"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^I3\s+FAIL 1 of 1$", out, re.M)
    assert "FAIL I3 [torch_native decode] pad row 3 holds 0, expected 0\n" in out
    assert "  case: decode bs=4 raw_bs=3 prefixes=[1, 2, 3]\n" in out
    assert ("  replay: attn-backends check --backend torch_native --device cpu --suite layout --mode decode "
            "--seed 20 --cases 1\n") in out
    assert ("  replay: attn-backends check --backend torch_native --device cpu --suite fake_runner "
            "--seed 3 --suite-cases 1\n") in out
    assert "torch_native: FAIL, 2 of 4 checks failed (I3, I8)" in out


def test_the_flood_is_capped_and_verbose_and_json_have_it_all(fake_suite, capsys, tmp_path):
    fake_suite.fail = 500
    report = tmp_path / "r.json"
    assert cli.main(["check", "--suite", "layout", "--json", str(report)]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL I3 ") == cli_report.SHOWN
    assert (f"... and {500 - cli_report.SHOWN} more I3 failures in torch_native decode, 500 cases in all "
            "(--verbose prints them, --json FILE writes them)") in out
    assert len(out.splitlines()) < 60
    data = json.loads(report.read_text())
    assert data["status"] == 1 and data["command"] == f"attn-backends check --suite layout --json {report}"
    (b,) = data["backends"]
    assert len(b["failures"]) == 500 and b["ok"] is False
    assert b["failures"][499]["replay"].endswith("--suite layout --mode decode --seed 516 --cases 1")
    assert {"suite": "layout", "mode": "decode", "invariant": "I3", "passed": 0, "failed": 500} in b["checks"]
    assert cli.main(["check", "--suite", "layout", "--verbose"]) == 1
    assert capsys.readouterr().out.count("FAIL I3 ") == 500


def test_a_long_message_is_cut_unless_verbose():
    f = Failure("b", "decode", "I1", "x" * 1000, "c" * 500, 1)
    short, full = cli_report.format_failure(f), cli_report.format_failure(f, verbose=True)
    assert len(short.splitlines()[0]) < 400 and "700 more characters with --verbose" in short
    assert "x" * 1000 in full and "c" * 500 in full


def _one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("attn-backends: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["check", "--backend", "nope"], r"backend 'nope' is neither a registered name nor 'module:Class'.*"
                                     r"registered backends: .*torch_native"),
    (["check", "--backend", "no_such_module_xyz:Backend"], r"cannot load backend class .*no_such_module_xyz"),
    (["check", "--backend", "needs_pkg"], r"not available on cpu: python package 'no_such_pkg_xyz' is not installed"),
    (["check", "--backend", "os:path"], r"'os:path' is a module, not a subclass of attn_backends.AttentionBackend"),
    (["check", "--backend", "./no_such_file_xyz.py:Backend"], r"FileNotFoundError: no file './no_such_file_xyz.py'"),
    (["check", "--backend", "attn_backends.base:Capabilities"], r"is a class Capabilities, not a subclass"),
    (["check", "--backend", "decode_only", "--mode", "verify_tree"],
     r"backend 'decode_only' does not declare mode verify_tree \(it declares decode, draft_decode\)"),
    (["check", "--suite-cases", "-3"], r"argument --suite-cases: -3 is below the least value 0"),
    (["check", "--cases", "0"], r"argument --cases: 0 is below the least value 1"),
    (["check", "--cases", "many"], r"argument --cases: 'many' is not a whole number"),
    (["check", "--progress-every", "-1"], r"argument --progress-every: -1 is below 0 seconds"),
    (["check", "--device", "tpu"], r"argument --device: invalid choice: 'tpu'"),
    (["check", "--suite", "nope"], r"unknown suite 'nope' \(suites: layout, fake_runner, all\)"),
    (["check", "--mode", "sideways"], r"--mode 'sideways' is not a mode of the layout suite \(modes: decode,"),
    (["check", "--suite", "fake_runner", "--mode", "decode"], r"suite 'fake_runner' takes no mode"),
    (["check", "--suite", "fake_runner", "--suite-cases", "0"], r"--suite fake_runner with --suite-cases 0 runs"),
    (["check", "--json", "no_such_dir_xyz/r.json"], r"--json no_such_dir_xyz/r.json: cannot write a file there"),
    (["check", "--bogus"], r"unrecognized arguments: --bogus"),
    (["frobnicate"], r"argument command: invalid choice: 'frobnicate'"),
    ([], r"the following arguments are required: command"),
])
def test_misuse_is_one_line_and_exit_2_before_anything_runs(argv, message, fake_suite, plugin_files, capsys):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert re.search(message, _one_error_line(captured.err)), captured.err
    assert fake_suite.calls == [] and fake_suite.extra_calls == [] and captured.out == ""


def test_check_exit_2_for_cuda_without_a_gpu(fake_suite, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main(["check", "--device", "cuda"]) == 2
    assert "not available on cuda: CUDA is not available" in _one_error_line(capsys.readouterr().err)


def test_check_all_runs_every_available_backend(fake_suite, capsys):
    assert cli.main(["check", "--backend", "all", "--cases", "1"]) == 0
    available = [i.name for i in registry.list_backends("cpu") if i.available]
    assert [c["backend"] for c in fake_suite.calls] == available and "torch_native" in available
    assert f"all {len(available)} backends ok" in capsys.readouterr().out or len(available) == 1


def test_suite_and_mode_select_what_runs(fake_suite, capsys):
    assert cli.main(["check", "--cases", "1", "--suite-cases", "7", "--seed", "3"]) == 0
    assert fake_suite.extra_calls == [dict(backend="torch_native", cases=7, seed=3)] and len(fake_suite.calls) == 1
    for argv, layout, extra in [(["--suite-cases", "0"], 1, 0), (["--suite", "layout"], 1, 0),
                                (["--suite", "fake_runner"], 0, 1), (["--mode", "decode"], 1, 0),
                                (["--suite", "all"], 1, 1)]:
        fake_suite.calls.clear()
        fake_suite.extra_calls.clear()
        assert cli.main(["check", "--cases", "1", *argv]) == 0
        assert (len(fake_suite.calls), len(fake_suite.extra_calls)) == (layout, extra), argv
    assert fake_suite.calls[0]["modes"] is None
    cli.main(["check", "--mode", "verify_tree"])
    assert fake_suite.calls[-1]["modes"] == ["verify_tree"]


def test_runner_suite_is_registered():
    """This distribution registers runtime's runner invariants (issue #4 item 8)."""
    from importlib.metadata import entry_points
    eps = {ep.name: ep.value for ep in entry_points(group=cli.SUITES_GROUP)}
    assert eps.get("runner") == "attn_backends_runtime.testing.runner_suite:run_runner_suite", eps


def test_module_class_from_the_current_folder_and_a_file_path(fake_suite, tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "here_attn_xyz.py").write_text(DECODE_ONLY)
    (tmp_path / "sub" / "there_attn.py").write_text(DECODE_ONLY)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["check", "--backend", "here_attn_xyz:DecodeOnly", "--cases", "1"]) == 0
    assert cli.main(["check", "--backend", "sub/there_attn.py:DecodeOnly", "--cases", "1"]) == 0
    assert [c["backend"] for c in fake_suite.calls] == ["here_attn_xyz:DecodeOnly", "sub/there_attn.py:DecodeOnly"]
    monkeypatch.delitem(sys.modules, "here_attn_xyz")


def test_a_crashing_suite_is_a_failure_not_a_traceback(fake_suite, capsys):
    fake_suite.crash = RuntimeError("backend exploded")
    assert cli.main(["check", "--suite", "layout"]) == 1
    out = capsys.readouterr().out
    assert "FAIL torch_native: the layout suite: RuntimeError: backend exploded" in out
    assert "Traceback" not in out and "(--verbose prints the traceback)" in out
    assert "torch_native: FAIL, a suite crashed: layout suite: RuntimeError: backend exploded" in out
    assert cli.main(["check", "--suite", "layout", "--verbose"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().out


# --------------------------------------------------------------------------- progress

def test_progress_on_a_terminal_is_a_bar_with_cases_and_time_left(fake_suite, monkeypatch):
    tty = TTY()
    monkeypatch.setattr(sys, "stderr", tty)
    assert cli.main(["check", "--cases", "2", "--suite", "layout"]) == 0
    drawn = tty.getvalue()
    assert "torch_native layout:" in drawn and "2/2 cases" in drawn and " left]" in drawn, drawn


def test_the_bar_draws_on_a_terminal_that_reports_no_size():
    pty = pytest.importorskip("pty")
    import os
    master, slave = pty.openpty()          # a pseudo-terminal without a size: 0 columns
    with os.fdopen(slave, "w") as tty:
        bar = progress_for("tn layout", tty, every=30)
        for done in range(1, 11):
            bar(done, 10)
    chunks = []
    while True:                            # the slave is closed: read to the end (EIO on Linux)
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    drawn = b"".join(chunks).decode()
    last = [s for s in drawn.replace("\r", "\n").splitlines() if s.strip()][-1]
    assert last.startswith("tn layout: 100%|") and "10/10 cases" in last and len(last) <= 100, drawn


def test_progress_elsewhere_is_plain_lines(fake_suite, monkeypatch):
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    assert cli.main(["check", "--cases", "2"]) == 0
    assert re.fullmatch(r"torch_native layout: 2/2 cases in \d+s\ntorch_native fake_runner: 1/1 cases in \d+s\n",
                        pipe.getvalue())
    pipe.truncate(0)
    pipe.seek(0)
    assert cli.main(["check", "--cases", "2", "--progress-every", "0"]) == 0
    assert pipe.getvalue() == "" and fake_suite.progress is None


def test_periodic_lines_say_cases_done_and_time_left():
    now = [100.0]
    out = io.StringIO()
    p = PeriodicLines("tn layout", out, every=30, clock=lambda: now[0])
    for done, t in [(1, 10), (2, 31), (3, 45), (40, 62), (120, 130)]:
        now[0] = 100.0 + t
        p(done, 120)
    assert out.getvalue().splitlines() == [
        "tn layout: 2/120 cases (1%), 31s elapsed, about 30m29s left",
        "tn layout: 40/120 cases (33%), 1m02s elapsed, about 2m04s left",
        "tn layout: 120/120 cases in 2m10s",
    ]
    assert duration(7322) == "2h02m"


# --------------------------------------------------------------------------- check, real suite

def test_check_torch_native_for_real(capsys):
    assert cli.main(["check", "--backend", "torch_native", "--cases", "2", "--suite-cases", "6"]) == 0
    out = capsys.readouterr().out
    assert "torch_native: ok" in out and not re.search(r"FAIL \d|^FAIL", out, re.M)
    assert "torch_native, runner suite:" in out   # the runner invariants ran too
    assert max(map(len, out.splitlines())) <= 100


def test_module_entry_point_runs_in_a_subprocess():
    res = subprocess.run([sys.executable, "-m", "attn_backends.check.cli", "list", "--device", "cpu"],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert re.search(r"^torch_native\s+yes", res.stdout, re.M)


# --------------------------------------------------------------------------- README and CI

def setup_blocks():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
    return [body.strip() for lang, body in blocks if lang in ("bash", "sh", "shell", "console")], blocks


def test_readme_has_exactly_two_setup_commands():
    shell, blocks = setup_blocks()
    assert len(shell) == 2, shell
    main_job, tests = shell
    for cmd in shell:
        assert "\n" not in cmd, f"one command per block: {cmd!r}"
        assert cmd.startswith("python -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && ")
    assert main_job.endswith("pip install -e . && attn-backends check")
    assert tests.endswith("pip install -e '.[test]' && ruff check . && python -m pytest -q -n auto")
    others = [body for lang, body in blocks if lang not in ("bash", "sh", "shell", "console")]
    assert not any("pip install" in body for body in others)


def test_ci_runs_the_readme_test_command():
    _, tests = setup_blocks()[0]
    ci = ROOT / ".ci" / "run"
    script = ci.read_text()
    assert script.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in script
    assert tests in script.splitlines()
    assert ci.stat().st_mode & 0o111, ".ci/run is not executable"
