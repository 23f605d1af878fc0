"""The console script in a subprocess, as a user runs it: a failure's replay line re-runs
exactly its case (and only it) in seconds, `module:Class` comes from the current folder, and
a closed pipe ends it quietly."""
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attn_backends.check import cli

SUPPORT = Path(__file__).resolve().parents[1] / "support"     # the plants: planted_bugs is a module there
SCRIPT = Path(sys.executable).parent / "attn-backends"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason=f"no console script at {SCRIPT} (pip install -e .)")
REPLAY_SECONDS = 10


def _first_run(monkeypatch, tmp_path, argv: list) -> dict:
    """Run ``check`` in this process from tests/support/ (``planted_bugs`` is a module of that folder)."""
    monkeypatch.chdir(SUPPORT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "first.json"
    assert cli.main(["check", *argv, "--progress-every", "0", "--json", str(out)]) == 1
    return json.loads(out.read_text())["backends"][0]


def _replay(line: str, tmp_path) -> tuple:
    """Run a replay line with the console script from tests/support/; (its json, wall seconds)."""
    argv = shlex.split(line)
    assert argv[:2] == ["attn-backends", "check"], line
    out = tmp_path / "replay.json"
    t0 = time.monotonic()
    res = subprocess.run([str(SCRIPT), *argv[1:], "--json", str(out)], cwd=SUPPORT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    return json.loads(out.read_text())["backends"][0], wall


def _same_case(failures: list, seed: int) -> set:
    return {(f["mode"], f["invariant"], f["message"], f["case"]) for f in failures if f["seed"] == seed}


def test_a_layout_failure_replays_alone_and_the_same_in_seconds(monkeypatch, tmp_path):
    first = _first_run(monkeypatch, tmp_path, ["--backend", "planted_bugs:NoPlusW", "--suite", "layout",
                                               "--cases", "4", "--seed", "11"])
    assert {c["mode"] for c in first["cases"]} == {"decode", "verify_chain", "draft_extend", "extend",
                                                    "verify_tree", "draft_decode"}
    pick = next(f for f in reversed(first["failures"]) if f["mode"] == "verify_tree")
    assert pick["replay"] == ("attn-backends check --backend planted_bugs:NoPlusW --device cpu --suite layout "
                              f"--mode verify_tree --seed {pick['seed']} --cases 1")
    again, wall = _replay(pick["replay"], tmp_path)
    assert again["cases"] == [{"suite": "layout", "mode": "verify_tree", "cases": 1}]     # that case, only it
    assert _same_case(again["failures"], pick["seed"]) == _same_case(first["failures"], pick["seed"])
    assert {f["seed"] for f in again["failures"]} == {pick["seed"]}
    print(f"layout replay: {wall:.1f}s wall")
    assert wall < REPLAY_SECONDS, f"the replay took {wall:.1f}s"


def test_a_runner_failure_replays_alone_and_the_same(monkeypatch, tmp_path):
    first = _first_run(monkeypatch, tmp_path, ["--backend", "planted_bugs:NoisyForward", "--suite", "runner",
                                               "--suite-cases", "1", "--seed", "3"])
    pick = first["failures"][0]
    assert pick["replay"] == ("attn-backends check --backend planted_bugs:NoisyForward --device cpu --suite runner "
                              "--seed 3 --suite-cases 1")
    again, wall = _replay(pick["replay"], tmp_path)
    assert again["cases"] == first["cases"]      # the case first, then one of each other runner kind
    assert {(f["mode"], f["invariant"], f["case"]) for f in again["failures"]} == \
        {(f["mode"], f["invariant"], f["case"]) for f in first["failures"]}
    print(f"runner replay: {wall:.1f}s wall")


def test_a_closed_pipe_ends_quietly():
    p = subprocess.Popen([str(SCRIPT), "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()                     # the reader is gone before the first line (`| head -0`)
    err = p.stderr.read()
    assert p.wait() == cli.EXIT_SIGPIPE and err == b"", err.decode()


def test_misuse_in_a_subprocess_is_one_line_and_exit_2(tmp_path):
    res = subprocess.run([str(SCRIPT), "check", "--backend", "os:path"], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == ("attn-backends: error: 'os:path' is a module, not a subclass of "
                          "attn_backends.AttentionBackend\n")
