"""``attn-backends generate``: speculative output equals plain output through the command line
(EAGLE and EAGLE-3, topk 1 and > 1, a shallow draft, the most steps), the summary, progress lines
off a terminal, misuse refused in one line before the engine is built, what --help promises."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attn_backends.check import cli
from attn_backends_runtime import generate as generate_mod
from attn_backends_runtime import limits
from attn_backends_runtime.eagle import MAX_STEPS

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
        [sys.executable, "-c", "from attn_backends.check.cli import main; raise SystemExit(main())"]
    runs = {}
    for spec in ("none", "eagle"):
        args = cmd + BASE + ["--spec", spec]
        p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr
        runs[spec] = tokens_of(p.stdout)
    assert len(runs["none"]) == 4 and all(len(t) == 32 for t in runs["none"].values())
    assert runs["eagle"] == runs["none"]


def test_a_one_layer_draft_serves_the_plain_tokens(capsys, plain_small):
    """``--draft-layers 1`` of a 2-layer target: a cheaper draft, rejected more often, the same tokens."""
    if not plain_small:
        plain_small.update(generate(capsys, "--spec", "none", *SMALL)[0])
    got, out, _ = generate(capsys, "--spec", "eagle", "--draft-layers", "1", *SMALL)
    assert len(got) == 3 and got == plain_small
    mean = float(re.search(r"accept length: mean (\d\.\d\d)", out).group(1))
    assert mean < 4, out                        # N = 4: the shallow draft is not always accepted


def test_the_most_steps_run_with_graphs(capsys):
    """``--steps 65`` (64 draft forwards, one graph) at one request, the smallest bucket: the tokens
    of plain decode, every draft step replayed."""
    args = ["--batch", "1", "--max-tokens", "3", "--prompt-len", "8"]
    plain = generate(capsys, "--spec", "none", *args)[0]
    got, out, _ = generate(capsys, "--spec", "eagle", "--steps", str(MAX_STEPS), *args)
    assert got == plain and len(got[0]) == 3
    assert re.search(r"  draft draft_decode +[1-9]\d* / 0$", out, re.M), out


@pytest.mark.parametrize("model,backend,kv", [("tiny-gqa", "torch_native", "fp8_e4m3"),
                                              ("tiny-gqa", "torch_native", "fp8_e5m2"),
                                              ("tiny-gqa", "triton", "fp8_e4m3"),
                                              ("tiny-mla", "torch_native", "fp8_e4m3"),
                                              ("tiny-mla", "triton_mla", "fp8_e4m3")])
def test_eagle_on_an_fp8_cache_serves_plain_decode_tokens_on_the_same_cache(capsys, model, backend, kv):
    """``--kv-dtype``: EAGLE (a tree) over an FP8 cache gives plain decode's tokens over the same
    FP8 cache (float32 model); the cache is read (some token differs from the float32 cache's)."""
    args = ["--model", model, "--backend", backend, "--batch", "2", "--max-tokens", "7"]
    plain, out, _ = generate(capsys, "--spec", "none", "--kv-dtype", kv, *args)
    got, _, _ = generate(capsys, "--spec", "eagle", "--topk", "2", "--steps", "2", "--draft-tokens", "4",
                         "--kv-dtype", kv, *args)
    assert len(plain) == 2 and all(len(t) == 7 for t in plain.values()) and got == plain
    assert f"(cpu, float32, KV {kv}, graphs)" in out, out
    assert generate(capsys, "--spec", "none", *args)[0] != plain, "the FP8 cache changed no token"


def test_an_fp8_cache_halves_the_kv_pool():
    parse = lambda *a: generate_mod.engine_config(cli.build_parser().parse_args(BASE + list(a)))  # noqa: E731
    bf16, fp8 = (limits.engine_bytes(parse("--dtype", "bfloat16", *kv)) for kv in ([], ["--kv-dtype", "fp8_e4m3"]))
    assert bf16["the KV pool"] == 2 * fp8["the KV pool"] > 0 and bf16["the weights"] == fp8["the weights"]


def one_line_error(capsys, args) -> str:
    code = cli.main(BASE + args)
    cap = capsys.readouterr()
    lines = cap.err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("attn-backends: error: "), (code, cap.err)
    assert cap.out == ""
    return lines[0]


@pytest.mark.parametrize("args,message", [
    (["--max-tokens", "0"], "argument --max-tokens: 0 is below the least value 1"),
    (["--prompt-len", "0"], "argument --prompt-len: 0 is below the least value 1"),
    (["--batch", "0"], "argument --batch: 0 is below the least value 1"),
    (["--spec", "eagle", "--steps", "0"], "argument --steps: 0 is below the least value 1"),
    (["--spec", "eagle", "--draft-layers", "0"], "argument --draft-layers: 0 is below the least value 1"),
    (["--spec", "eagle", "--draft-layers", "3"], "--draft-layers 3 exceeds the target's 2 layers"),
    (["--spec", "eagle", "--steps", "80"], f"--steps 80 outside 1..{MAX_STEPS}: a round runs at most 64 draft"),
    (["--spec", "eagle", "--steps", str(MAX_STEPS + 1)], f"--steps {MAX_STEPS + 1} outside 1..{MAX_STEPS}"),
    (["--spec", "eagle", "--topk", "129", "--steps", "1"], "--topk 129 exceeds the vocabulary size 128"),
    (["--spec", "eagle", "--steps", "2", "--draft-tokens", "4"], "--draft-tokens 4 outside 2..--steps+1=3"),
    (["--spec", "eagle", "--topk", "2", "--steps", "2", "--draft-tokens", "6"],
     "--draft-tokens 6 outside 2..--steps*--topk+1=5"),
    (["--stop", "5", "128"], "--stop 128 outside the vocabulary 0..127"),
    (["--topk", "2"], "--topk 2 needs --spec eagle or eagle3 (none drafts nothing)"),
    (["--spec", "none", "--steps", "5"], "--steps 5 needs --spec eagle or eagle3"),
    (["--draft-layers", "1"], "--draft-layers 1 needs --spec eagle or eagle3"),
    (["--acceptance", "low"], "--acceptance low needs --spec eagle or eagle3"),
    (["--batch", "1000000000"], "--batch 1000000000 with --prompt-len 16 and --max-tokens 32: the engine would "
                                "take at least"),
    (["--max-tokens", "100000000000"], "--batch 4 with --prompt-len 16 and --max-tokens 100000000000: the engine"),
])
def test_misuse_is_one_line_before_the_engine(capsys, monkeypatch, args, message):
    """Each refusal names the flag, the value and the limit, in the CLI's one-line form, exit 2,
    and comes before the engine (nothing allocated)."""
    monkeypatch.setattr(generate_mod, "Engine", lambda cfg: pytest.fail(f"engine built for {cfg}"))
    line = one_line_error(capsys, args)
    assert message in line, line
    for field in ("max_reqs", "num_draft_tokens", "num_steps", "draft_layers", "max_context_len"):
        assert field not in line, line


def test_a_batch_the_memory_cannot_hold_is_refused_with_the_bytes(capsys, monkeypatch):
    """The memory check compares what the engine would allocate with what the device has free
    (here a patched 64 MiB): the default batch fits, a batch of 4,000 does not."""
    monkeypatch.setattr(limits, "available_bytes", lambda device: (64 << 20, "patched"))
    monkeypatch.setattr(generate_mod, "Engine", lambda cfg: pytest.fail("the engine was built"))
    line = one_line_error(capsys, ["--batch", "4000", "--spec", "eagle"])
    need = int(re.search(r"at least ([\d,]+) bytes", line).group(1).replace(",", ""))
    assert need > 64 << 20 and "67,108,864 bytes (0.1 GiB) available (patched)" in line, line
    assert "--batch 4000 with --prompt-len 16 and --max-tokens 32" in line and "the KV pool" in line, line
    parts = limits.engine_bytes(generate_mod.engine_config(cli.build_parser().parse_args(BASE + ["--spec", "eagle"])))
    assert sum(parts.values()) < 64 << 20, parts


@pytest.mark.parametrize("args,message", [
    (["--model", "tiny-mla", "--backend", "triton"], "backend 'triton' cannot serve this model on cpu: MHA/GQA only"),
    (["--backend", "nope"], "nope"),
    (["--model", "tiny-mla", "--backend", "trtllm_mla", "--kv-dtype", "fp8_e4m3"],
     "backend 'trtllm_mla' cannot serve this model on cpu: KV dtype float8_e4m3fn not read (the model's dtype)"),
])
def test_errors_exit_2_with_the_reason(capsys, args, message):
    assert message in one_line_error(capsys, args)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_requested_without_cuda(capsys):
    assert "--device cuda but CUDA is not available" in one_line_error(capsys, ["--device", "cuda"])


def test_help_and_a_note_say_what_lossless_means(capsys):
    """``--help`` states the float32 guarantee and why bf16 / fp16 can differ; a speculative run in
    another dtype prints a one-line note."""
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    for part in ("equal --spec none's token for token in float32", "bfloat16 / float16",
                 "sum in different orders", "near tie"):
        assert part in text, text
    _, _, err = generate(capsys, "--spec", "eagle", "--dtype", "bfloat16", "--batch", "1", "--max-tokens", "2")
    assert [ln for ln in err.splitlines() if ln.startswith("generate: note: in bfloat16")], err
    _, _, err = generate(capsys, "--spec", "eagle", "--batch", "1", "--max-tokens", "2")
    assert "note" not in err


@pytest.mark.cuda
def test_a_batch_the_gpu_cannot_hold_is_refused_with_its_free_bytes(capsys, monkeypatch):
    """On CUDA the memory check reads ``torch.cuda.mem_get_info``: refused before the engine."""
    monkeypatch.setattr(generate_mod, "Engine", lambda cfg: pytest.fail("the engine was built"))
    line = one_line_error(capsys, ["--device", "cuda", "--batch", "1000000000"])
    assert "--batch 1000000000 with" in line and "available (free on the GPU (torch.cuda.mem_get_info) plus" in line


def test_gpu_memory_held_unused_by_the_allocator_counts_as_free(monkeypatch):
    """A process that used the GPU before keeps blocks in PyTorch's cache: mem_get_info counts them
    as used, yet a new engine can take them."""
    import torch

    from attn_backends_runtime import limits
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (100, 1000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 50)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: 20)
    assert limits.available_bytes("cuda")[0] == 130
