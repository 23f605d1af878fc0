"""`attn-backends check` on vLLM's own Triton attention backend through adapters/vllm_adapter, against the
released version installed by adapters/install_engines.sh (vllm-0.33.0 under $ATTN_ENGINES_DIR, default
/tmp/engines). Each run is a subprocess; skipped, with the command that installs it, where the folder is
absent."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attn_backends import ForwardMode

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "adapters" / "vllm_adapter"
ENGINES = Path(os.environ.get("ATTN_ENGINES_DIR", "/tmp/engines"))
VERSION = "0.33.0"
BACKEND = "vllm_adapter.triton:VLLMTritonBackend"
LAYOUT_INVARIANTS = {"I1", "I2", "I3", "I4", "I5", "I6", "I9n", "I13", "I14", "I15"}
EAGER_ONLY = {"I2", "I13", "I15"}       # EXTEND is never captured: no capture, replay or its preparation


def engine() -> Path:
    target = ENGINES / f"vllm-{VERSION}"
    if not (target / f"vllm-{VERSION}.dist-info").is_dir():
        pytest.skip(f"vLLM {VERSION} is not installed in {target}: "
                    f"ENGINES_DIR={ENGINES} adapters/install_engines.sh vllm-{VERSION}")
    return target


def check(backend: str, mode, tmp_path: Path, cases: int = 2) -> dict:
    """The layout suite on ``backend`` (every declared mode where ``mode`` is None), in a subprocess; the
    --json result by (mode, invariant) under ``by_mode``."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(path + [str(ROOT), str(ADAPTER), str(engine())])}
    out = tmp_path / f"vllm-{mode or 'all'}.json"
    res = subprocess.run([sys.executable, "-m", "attn_backends.check.cli", "check", "--backend", backend,
                          "--device", "cpu", "--suite", "layout", *(["--mode", mode] if mode else []),
                          "--cases", str(cases), "--json", str(out)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.exists(), f"check wrote no result (exit {res.returncode}): {res.stderr[-2000:]}"
    data = json.loads(out.read_text())
    (be,) = data["backends"]
    by_mode: dict = {}
    for c in be["checks"]:
        by_mode.setdefault(c["mode"], {})[c["invariant"]] = (c["passed"], c["failed"])
    return {"status": data["status"], "rc": res.returncode, "by_mode": by_mode, "failures": be.get("failures", []),
            "stdout": res.stdout}


def messages(r: dict, inv: str) -> list:
    return [f["message"] for f in r["failures"] if f["invariant"] == inv]


def test_vllm_triton_declares_what_vllm_serves():
    """Decode, extend, chain verify and draft extend (vLLM's draft prefill: the target's batch shape and
    metadata); sinks and softcap (its kernel's); no tree verify (vLLM has none), no draft decode, no topk > 1;
    pages of vLLM's block sizes (multiples of 16). Read without vLLM installed (the adapter imports vLLM in
    its constructor only)."""
    caps = _adapter_class().capabilities
    assert caps.modes == frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                                    ForwardMode.DRAFT_EXTEND})
    assert not caps.topk_gt1 and not caps.draft_decode and not caps.mla
    assert caps.sinks and caps.softcap and not caps.windows    # windows: vLLM's runner masks blocks below them
    assert all(ps % 16 == 0 for ps in caps.page_sizes)


def _adapter_class():
    sys.path.insert(0, str(ADAPTER))
    try:
        from vllm_adapter.triton import VLLMTritonBackend
    finally:
        sys.path.remove(str(ADAPTER))
    return VLLMTritonBackend


def test_vllm_triton_refuses_pages_vllm_does_not_take():
    """Pages of 1 (SGLang's token pages) are no vLLM block size: a one-line error before vLLM is imported."""
    from attn_backends import KVMemory, ModelConfig
    cfg = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=1)
    mem = KVMemory(num_layers=1, num_pages=64, page_size=1, max_reqs=4, max_context_len=64, is_mla=False,
                   num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match=r"multiples of 16 only .*page_size=1$"):
        _adapter_class()(cfg, mem)


def test_vllm_triton_passes_the_layout_suite(tmp_path):
    """vLLM 0.33's builder and unified_attention, one process over the four declared modes: every
    invariant passes (I9n: vLLM's kernel in the interpreter against torch_native)."""
    r = check(BACKEND, None, tmp_path)
    assert set(r["by_mode"]) == {"decode", "extend", "verify_chain", "draft_extend"}, r["by_mode"]
    for mode, checks in r["by_mode"].items():
        want = LAYOUT_INVARIANTS - EAGER_ONLY if mode == "extend" else LAYOUT_INVARIANTS
        assert set(checks) == want and all(p > 0 for p, _ in checks.values()), (mode, checks)
        failed = {inv: pf for inv, pf in checks.items() if pf[1]}
        assert not failed, (mode, failed, r["stdout"][-3000:])
    assert r["rc"] == 0 and r["status"] == 0


def test_the_gate_fails_a_planted_short_seq_lens(tmp_path):
    """vLLM's build() one token short in the runner's seq_lens buffer: every layout against the runner's
    (I1), the KV extent (I5), the capture (I13) and the numbers of vLLM's kernel (I9n) fail. Each I1
    failure names the runner's layout (eager has the plant too; where a replay also differs from eager, it
    is its pad rows: seq_lens -1 is no longer vLLM's pad form, so they are stated as they are)."""
    engine()
    r = check(str(Path(__file__).with_name("vllm_planted.py")) + ":ShortSeqLensBackend", "decode", tmp_path)
    c = r["by_mode"]["decode"]
    assert r["rc"] == 1 and c["I1"] == (0, 6) and c["I5"] == (0, 6) and c["I9n"] == (0, 4), c
    assert c["I13"][1] == 2 and c["I2"][1] == 0 and c["I15"][1] == 0, c
    assert all("!= prefix" in m for m in messages(r, "I5")), messages(r, "I5")
    assert all("runner positions" in m for m in messages(r, "I1")), messages(r, "I1")


def test_the_gate_fails_a_planted_captured_copy(tmp_path):
    """build_for_cudagraph_capture hands the graph a copy of seq_lens: replays read the capture's lengths
    (1), so replay != eager (I1) and the replayed outputs are off (I9n); the eager ones are right."""
    engine()
    r = check(str(Path(__file__).with_name("vllm_planted.py")) + ":CapturedCopyBackend", "decode", tmp_path)
    c = r["by_mode"]["decode"]
    assert r["rc"] == 1 and c["I1"] == (0, 6), c
    assert all("replay != eager" in m for m in messages(r, "I1")), messages(r, "I1")
    assert sum("seq_lens_k: replay != eager" in m for m in messages(r, "I1")) >= 4, messages(r, "I1")
    i9n = messages(r, "I9n")
    assert c["I9n"] == (2, 2) and all(m.startswith("replayed output") for m in i9n), (c, i9n)
