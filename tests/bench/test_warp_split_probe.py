"""bench/probes/warp_split_decode.py on the CPU: the prototype chunk pass whose warps walk their own keys equals the
float64 reference on ragged batches whose long requests take several chunks (the merge pass), on float32 and e4m3
caches and a bf16 q on e4m3 (the per-row float16 q of a bf16 model's FP8 path), under the interpreter;
its sm_90 compile at one shape spills nothing and reports the loops it compares."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "bench" / "probes" / "warp_split_decode.py"
sys.path.insert(0, str(PROBE.parent))
import offline_sm90  # noqa: E402


def run(*args: str, interpret: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), **({"TRITON_INTERPRET": "1"} if interpret else {}))
    done = subprocess.run([sys.executable, str(PROBE), *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_prototype_matches_float64_on_ragged_batches():
    errs = [float(e) for e in re.findall(r"rel err (\S+)", run("--check", interpret=True))]
    # float32 q (two caches of its dtype, one e4m3); bf16 q on e4m3, q made float16 and P rounded to it as ours does
    assert len(errs) == 4 and max(errs[:3]) < 1e-4 and errs[3] < 1e-3, errs


@pytest.mark.skipif(not offline_sm90.available(), reason="this Triton bundles no ptxas / cuobjdump")
def test_prototype_compiles_for_sm90_without_spills():
    rows = [line.split("|")[1:-1] for line in run("--offline", "--shapes", "32/8x64", interpret=False).splitlines()
            if line.startswith("| 32/8")]
    assert len(rows) == 4, rows
    for label, regs, spill, smem, loop, per_key in rows:
        assert int(spill) == 0 and int(loop) > 0 and float(per_key) > 0, (label, spill, loop)
    ours = float(rows[-1][5])
    assert "ours" in rows[-1][0] and all(float(r[5]) < ours for r in rows[:-1]), rows
