"""``attn-backends generate``: speculative output equals plain output through the command line
(EAGLE and EAGLE-3, topk 1 and > 1), the summary, progress lines off a terminal, clear errors."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attn_backends import cli

LINE = re.compile(r"^\[(\d+)\] prompt (\d+) tokens -> (\d+) tokens \((\w+)\): ([\d ]+)$")
BASE = ["generate", "--model", "tiny-gqa", "--backend", "torch_native", "--device", "cpu"]
SMALL = ["--batch", "3", "--max-tokens", "16"]


def tokens_of(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            out[int(m.group(1))] = [int(t) for t in m.group(5).split()]
    return out


def generate(capsys, *args) -> tuple:
    code = cli.main(BASE + list(args))
    cap = capsys.readouterr()
    assert code == 0, cap.err
    return tokens_of(cap.out), cap.out, cap.err


@pytest.fixture(scope="module")
def plain_small():
    return {}


@pytest.mark.parametrize("spec,topk,steps,n", [("eagle", 1, 3, 4), ("eagle3", 1, 2, 3), ("eagle", 2, 3, 5),
                                               ("eagle3", 3, 2, 4)])
def test_spec_tokens_equal_plain_tokens(capsys, plain_small, spec, topk, steps, n):
    if not plain_small:
        plain_small.update(generate(capsys, "--spec", "none", *SMALL)[0])
    got, out, err = generate(capsys, "--spec", spec, "--topk", str(topk), "--steps", str(steps),
                             "--draft-tokens", str(n), "--acceptance", "mid", *SMALL)
    assert len(got) == 3 and got == plain_small
    assert f"{spec} topk={topk} steps={steps} N={n} acceptance=mid" in out
    assert re.search(r"accept length: mean \d\.\d\d over \d+ request-rounds \(histogram 1:\d+", out)
    for mode in ("target verify", "draft draft_extend", "draft draft_decode", "target extend", "draft extend"):
        assert re.search(rf"  {mode} +[1-9]\d* / 0$", out, re.M), f"{mode} not replayed:\n{out}"
    assert "generate: 48/48 tokens" in err          # progress lines off a terminal, the last at the end


def test_console_script_eagle_equals_none(capsys):
    """The acceptance command in a fresh process: the installed console script where it sits beside
    this interpreter, else the same ``main`` (either way the command comes from the entry points)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = Path(sys.executable).parent / "attn-backends"
    cmd = [str(script)] if script.exists() else \
        [sys.executable, "-c", "from attn_backends.cli import main; raise SystemExit(main())"]
    runs = {}
    for spec in ("none", "eagle"):
        args = cmd + BASE + ["--spec", spec]
        p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr
        runs[spec] = tokens_of(p.stdout)
    assert len(runs["none"]) == 4 and all(len(t) == 32 for t in runs["none"].values())
    assert runs["eagle"] == runs["none"]


@pytest.mark.parametrize("args,message", [
    (["--model", "tiny-mla", "--backend", "triton"], "backend 'triton' cannot serve this model on cpu: MHA/GQA only"),
    (["--spec", "eagle", "--steps", "2", "--draft-tokens", "4"], "num_draft_tokens=4 exceeds num_steps+1=3"),
    (["--backend", "nope"], "nope"),
])
def test_errors_exit_2_with_the_reason(capsys, args, message):
    code = cli.main(BASE + args)
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_requested_without_cuda(capsys):
    assert cli.main(["generate", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
