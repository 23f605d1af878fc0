"""``attn-backends check --kv-dtype``: the layout and runner suites (and the runner suite's tiny
engine) on FP8 KV pools with scales other than 1, a reader blind to V's scale caught there and
only there, with replay lines that carry the flag; a backend that does not read the dtype refused
in one line, and ``--backend all`` naming those it leaves out."""
import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

from attn_backends.check import cli
from attn_backends.kv_cache import KVMemory

SUPPORT = Path(__file__).resolve().parents[1] / "support"


def _check(monkeypatch, tmp_path, *argv) -> tuple:
    monkeypatch.chdir(SUPPORT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    out = tmp_path / "check.json"
    code = cli.main(["check", *argv, "--cases", "2", "--suite-cases", "8", "--progress-every", "0", "--json", str(out)])
    return code, json.loads(out.read_text())["backends"][0]


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_every_pool_of_the_suites_is_fp8(monkeypatch, tmp_path, kv):
    made = []
    init = KVMemory.__init__
    spy = lambda self, *a, **k: (made.append(k.get("dtype")), init(self, *a, **k))[1]  # noqa: E731
    monkeypatch.setattr(KVMemory, "__init__", spy)
    code, res = _check(monkeypatch, tmp_path, "--backend", "torch_native", "--kv-dtype", kv)
    assert code == 0 and res["ok"], res
    want = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv]
    assert len(made) > 20 and set(made) == {want}, made


def test_a_reader_blind_to_v_scale_is_caught_on_fp8_only(monkeypatch, tmp_path):
    target = "planted_bugs:ScaleBlindV"
    assert _check(monkeypatch, tmp_path, "--backend", target)[0] == 0
    code, res = _check(monkeypatch, tmp_path, "--backend", target, "--kv-dtype", "fp8_e4m3")
    assert code == 1
    found = {(f["suite"], f["invariant"]) for f in res["failures"]}
    assert ("layout", "I9n") in found and ("runner", "I9") in found, found
    assert all(" --kv-dtype fp8_e4m3 " in f["replay"] and f["kv_dtype"] == "fp8_e4m3" for f in res["failures"])


def test_a_backend_that_does_not_read_the_dtype_is_refused_in_one_line(capsys):
    assert cli.main(["check", "--backend", "trtllm_mla", "--kv-dtype", "fp8_e4m3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["attn-backends: error: backend 'trtllm_mla' does not read an fp8_e4m3 KV cache here (it reads "
                   "the model's dtype)"], err


def test_all_runs_the_backends_that_read_the_dtype_and_names_the_others(capsys):
    from attn_backends import registry
    backends = [(n, registry.get_backend_class(n)) for n in ("torch_native", "trtllm_mla", "triton")]
    args = argparse.Namespace(kv_dtype="fp8_e5m2", device="cpu")
    kept, left = cli._check_kv_dtype(args, backends)
    assert [n for n, _ in kept] == ["torch_native", "triton"] and left == ["trtllm_mla (it reads the model's dtype)"]
    assert cli._check_kv_dtype(argparse.Namespace(kv_dtype="model", device="cpu"), backends) == (backends, [])
    with pytest.raises(cli.UsageError, match="no backend available on cpu reads an fp8_e5m2 KV cache"):
        cli._check_kv_dtype(args, backends[1:2] * 2)


def test_check_leaves_out_the_backends_this_gpu_cannot_read_fp8_on(monkeypatch):
    """On a GPU the FP8 floor (and ceiling) of each backend against this GPU's compute capability:
    left out with the reason, not run to fail in its constructor."""
    from attn_backends import registry
    from attn_backends.backends.flashinfer_mla import FlashInferMLABackend
    backends = [(n, registry.get_backend_class(n)) for n in ("torch_native", "triton")]
    backends.append(("flashinfer_mla", FlashInferMLABackend))
    args = argparse.Namespace(kv_dtype="fp8_e4m3", device="cuda")
    for sm, kept, left in ((80, ["torch_native"], ["triton (an FP8 KV cache needs sm_89+ (FP8 conversions), "
                                                   "device is sm_80)", "flashinfer_mla (an FP8 KV cache needs sm_90+ "
                                                   "(FP8 conversions), device is sm_80)"]),
                           (90, ["torch_native", "triton", "flashinfer_mla"], []),
                           (100, ["torch_native", "triton"], ["flashinfer_mla (an FP8 KV cache is read below sm_100 "
                                                              "only, device is sm_100)"])):
        monkeypatch.setattr(registry, "device_sm", lambda sm=sm: sm)
        got = cli._check_kv_dtype(args, backends)
        assert ([n for n, _ in got[0]], got[1]) == (kept, left), sm


def test_list_names_the_kv_dtypes_each_backend_reads(capsys):
    from test_cli import _list_blocks
    assert cli.main(["list", "--device", "cpu"]) == 0
    blocks = _list_blocks(capsys.readouterr().out)
    reads = "KV caches: model's, fp8_e4m3, fp8_e5m2"
    for name in ("torch_native", "triton", "triton_mla", "flashinfer"):
        assert any(reads in ln for ln in blocks[name][1]), (name, blocks[name])
    assert any("KV caches: model's, fp8_e4m3" in ln and "e5m2" not in ln for ln in blocks["flashinfer_mla"][1])
    assert not any("KV caches" in ln for ln in blocks["trtllm_mla"][1]), blocks["trtllm_mla"]


def test_an_entry_point_suite_without_the_keyword_is_left_out_with_a_note(monkeypatch, capsys):
    calls = []

    def old_suite(backend, *, device, cases, seed, progress=None, report=None):
        calls.append(backend)
        return report
    monkeypatch.setattr(cli, "_extra_suites", lambda: [("old", lambda: old_suite)])
    argv = ["check", "--backend", "torch_native", "--cases", "1", "--suite-cases", "2", "--progress-every", "0"]
    assert cli.main(argv + ["--kv-dtype", "fp8_e4m3"]) == 0
    err = capsys.readouterr().err
    assert calls == [] and "note: the old suite takes no kv_dtype: not run at --kv-dtype fp8_e4m3" in err
    assert cli.main(argv) == 0 and calls == ["torch_native"]
