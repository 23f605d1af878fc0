"""The `attn-backends` command line, and the README / CI set-up commands it documents."""
import io
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from attn_backends import cli, registry
from attn_backends.testing.report import Failure, SuiteReport

ROOT = Path(__file__).resolve().parents[1]
SUITE = "attn_backends.testing.suite"


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def fake_suite(monkeypatch):
    """Replace ``attn_backends.testing.suite`` by a recorder; ``fail`` plants one failure."""
    calls = []
    mod = types.ModuleType(SUITE)
    mod.fail = False

    def run_suite(backend, *, device="cpu", cases=200, seed=0, modes=None, progress=None):
        calls.append(dict(backend=backend, device=device, cases=cases, seed=seed, progress=progress))
        report = SuiteReport()
        for i in range(2):
            report.cases[(backend, "decode")] += 1
            report.record(backend, "decode", "I1", True)
            if progress:
                progress(i + 1, 2)
        if mod.fail:
            report.fail(Failure(backend, "decode", "I3", "pad row 3 holds 7, expected 0",
                                "decode bs=4 raw_bs=3 prefixes=[1, 2, 3]", seed + 17))
        return report

    mod.run_suite = run_suite
    mod.calls = calls
    monkeypatch.setitem(sys.modules, SUITE, mod)
    mod.extra_calls = []

    def extra_suite(backend, *, device, cases, seed, progress, report):
        mod.extra_calls.append(dict(backend=backend, cases=cases, seed=seed))
        report.cases[(backend, "runner:decode")] += 1
        report.record(backend, "runner:decode", "I8", True)

    monkeypatch.setattr(cli, "_extra_suites", lambda: [("fake_runner", extra_suite)])
    return mod


@pytest.fixture
def isolated_registry(monkeypatch):
    monkeypatch.setattr(registry, "_extra", {})


# --------------------------------------------------------------------------- list

def test_list_names_torch_native_available_and_a_reason_for_every_other(capsys):
    assert cli.main(["list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[2:] if line.strip()}
    assert re.match(r"torch_native\s+yes\s+extend,decode,verify,draft_extend\s+MHA\+MLA\s+1,16,64\s+yes",
                    lines["torch_native"]), lines["torch_native"]
    infos = registry.list_backends("cpu")
    assert {i.name for i in infos} <= set(lines)
    for info in infos:
        if not info.available:
            assert re.match(rf"{info.name}\s+no\s", lines[info.name])
            assert info.reason and info.reason in lines[info.name]


def test_list_gives_the_reason_of_a_backend_that_cannot_load(capsys, isolated_registry):
    registry.register("ghost", "no_such_module_xyz:Ghost")
    assert cli.main(["list", "--device", "cpu"]) == 0
    line = next(li for li in capsys.readouterr().out.splitlines() if li.startswith("ghost"))
    assert "no" in line.split() and "No module named 'no_such_module_xyz'" in line


def test_list_on_cuda_without_a_gpu_says_why(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main(["list", "--device", "cuda"]) == 0
    line = next(li for li in capsys.readouterr().out.splitlines() if li.startswith("torch_native"))
    assert "CUDA is not available on this machine" in line


# --------------------------------------------------------------------------- check, fake suite

def test_check_defaults_and_exit_0(fake_suite, capsys):
    assert cli.main(["check"]) == 0
    assert fake_suite.calls == [dict(backend="torch_native", device="cpu", cases=200, seed=0, progress=None)]
    out = capsys.readouterr().out
    assert "torch_native, layout suite:" in out and "ok 2" in out and "FAIL" not in out


def test_check_exit_1_prints_each_failure_with_its_seed(fake_suite, capsys):
    fake_suite.fail = True
    assert cli.main(["check", "--backend", "torch_native", "--cases", "5", "--seed", "3"]) == 1
    assert fake_suite.calls[0]["cases"] == 5 and fake_suite.calls[0]["seed"] == 3
    out = capsys.readouterr().out
    assert "FAIL 1 of 1" in out                                # the table marks the failed invariant
    assert "pad row 3 holds 7, expected 0" in out
    assert "case: decode bs=4 raw_bs=3 prefixes=[1, 2, 3]" in out
    assert "--seed 20 --cases 1" in out


@pytest.mark.parametrize("argv, message", [
    (["check", "--backend", "nope"], r"backend 'nope' is neither a registered name nor 'module:Class'"),
    (["check", "--backend", "no_such_module_xyz:Backend"], r"cannot load backend class .*no_such_module_xyz"),
    (["check", "--backend", "needs_pkg"], r"not available on cpu: python package 'no_such_pkg_xyz' is not installed"),
])
def test_check_exit_2_for_unknown_or_unavailable_backend(argv, message, fake_suite, capsys,
                                                         isolated_registry, tmp_path, monkeypatch):
    (tmp_path / "needs_pkg_mod.py").write_text(
        "from dataclasses import replace\n"
        "from attn_backends.backends.torch_native import TorchNativeBackend\n"
        "class NeedsPkg(TorchNativeBackend):\n"
        "    capabilities = replace(TorchNativeBackend.capabilities, requires=('no_such_pkg_xyz',))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register("needs_pkg", "needs_pkg_mod:NeedsPkg")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("attn-backends: error: ") and re.search(message, err), err
    assert fake_suite.calls == []                              # nothing ran


def test_check_exit_2_for_cuda_without_a_gpu(fake_suite, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main(["check", "--device", "cuda"]) == 2
    assert "not available on cuda: CUDA is not available" in capsys.readouterr().err


def test_check_all_runs_every_available_backend(fake_suite, capsys):
    assert cli.main(["check", "--backend", "all", "--cases", "1"]) == 0
    available = [i.name for i in registry.list_backends("cpu") if i.available]
    assert [c["backend"] for c in fake_suite.calls] == available and "torch_native" in available


def test_check_runs_the_entry_point_suites_on_the_same_report(fake_suite, capsys):
    assert cli.main(["check", "--cases", "1", "--suite-cases", "7", "--seed", "3"]) == 0
    assert fake_suite.extra_calls == [dict(backend="torch_native", cases=7, seed=3)]
    assert "torch_native, runner suite:" in capsys.readouterr().out
    fake_suite.extra_calls.clear()
    assert cli.main(["check", "--cases", "1", "--suite-cases", "0"]) == 0
    assert fake_suite.extra_calls == []


def test_runner_suite_is_registered():
    """This distribution registers runtime's runner invariants (issue #4 item 8)."""
    from importlib.metadata import entry_points
    eps = {ep.name: ep.value for ep in entry_points(group=cli.SUITES_GROUP)}
    assert eps.get("runner") == "attn_backends_runtime.testing.runner_suite:run_runner_suite", eps


def test_check_passes_module_class_through(fake_suite):
    target = "attn_backends.backends.torch_native:TorchNativeBackend"
    assert cli.main(["check", "--backend", target, "--cases", "1"]) == 0
    assert fake_suite.calls[0]["backend"] == target


def test_check_rejects_zero_cases(fake_suite, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["check", "--cases", "0"])
    assert e.value.code == 2 and "0 must be >= 1" in capsys.readouterr().err


def test_progress_bar_only_on_a_terminal(fake_suite, monkeypatch):
    tty = TTY()
    monkeypatch.setattr(sys, "stderr", tty)
    assert cli.main(["check", "--cases", "2"]) == 0
    assert fake_suite.calls[0]["progress"] is not None
    drawn = tty.getvalue()
    assert drawn.startswith("\rtorch_native [") and "] 1/2" in drawn and drawn.rstrip().endswith("s")
    assert "#" * 30 + "] 2/2" in drawn and drawn.endswith("\n")

    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    fake_suite.calls.clear()
    assert cli.main(["check", "--cases", "2"]) == 0
    assert fake_suite.calls[0]["progress"] is None and pipe.getvalue() == ""


# --------------------------------------------------------------------------- check, real suite

def test_check_torch_native_for_real(capsys):
    pytest.importorskip(SUITE, reason=f"{SUITE} is not importable yet")
    assert cli.main(["check", "--backend", "torch_native", "--cases", "2", "--suite-cases", "6"]) == 0
    out = capsys.readouterr().out
    assert "torch_native: ok" in out and "FAIL" not in out
    assert "torch_native, runner suite:" in out   # the runner invariants ran too


def test_module_entry_point_runs_in_a_subprocess():
    res = subprocess.run([sys.executable, "-m", "attn_backends.cli", "list", "--device", "cpu"],
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
    assert tests.endswith("pip install -e '.[test]' && ruff check . && python -m pytest -q")
    others = [body for lang, body in blocks if lang not in ("bash", "sh", "shell", "console")]
    assert not any("pip install" in body for body in others)


def test_ci_runs_the_readme_test_command():
    _, tests = setup_blocks()[0]
    ci = ROOT / ".ci" / "run"
    script = ci.read_text()
    assert script.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in script
    assert tests in script.splitlines()
    assert ci.stat().st_mode & 0o111, ".ci/run is not executable"
