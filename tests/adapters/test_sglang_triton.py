"""`attn-backends check` on SGLang's own TritonAttnBackend through adapters/sglang_adapter, against
the released versions installed by adapters/install_engines.sh (one target folder per version, under
$ATTN_ENGINES_DIR, default /tmp/engines). Each run is a subprocess: one SGLang version per process.
Skipped, with the command that installs it, where a version's folder is absent."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "adapters" / "sglang_adapter"
ENGINES = Path(os.environ.get("ATTN_ENGINES_DIR", "/tmp/engines"))
BACKEND = "sglang_adapter.triton:SGLangTritonBackend"
LAYOUT_INVARIANTS = {"I1", "I2", "I3", "I4", "I5", "I6", "I9n", "I13", "I14", "I15"}


def engine(version: str) -> Path:
    target = ENGINES / f"sglang-{version}"
    if not (target / f"sglang-{version}.dist-info").is_dir():
        pytest.skip(f"SGLang {version} is not installed in {target}: "
                    f"ENGINES_DIR={ENGINES} adapters/install_engines.sh {version}")
    return target


def check(version: str, backend: str, mode: str, tmp_path: Path, cases: int = 2) -> dict:
    """Run the layout suite on ``backend`` with SGLang ``version``; the --json result, by (mode, invariant)."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(path + [str(ROOT), str(ADAPTER), str(engine(version))])}
    out = tmp_path / f"{version}-{mode}.json"
    res = subprocess.run([sys.executable, "-m", "attn_backends.check.cli", "check", "--backend", backend,
                          "--device", "cpu", "--suite", "layout", "--mode", mode, "--cases", str(cases),
                          "--json", str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.exists(), f"check wrote no result (exit {res.returncode}): {res.stderr[-2000:]}"
    data = json.loads(out.read_text())
    (be,) = data["backends"]
    return {"status": data["status"], "rc": res.returncode,
            "checks": {c["invariant"]: (c["passed"], c["failed"]) for c in be["checks"] if c["mode"] == mode},
            "failures": be.get("failures", []), "stdout": res.stdout}


@pytest.mark.parametrize("version", ["0.5.9", "0.5.10"])
@pytest.mark.parametrize("mode", ["decode", "verify_chain"])
def test_sglang_triton_passes_the_layout_suite(version, mode, tmp_path):
    r = check(version, BACKEND, mode, tmp_path)
    assert set(r["checks"]) == LAYOUT_INVARIANTS, r["checks"]
    failed = {inv: pf for inv, pf in r["checks"].items() if pf[1] or not pf[0]}
    assert not failed, f"{failed}\n{r['stdout'][-3000:]}"
    assert r["rc"] == 0 and r["status"] == 0


def test_the_gate_fails_a_planted_short_replay(tmp_path):
    """SGLang's replay made one token short per request: replays fail I1 (!= eager and the runner)
    and I5 (KV extent); the capture (I13) and the eager metadata are SGLang's and pass."""
    version = "0.5.10"
    engine(version)
    planted = str(Path(__file__).with_name("sglang_planted.py")) + ":ShortReplayBackend"
    r = check(version, planted, "decode", tmp_path)
    assert r["rc"] == 1 and r["status"] == 1
    assert r["checks"]["I1"][1] > 0 and r["checks"]["I5"][1] > 0, r["checks"]
    assert r["checks"]["I13"] == (4, 0), r["checks"]
