"""``attn-backends check --jobs N``: the layout suite's cases over N worker processes give the
result of one process (the same checks, the same failures in the same order, the same --json),
and a worker that dies is a crashed suite, not a hang or a traceback."""
import json
from pathlib import Path

from attn_backends import cli
from attn_backends.cli_jobs import merge
from attn_backends.testing.report import Failure, SuiteReport

ROOT = Path(__file__).resolve().parents[1]
BUGGY = f"{ROOT / 'tests' / 'planted_bugs.py'}:NoPlusW"     # fails checks in most modes
DIES = ("import os\n"
        "from attn_backends.backends.torch_native import TorchNativeBackend\n"
        "class Dies(TorchNativeBackend):\n"
        "    def init_cuda_graph_state(self, *args, **kwargs):\n"
        "        os._exit(3)\n")


def _check_json(tmp_path, capsys, *extra) -> tuple:
    path = tmp_path / f"out{len(list(tmp_path.iterdir()))}.json"
    status = cli.main(["check", "--backend", BUGGY, "--suite", "layout", "--cases", "3", "--progress-every", "0",
                       "--json", str(path), *extra])
    out = capsys.readouterr().out
    res = json.loads(path.read_text())
    res.pop("command")
    for b in res["backends"]:
        b.pop("seconds")
    return status, res, out


def test_jobs_give_the_result_of_one_process(tmp_path, capsys):
    status1, one, _ = _check_json(tmp_path, capsys)
    status3, three, out = _check_json(tmp_path, capsys, "--jobs", "3")
    assert status1 == status3 == 1
    fails = one["backends"][0]["failures"]
    assert len({f["mode"] for f in fails}) >= 3 and len({f["seed"] for f in fails}) >= 6   # several cases, modes
    assert sum(c["cases"] for c in three["backends"][0]["cases"]) == 18
    assert three == one                   # counts, cases, failures and their order
    assert "checks failed (I1" in out


def test_a_worker_that_dies_is_a_crashed_suite(tmp_path, capsys, monkeypatch):
    (tmp_path / "dies.py").write_text(DIES)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["check", "--backend", "dies.py:Dies", "--suite", "layout", "--mode", "decode", "--cases", "2",
                     "--jobs", "2", "--progress-every", "0"]) == 1
    out = capsys.readouterr().out
    assert "FAIL dies.py:Dies: the layout suite: RuntimeError: a worker process of --jobs 2 died" in out, out
    assert "Traceback" not in out


def test_jobs_below_one_is_a_usage_error(capsys):
    assert cli.main(["check", "--jobs", "0"]) == 2
    assert "--jobs" in capsys.readouterr().err


def test_merge_adds_the_shards_and_restores_the_serial_order():
    def fail(seed, inv):
        return Failure("b", "decode", inv, "m", "c", seed)
    shards = [({("b", "decode", "I1"): [2, 1]}, [fail(5, "I1")], {("b", "decode"): 2}),
              ({("b", "decode", "I1"): [1, 2], ("b", "decode", "I3"): [0, 1]},
               [fail(2, "I1"), fail(2, "I3"), fail(9, "I1")], {("b", "decode"): 1})]
    rep = merge(SuiteReport(), shards)
    assert rep.counts == {("b", "decode", "I1"): [3, 3], ("b", "decode", "I3"): [0, 1]}
    assert rep.cases == {("b", "decode"): 3}
    assert [(f.seed, f.invariant) for f in rep.failures] == [(2, "I1"), (2, "I3"), (5, "I1"), (9, "I1")]



def test_one_case_runs_in_the_one_process(capsys, monkeypatch):
    """A failure's replay command (``--cases 1 --mode M``) with --jobs starts no worker."""
    def no_workers(*args, **kwargs):
        raise AssertionError("workers started for one case")
    monkeypatch.setattr(cli, "run_layout_jobs", no_workers)
    assert cli.main(["check", "--suite", "layout", "--mode", "decode", "--cases", "1", "--jobs", "4",
                     "--progress-every", "0"]) == 0
    assert "torch_native: ok" in capsys.readouterr().out
