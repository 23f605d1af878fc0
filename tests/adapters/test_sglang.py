"""`attn-backends check` on SGLang's own TritonAttnBackend through adapters/sglang_adapter, against
the released versions installed by adapters/install_engines.sh (one target folder per version, under
$ATTN_ENGINES_DIR, default /tmp/engines). Each run is a subprocess: one SGLang version per process.
Skipped, with the command that installs it, where a version's folder is absent."""
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

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


def check(version: str, backend: str, mode: Optional[str], tmp_path: Path, cases: int = 2) -> dict:
    """Run the layout suite on ``backend`` with SGLang ``version`` (every declared mode where ``mode`` is
    None); the --json result, by (mode, invariant) under ``by_mode`` and by invariant of ``mode`` under
    ``checks``."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(path + [str(ROOT), str(ADAPTER), str(engine(version))])}
    out = tmp_path / f"{version}-{mode or 'all'}.json"
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
    return {"status": data["status"], "rc": res.returncode, "checks": by_mode.get(mode, {}), "by_mode": by_mode,
            "failures": be.get("failures", []), "stdout": res.stdout}


@pytest.mark.parametrize("version", ["0.5.9", "0.5.10"])
@pytest.mark.parametrize("mode", ["decode", "verify_chain", "extend"])
def test_sglang_triton_passes_the_layout_suite(version, mode, tmp_path):
    r = check(version, BACKEND, mode, tmp_path)
    # EXTEND is eager only: no capture (I13), replay (I2) or capture/replay preparation (I15)
    want = LAYOUT_INVARIANTS - {"I2", "I13", "I15"} if mode == "extend" else LAYOUT_INVARIANTS
    assert set(r["checks"]) == want, r["checks"]
    failed = {inv: pf for inv, pf in r["checks"].items() if pf[1] or not pf[0]}
    assert not failed, f"{failed}\n{r['stdout'][-3000:]}"
    assert r["rc"] == 0 and r["status"] == 0


@pytest.mark.parametrize("version", ["0.5.9", "0.5.10", "0.5.23"])
def test_sglang_triton_tree_verify_passes_the_layout_suite(version, tmp_path):
    """Tree verify (topk 2-8) through SGLang's verify mask: the draft blocks read back from its
    mask buffer at its mask_indptr equal the runner's trees (I1), pad blocks causal (I3), numbers."""
    r = check(version, "sglang_adapter.triton:SGLangTritonTreeVerify", "verify_tree", tmp_path)
    failed = {inv: pf for inv, pf in r["checks"].items() if pf[1] or not pf[0]}
    assert set(r["checks"]) == LAYOUT_INVARIANTS and not failed, f"{r['checks']}\n{r['stdout'][-3000:]}"
    assert r["rc"] == 0


def test_sglang_0_5_23_triton_layout_suite(tmp_path):
    """SGLang 0.5.23, the in-graph metadata API (init_forward_metadata_out_graph / _in_graph), one
    process over the four declared modes. Extend, decode and verify_chain pass every invariant. Draft
    extend's replay passes (0.5.23 takes the prefix as seq_lens - spec_info.extend_seq_lens_tensor:
    finding (a) is gone), its capture does not: the capture batch has no extend_seq_lens_tensor, so
    the captured kv_indptr counts the N new tokens as prefix again (finding (f)): I13 alone fails."""
    r = check("0.5.23", BACKEND, None, tmp_path, cases=1)
    assert set(r["by_mode"]) == {"extend", "decode", "verify_chain", "draft_extend"}, r["by_mode"]
    for mode, checks in r["by_mode"].items():
        want = LAYOUT_INVARIANTS - {"I2", "I13", "I15"} if mode == "extend" else LAYOUT_INVARIANTS
        assert set(checks) == want and all(p > 0 for p, _ in checks.values()), (mode, checks)
        failed = {inv for inv, (_, f) in checks.items() if f}
        assert failed == ({"I13"} if mode == "draft_extend" else set()), (mode, checks, r["stdout"][-3000:])
    assert r["by_mode"]["draft_extend"]["I13"] == (1, 1)        # the capture fails, the replay batch passes
    (msg,) = messages(r, "I13")
    assert msg.startswith("captured layout") and "seq_lens_k=" in msg and "!= prefix" in msg, msg
    assert r["rc"] == 1


def test_the_gate_fails_a_planted_open_tree_mask(tmp_path):
    engine("0.5.10")
    planted = str(Path(__file__).with_name("sglang_planted.py")) + ":OpenTreeReplayBackend"
    r = check("0.5.10", planted, "verify_tree", tmp_path)
    assert r["rc"] == 1
    assert r["checks"]["I1"] == (0, 6), r["checks"]
    assert all("custom_mask of the real requests != the runner's tree mask" in m for m in messages(r, "I1"))
    assert r["checks"]["I9n"][1] == 2 and all(m.startswith("replayed output") for m in messages(r, "I9n"))


@pytest.mark.parametrize("version", ["0.5.10", "0.5.23"])
def test_the_gate_fails_a_planted_short_replay(version, tmp_path):
    """SGLang's replay made one token short per request (0.5.10: its replay method; 0.5.23: the
    replay's init_forward_metadata_out_graph): replays fail I1 (!= eager and the runner) and I5 (KV
    extent); the capture (I13) and the eager metadata are SGLang's and pass."""
    engine(version)
    planted = str(Path(__file__).with_name("sglang_planted.py")) + ":ShortReplayBackend"
    r = check(version, planted, "decode", tmp_path)
    assert r["rc"] == 1 and r["status"] == 1
    assert r["checks"]["I1"][1] > 0 and r["checks"]["I5"][1] > 0, r["checks"]
    assert r["checks"]["I13"] == (4, 0), r["checks"]


def messages(r: dict, inv: str) -> list:
    return [f["message"] for f in r["failures"] if f["invariant"] == inv]


@pytest.mark.parametrize("version", ["0.5.9", "0.5.10"])
def test_sglang_triton_draft_extend_graph_reads_the_new_rows_twice(version, tmp_path):
    """DRAFT_EXTEND_V2 (N rows a request, seq_lens counting them): SGLang's eager metadata is the
    extend branch (prefix = extend_prefix_lens) and its numbers hold; capture and replay set
    kv_indptr from seq_lens, so the extend kernel reads the N new tokens as prefix and again as its
    rows: replay != eager (I1), seq_lens_k = prefix + 2N (I5), wrong replayed outputs (I9n)."""
    r = check(version, BACKEND, "draft_extend", tmp_path)
    assert r["rc"] == 1
    for inv in ("I2", "I14", "I15"):
        assert r["checks"][inv][1] == 0 and r["checks"][inv][0] > 0, (inv, r["checks"])
    assert r["checks"]["I5"] == (0, 6), r["checks"]
    assert all("seq_lens_k: replay != eager" in m for m in messages(r, "I1")), messages(r, "I1")
    i9n = messages(r, "I9n")
    assert i9n and all(m.startswith("replayed output") for m in i9n), i9n      # eager: right
    assert r["checks"]["I9n"] == (2, 2), r["checks"]
    packed = [m for m in messages(r, "I1") if "cu_seqlens_q: replay != eager" in m]
    if version == "0.5.9":      # replay: qo_indptr = cumsum(accept_length), packed; capture: the stride
        assert len(packed) == 6, messages(r, "I1")
    else:                       # 0.5.10 replays the stride
        assert not packed, packed


KV_INDPTR0 = """
import torch
from sglang_adapter import engine, ingraph
from attn_backends import ModelConfig
from attn_backends.kv_cache import KVMemory
engine.sglang()
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
cfg = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=1)
mem = KVMemory(num_layers=1, num_pages=64, page_size=1, max_reqs=4, max_context_len=16, is_mla=False,
               num_kv_heads=2, head_dim=16)
mem.req_to_token[1, :5] = torch.arange(10, 15, dtype=torch.int32)
mem.req_to_token[2, :3] = torch.arange(20, 23, dtype=torch.int32)
new = ingraph.in_graph_api()
be = TritonAttnBackend((ingraph.StandInRunner13 if new else engine.StandInRunner)(cfg, mem, engine.ServerArgs()))
be.init_cuda_graph_state(2, 2)
req, seq = torch.tensor([1, 2]), torch.tensor([5, 3], dtype=torch.int32)
def batch():   # 0.5.13+: the padded batch a graph runner hands the out-of-graph prep
    z = torch.zeros(2, dtype=torch.int64)
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=2, input_ids=z, req_pool_indices=req, seq_lens=seq,
                      out_cache_loc=z, seq_lens_sum=8, seq_lens_cpu=seq, positions=z)
    be.kv_index_translator.bind_own_plan(fb)
    return fb
if new:
    be.init_forward_metadata_out_graph(batch(), in_capture=True)
else:
    be.init_forward_metadata_capture_cuda_graph(2, 2, req, seq, None, ForwardMode.DECODE, None)
be.kv_indptr[0] = 4
be.cuda_graph_kv_indices.zero_()
if new:
    be.init_forward_metadata_out_graph(batch())
else:
    be.init_forward_metadata_replay_cuda_graph(2, req, seq, 8, None, ForwardMode.DECODE, None, seq)
print(be.kv_indptr[:3].tolist(), be.cuda_graph_kv_indices[:9].tolist())
"""


@pytest.mark.parametrize("version", ["0.5.9", "0.5.10", "0.5.23"])
def test_sglang_triton_replay_keeps_kv_indptr0(version):
    """The decode replay writes kv_indptr[1:bs+1] only and its index kernel starts request 0 at
    kv_indptr[0]: a stale entry 0 (4 here) survives the replay and shifts request 0's slots onto
    request 1's (why the adapter leaves entry 0 out of the poisoning). 0.5.23 too (its replay's
    out-of-graph prep, _fill_kv_indptr_and_indices)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(ROOT), str(ADAPTER),
                                                                                   str(engine(version))])}
    res = subprocess.run([sys.executable, "-c", KV_INDPTR0], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[4, 5, 8] [0, 0, 0, 0, 10, 20, 21, 22, 14]"


TRTLLM = "sglang_adapter.trtllm_mla:SGLangTRTLLMMLABackend"


@pytest.mark.parametrize("version", ["0.5.9", "0.5.10"])
@pytest.mark.parametrize("mode", ["decode", "verify_chain", "draft_extend"])
def test_sglang_trtllm_mla_layout(version, mode, tmp_path):
    """SGLang's TRTLLMMLABackend, metadata only (its trtllm-gen forward is CUDA-only: every I9n check
    fails with that reason, the contract having no layout-only declaration). The issue's anchor:
    0.5.9's draft-extend replay packs cu_seqlens_q by accept_length + 1 (and, without host accept
    lengths, sets max_seq_len_q = 1) where the capture and the graph's rows keep the stride N;
    0.5.10 replays the stride (SGLang PR #21987)."""
    r = check(version, TRTLLM, mode, tmp_path)
    assert r["rc"] == 1 and set(r["checks"]) == LAYOUT_INVARIANTS, r["checks"]
    assert r["checks"]["I9n"] == (0, 4)
    assert all("forward failed: NotImplementedError" in m and "trtllm-gen" in m for m in messages(r, "I9n"))
    failed = {inv for inv, (_, f) in r["checks"].items() if f and inv != "I9n"}
    if version == "0.5.9" and mode == "draft_extend":
        assert failed == {"I1", "I4", "I5"}, r["checks"]
        assert r["checks"]["I1"] == (0, 6)
        assert all("cu_seqlens_q: replay != eager" in m and "max_seq_len_q: 1 vs" in m for m in messages(r, "I1"))
    else:
        assert not failed, (r["checks"], r["stdout"][-3000:])
