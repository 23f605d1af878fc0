"""docs/plugin-guide.md is enough on its own: its code block is a backend that derives a private
value from the view it is handed (what the guide teaches), and it passes both suites of `check`
and serves `generate` the reference's tokens. The runners' prep placement is what makes that
true (a backend that overrides ``_update`` gets the layout built before its update); forced into
the step's graph, the same backend is one step stale, and both suites say so."""
import re
from pathlib import Path

import pytest
from test_generate import BASE, SMALL, generate

import attn_backends.check.suite as suite_mod
import attn_backends_runtime.draft as draft_mod
import attn_backends_runtime.runner_base as runner_base_mod
from attn_backends.check import cli
from attn_backends.check.report import INVARIANTS
from attn_backends.check.suite import run_suite
from attn_backends.registry import load_class
from attn_backends.step import Prep
from attn_backends_runtime.testing.runner_suite import run_runner_suite

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "plugin-guide.md"


@pytest.fixture(scope="module")
def guide_file(tmp_path_factory):
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    code = [b for b in blocks if "class GuideBackend" in b]
    assert len(code) == 1, f"{len(code)} code blocks define GuideBackend"
    path = tmp_path_factory.mktemp("guide") / "guide.py"
    path.write_text(code[0])
    return f"{path}:GuideBackend"


def test_the_guide_backend_passes_check(capsys, guide_file):
    """``attn-backends check`` on the guide's block: both suites, exit 0."""
    code = cli.main(["check", "--backend", guide_file, "--cases", "3", "--suite-cases", "5", "--seed", "4"])
    out = capsys.readouterr().out
    assert code == 0 and "GuideBackend: ok" in out and "runner 5 cases" in out, out[-3000:]


def test_the_guide_backend_serves_the_reference_tokens(capsys, guide_file):
    args = ["--spec", "eagle", "--topk", "2", "--steps", "2", "--draft-tokens", "3", *SMALL]
    want = generate(capsys, *args)[0]
    got = generate(capsys, "--backend", guide_file, *args)[0]
    assert BASE[4] == "torch_native" and len(want) == 3 and got == want


def test_forced_into_the_step_graph_the_guide_backend_is_caught(monkeypatch, guide_file):
    """The trap the placement closes: the layout built after ``_update`` (as the step's graph would
    build it) leaves the backend's copy one step stale; the runner suite fails I9 and the layout
    suite fails I9n with a message that names the cause."""
    for mod in (suite_mod, runner_base_mod, draft_mod):
        monkeypatch.setattr(mod, "prep_placement", lambda backends: Prep.IN_STEP_GRAPH)
    runner = run_runner_suite(guide_file, cases=5, seed=2)
    assert {f.invariant for f in runner.failures} & {"I9", "I10"}, runner.failures[:3]
    layout = run_suite(load_class(guide_file), cases=3, seed=4, modes=["decode"])
    stale = [f for f in layout.failures if f.invariant == "I9n"]
    assert stale and all("one step stale" in f.message for f in stale), layout.failures[:3]


def test_the_guide_lists_the_invariants_check_reports():
    text = GUIDE.read_text()
    section = text[text.index("## 6. The invariants"):text.index("## 7.")]
    listed = set(re.findall(r"\bI\d+n?\b", section))
    assert listed == set(INVARIANTS), (sorted(set(INVARIANTS) - listed), sorted(listed - set(INVARIANTS)))
