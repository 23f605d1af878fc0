"""What "lossless" holds on the GPU (issue #38 item 5): EAGLE tokens against plain decode's, and plain
decode at bs 1 against bs 8 (request 0's prompt is the same at both: prompts are drawn in order from
the seed), on the bench-size models in bfloat16 and float32. Usage: ``python bench/probes/probe_lossless.py``
(CUDA; about a minute on an H200)."""
import io
import re
import sys
from contextlib import redirect_stdout

from attn_backends.check import cli

LINE = re.compile(r"^\[(\d+)\] prompt \d+ tokens -> \d+ tokens \(\w+\): ([\d ]+)$", re.M)


def run(model, backend, dtype, batch, *extra):
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = cli.main(["generate", "--model", model, "--backend", backend, "--device", "cuda", "--size", "bench",
                         "--dtype", dtype, "--batch", str(batch), "--max-tokens", "64", "--prompt-len", "64",
                         "--page-size", "64" if model == "tiny-mla" else "16", *extra])
    assert code == 0
    return {int(m.group(1)): m.group(2).split() for m in LINE.finditer(buf.getvalue())}


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


for model, backend in (("tiny-gqa", "triton"), ("tiny-mla", "triton_mla")):
    for dtype in ("bfloat16", "float32"):
        plain = run(model, backend, dtype, 8, "--spec", "none")
        spec = run(model, backend, dtype, 8, "--spec", "eagle", "--steps", "3")
        one = run(model, backend, dtype, 1, "--spec", "none")
        diff = [r for r in plain if plain[r] != spec[r]]
        print(f"{model} {backend} {dtype}: eagle vs none, requests differing {len(diff)}/8 "
              f"(first differing token index {[first_diff(plain[r], spec[r]) for r in diff]}); "
              f"plain bs 1 vs bs 8 request 0 first difference at {first_diff(plain[0], one[0])}", flush=True)
sys.exit(0)
