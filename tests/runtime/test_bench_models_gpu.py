"""The bench-size models generate on the GPU in every dtype each built-in backend declares
(issue #38.4: float32 `--size bench` prefill on triton_mla failed to launch), graphs and EAGLE
included; in float32 the speculative tokens equal plain decode's (what `generate --help` promises)."""
import re

import pytest

from attn_backends import registry
from attn_backends.check import cli

DTYPE_NAMES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}
LINE = re.compile(r"^\[(\d+)\] prompt \d+ tokens -> (\d+) tokens \((\w+)\): ([\d ]+)$", re.M)
MODEL_BACKENDS = {"tiny-gqa": ["triton", "flashinfer", "hybrid", "torch_native"],
                  "tiny-mla": ["triton_mla", "flashinfer_mla", "trtllm_mla", "hybrid", "torch_native"]}
CASES = [(model, backend, DTYPE_NAMES[str(d)])
         for model, names in MODEL_BACKENDS.items() for backend in names
         for d in registry.get_backend_class(backend).capabilities.dtypes]


def generate(capsys, model, backend, dtype, replayed, *spec) -> dict:
    code = cli.main(["generate", "--model", model, "--backend", backend, "--device", "cuda", "--size", "bench",
                     "--dtype", dtype, "--page-size", "64" if model == "tiny-mla" else "16",
                     "--batch", "3", "--max-tokens", "12", "--prompt-len", "200", *spec])
    cap = capsys.readouterr()
    assert code == 0, cap.err[-3000:]
    got = {int(m.group(1)): m.group(4).split() for m in LINE.finditer(cap.out)}
    assert len(got) == 3 and all(len(t) == 12 for t in got.values()), cap.out
    assert re.search(rf"  target {replayed} +[1-9]\d* / 0$", cap.out, re.M), cap.out   # replayed, no fallback
    return got


@pytest.mark.cuda
@pytest.mark.parametrize("model,backend,dtype", CASES)
def test_bench_model_generates_in_every_declared_dtype(capsys, model, backend, dtype):
    info = {i.name: i for i in registry.list_backends("cuda")}[backend]
    if not info.available:
        pytest.skip(f"{backend}: {info.reason}")
    plain = generate(capsys, model, backend, dtype, "decode", "--spec", "none")
    spec = generate(capsys, model, backend, dtype, "verify", "--spec", "eagle", "--steps", "3", "--topk", "1")
    if dtype == "float32":
        assert spec == plain
