"""`attn-backends check` on SGLang's own attention backends through adapters/sglang_adapter, against the
released versions installed by adapters/install_engines.sh (one target folder per version, under
$ATTN_ENGINES_DIR, default /tmp/engines). One test per version, one subprocess per version
(tests/adapters/sglang_jobs.py: every check and script of the version in one process, SGLang imported
once): its backends' layout suites, the planted bugs, the reproductions of the findings
(docs/engines.md). Each named check below is asserted on its own and every failing one is reported.
Skipped, with the command that installs it, where a version's folder is absent."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ADAPTER = ROOT / "adapters" / "sglang_adapter"
ENGINES = Path(os.environ.get("ATTN_ENGINES_DIR", "/tmp/engines"))
BACKEND = "sglang_adapter.triton:SGLangTritonBackend"
TREE = "sglang_adapter.triton:SGLangTritonTreeVerify"
TRTLLM = "sglang_adapter.trtllm_mla:SGLangTRTLLMMLABackend"
PLANTED = str(Path(__file__).with_name("sglang_planted.py"))
LAYOUT_INVARIANTS = {"I1", "I2", "I3", "I4", "I5", "I6", "I9n", "I13", "I14", "I15"}
EAGER_ONLY = LAYOUT_INVARIANTS - {"I2", "I13", "I15"}     # EXTEND: no capture, replay or their preparation


def engine(version: str) -> Path:
    target = ENGINES / f"sglang-{version}"
    if not (target / f"sglang-{version}.dist-info").is_dir():
        pytest.skip(f"SGLang {version} is not installed in {target}: "
                    f"ENGINES_DIR={ENGINES} adapters/install_engines.sh {version}")
    return target


def run_jobs(version: str, jobs: dict, tmp_path: Path) -> dict:
    """Every job of ``version`` in one process; per check: ``rc``, ``checks`` by mode and invariant
    (``(passed, failed)``), ``failures`` and ``stdout``; per script: ``rc``, ``stdout``, ``error``."""
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(path + [str(ROOT), str(ADAPTER), str(engine(version))])}
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    res = subprocess.run([sys.executable, str(Path(__file__).with_name("sglang_jobs.py")), str(tmp_path / "jobs.json"),
                          str(tmp_path / "results.json")], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0 and (tmp_path / "results.json").exists(), res.stderr[-3000:]
    out = json.loads((tmp_path / "results.json").read_text())
    for r in out.values():
        if "json" not in r:
            continue
        assert r["json"] is not None, f"check wrote no result (exit {r['rc']}): {r['stdout'][-2000:]}"
        (be,) = r["json"]["backends"]
        r["status"], r["failures"], r["checks"] = r["json"]["status"], be.get("failures", []), {}
        for c in be["checks"]:
            r["checks"].setdefault(c["mode"], {})[c["invariant"]] = (c["passed"], c["failed"])
        r["not_run"] = {(c["mode"], c["invariant"]): (c["checks"], c["reason"]) for c in be.get("not_run", [])}
    for name in [n for n in out if ":" in n]:      # "triton:decode", ...: one check per mode, merged by backend
        r, m = out.pop(name), out.setdefault(name.split(":")[0], {"rc": 0, "status": 0, "checks": {}, "failures": [],
                                                                   "stdout": ""})
        m["rc"], m["status"] = max(m["rc"], r["rc"]), max(m["status"], r["status"])
        m["checks"].update(r["checks"])
        m["failures"] += r["failures"]
        m["stdout"] += r["stdout"]
    return out


def messages(r: dict, inv: str, mode: str = None) -> list:
    return [f["message"] for f in r["failures"] if f["invariant"] == inv and mode in (None, f.get("mode"))]


def failed(checks: dict) -> set:
    return {inv for inv, (_, f) in checks.items() if f}


def check(backend: str, mode=None, cases: int = 2) -> dict:
    return {"backend": backend, "mode": mode, "cases": cases}


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


DRAFT_PAD = """
import torch
from sglang_adapter import engine, ingraph
from attn_backends import ModelConfig
from attn_backends.kv_cache import KVMemory
engine.sglang()
from sglang.srt.layers.attention.triton_backend import TritonMultiStepDraftBackend
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.speculative.eagle_info import EagleDraftInput
cfg = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=1)
mem = KVMemory(num_layers=1, num_pages=64, page_size=1, max_reqs=4, max_context_len=16, is_mla=False,
               num_kv_heads=2, head_dim=16)
mem.req_to_token[1, :8] = torch.arange(10, 18, dtype=torch.int32)     # prefix 5, then 3 draft tokens
new = ingraph.in_graph_api()
args = engine.ServerArgs(speculative_num_draft_tokens=4, speculative_num_steps=4, speculative_eagle_topk=1)
runner = (ingraph.StandInRunner13 if new else engine.StandInRunner)(cfg, mem, args)
be = TritonMultiStepDraftBackend(runner, 1, 4)                         # 3 draft forwards
seq = torch.tensor([5, 0], dtype=torch.int32)     # request 1 (prefix 5); a pad row (request row 0, prefix 0)
z = torch.zeros(2, dtype=torch.int64)
fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=2, input_ids=z, req_pool_indices=torch.tensor([1, 0]),
                  seq_lens=seq, seq_lens_cpu=seq, seq_lens_sum=5, out_cache_loc=z, positions=seq.to(torch.int64),
                  spec_info=EagleDraftInput())
fb.req_to_token_pool = runner.req_to_token_pool
if new:
    be.kv_index_translator.bind_own_plan(fb)
be.init_forward_metadata(fb)
print([be.attn_backends[i].forward_metadata.kv_indptr[:3].tolist() for i in range(3)])
"""


# -- the named checks: each takes the version's results (by job name) and the version

def triton_passes(rs, version):
    """SGLang's Triton backend: extend, decode and verify_chain pass every layout invariant."""
    r = rs["triton"]
    for mode in ("extend", "decode", "verify_chain"):
        checks = r["checks"][mode]
        assert set(checks) == (EAGER_ONLY if mode == "extend" else LAYOUT_INVARIANTS), (mode, checks)
        bad = {inv: pf for inv, pf in checks.items() if pf[1] or not pf[0]}
        assert not bad, f"{mode}: {bad}\n{r['stdout'][-3000:]}"


def triton_draft_extend_reads_the_new_rows_twice(rs, version):
    """0.5.9 / 0.5.10 (finding (a)): DRAFT_EXTEND_V2's eager metadata is the extend branch and its numbers
    hold; capture and replay set kv_indptr from seq_lens, so the extend kernel reads the N new tokens as
    prefix and again as its rows: replay != eager (I1), seq_lens_k = prefix + 2N (I5), wrong replayed
    outputs (I9n). 0.5.9 also replays a packed qo_indptr (finding (b)); 0.5.10 the stride."""
    r, mode = rs["triton"], "draft_extend"
    c = r["checks"][mode]
    for inv in ("I2", "I14", "I15"):
        assert c[inv][1] == 0 and c[inv][0] > 0, (inv, c)
    assert c["I5"] == (0, 6), c
    i1 = messages(r, "I1", mode)
    assert i1 and all("seq_lens_k: replay != eager" in m for m in i1), i1
    i9n = messages(r, "I9n", mode)
    assert i9n and all(m.startswith("replayed output") for m in i9n), i9n      # eager: right
    assert c["I9n"] == (2, 2), c
    packed = [m for m in i1 if "cu_seqlens_q: replay != eager" in m]
    if version == "0.5.9":      # replay: qo_indptr = cumsum(accept_length), packed; capture: the stride
        assert len(packed) == 6, i1
    else:                       # 0.5.10 replays the stride
        assert not packed, packed


def triton_0_5_23_draft_extend_capture(rs, version):
    """0.5.23 (finding (f)): draft extend's replay passes (it takes the prefix as seq_lens -
    spec_info.extend_seq_lens_tensor: (a) is gone), its capture does not (the capture batch has no
    extend_seq_lens_tensor, so the captured kv_indptr counts the N new tokens as prefix): I13 alone."""
    c = rs["triton"]["checks"]["draft_extend"]
    assert set(c) == LAYOUT_INVARIANTS and all(p > 0 for p, _ in c.values()), c
    assert failed(c) == {"I13"} and c["I13"] == (1, 1), c        # the capture fails, the replay batch passes
    (msg,) = messages(rs["triton"], "I13", "draft_extend")
    assert msg.startswith("captured layout") and "seq_lens_k=" in msg and "!= prefix" in msg, msg


def triton_draft_decode_reads_draft_step_tokens_of_pad_rows(rs, version):
    """Draft decode (chains) through TritonMultiStepDraftBackend: every layout invariant passes on the
    real rows (I1 replay == eager == the runner's, I5, I9n on SGLang's decode kernel); a pad row reads
    draft_step tokens (finding (g): SGLang's step backend reads prefix + draft_step tokens of every
    row), where the contract's pad rule says max(fill, W): I3 (and I13 on a padded capture) alone, on
    pad rows, with seq_lens_k = draft_step. The reproduction prints its step backends' kv_indptr."""
    r, mode = rs["triton"], "draft_decode"
    c = r["checks"][mode]
    assert set(c) == LAYOUT_INVARIANTS and all(p > 0 for p, _ in c.values()), c
    assert failed(c) <= {"I3", "I13"}, (c, r["stdout"][-3000:])
    for f in (f for f in r["failures"] if f["mode"] == mode):
        step = re.search(r"draft_step=(\d+)", f["case"]).group(1)
        assert re.search(rf"pad row \d+: seq_lens_k={step}, expected fill 1", f["message"]), f
    pad = rs["draft_pad"]
    assert pad["rc"] == 0, pad["error"]
    assert pad["stdout"].strip().splitlines()[-1] == "[[0, 6, 7], [0, 7, 9], [0, 8, 11]]", pad["stdout"]


def triton_rc(rs, version):
    assert rs["triton"]["rc"] == 1 and rs["triton"]["status"] == 1      # draft extend / draft decode fail


def tree_verify_passes(rs, version):
    """Tree verify (topk 2-8) through SGLang's verify mask: the draft blocks read back from its mask
    buffer at its mask_indptr equal the runner's trees (I1), pad blocks causal (I3), numbers."""
    r = rs["tree"]
    c = r["checks"]["verify_tree"]
    bad = {inv: pf for inv, pf in c.items() if pf[1] or not pf[0]}
    assert set(c) == LAYOUT_INVARIANTS and not bad, f"{c}\n{r['stdout'][-3000:]}"
    assert r["rc"] == 0


def trtllm_mla_layout(rs, version):
    """SGLang's TRTLLMMLABackend, metadata only (its trtllm-gen forward is CUDA-only, declared as
    ``Capabilities.layout_only``: every I9n check is reported not run with that reason, finding (e)).
    The issue's anchor: 0.5.9's draft-extend replay packs cu_seqlens_q by accept_length + 1 (and,
    without host accept lengths, sets max_seq_len_q = 1) where the capture and the graph's rows keep the
    stride N (finding (d)); 0.5.10 replays the stride (SGLang PR #21987); 0.5.23 (in-graph metadata)
    passes every layout invariant."""
    r = rs["trtllm"]
    assert set(r["checks"]) == {"decode", "verify_chain", "draft_extend"}, r["checks"]
    for mode, c in r["checks"].items():
        assert set(c) == LAYOUT_INVARIANTS - {"I9n"}, (mode, c)
        assert r["not_run"][(mode, "I9n")][0] == 4 and "trtllm-gen" in r["not_run"][(mode, "I9n")][1], r["not_run"]
        bad = failed(c)
        if version == "0.5.9" and mode == "draft_extend":
            assert bad == {"I1", "I4", "I5"} and c["I1"] == (0, 6), c
            assert all("cu_seqlens_q: replay != eager" in m and "max_seq_len_q: 1 vs" in m
                       for m in messages(r, "I1", mode))
        else:
            assert not bad, (mode, c, r["stdout"][-3000:])
    assert not messages(r, "I9n")
    assert r["rc"] == (1 if version == "0.5.9" else 0), r["stdout"][-3000:]


def kv_indptr0_kept(rs, version):
    """The decode replay writes kv_indptr[1:bs+1] only and its index kernel starts request 0 at
    kv_indptr[0]: a stale entry 0 (4 here) survives the replay and shifts request 0's slots onto
    request 1's (finding (c): why the adapter leaves entry 0 out of the poisoning). 0.5.23 too (its
    replay's out-of-graph prep, _fill_kv_indptr_and_indices)."""
    r = rs["kv_indptr0"]
    assert r["rc"] == 0, r["error"]
    assert r["stdout"].strip().splitlines()[-1] == "[4, 5, 8] [0, 0, 0, 0, 10, 20, 21, 22, 14]"


def planted_open_tree_mask_fails(rs, version):
    r = rs["open_tree"]
    c = r["checks"]["verify_tree"]
    assert r["rc"] == 1 and c["I1"] == (0, 6), c
    assert all("custom_mask of the real requests != the runner's tree mask" in m for m in messages(r, "I1"))
    assert c["I9n"][1] == 2 and all(m.startswith("replayed output") for m in messages(r, "I9n"))


def planted_short_replay_fails(rs, version):
    """SGLang's Triton replay made one token short per request (0.5.10: its replay method; 0.5.23: the
    replay's init_forward_metadata_out_graph): replays fail I1 (!= eager and the runner) and I5; the
    capture (I13) and the eager metadata are SGLang's and pass."""
    r = rs["short_replay"]
    c = r["checks"]["decode"]
    assert r["rc"] == 1 and r["status"] == 1
    assert c["I1"][1] > 0 and c["I5"][1] > 0 and c["I13"] == (4, 0), c


def planted_short_trtllm_replay_fails(rs, version):
    """The same plant in TRTLLMMLABackend's replay: the gate reads the block table and lengths SGLang's
    replay writes (the unplanted backend passes I1 and I5 in decode above)."""
    r = rs["short_trtllm"]
    c = r["checks"]["decode"]
    assert r["rc"] == 1 and c["I1"][1] > 0 and c["I5"][1] > 0 and c["I13"] == (4, 0), c
    assert all("replay != eager" in m for m in messages(r, "I1")), messages(r, "I1")


def planted_short_draft_replay_fails(rs, version):
    """TritonMultiStepDraftBackend's replay prepared from a committed prefix one token short: every step's
    kv_indptr / kv_indices lose a token, replays fail I1 and I5 and the replayed outputs I9n (the
    unplanted backend passes them above)."""
    r = rs["short_draft"]
    c = r["checks"]["draft_decode"]
    assert r["rc"] == 1 and c["I1"][1] > 0 and c["I5"][1] > 0 and c["I9n"][1] > 0, c
    assert all("replay != eager" in m for m in messages(r, "I1")), messages(r, "I1")
    assert all(m.startswith("replayed output") for m in messages(r, "I9n")), messages(r, "I9n")


def planted_packed_trtllm_draft_extend_fails(rs, version):
    """0.5.23 writes a draft extend's cu_seqlens_q at graph creation only, so the adapter leaves it out of the
    poisoning; a replay that writes it packed (finding (d)'s class) still fails I1 on every replay."""
    r = rs["packed_trtllm"]
    c = r["checks"]["draft_extend"]
    assert r["rc"] == 1 and c["I1"] == (0, 6) and failed(c) == {"I1"}, c
    assert all("cu_seqlens_q: replay != eager" in m for m in messages(r, "I1")), messages(r, "I1")


SCRIPTS = {"kv_indptr0": {"script": KV_INDPTR0}, "draft_pad": {"script": DRAFT_PAD}}
COMMON = {"tree": check(TREE, "verify_tree"), "trtllm": check(TRTLLM)}
PLANTS = {"short_replay": check(f"{PLANTED}:ShortReplayBackend", "decode"),
          "short_trtllm": check(f"{PLANTED}:ShortTRTLLMReplayBackend", "decode"),
          "short_draft": check(f"{PLANTED}:ShortDraftReplayBackend", "draft_decode")}
COMMON_CHECKS = [triton_passes, triton_draft_decode_reads_draft_step_tokens_of_pad_rows, triton_rc,
                 tree_verify_passes, trtllm_mla_layout, kv_indptr0_kept]
PLANT_CHECKS = [planted_short_replay_fails, planted_short_trtllm_replay_fails, planted_short_draft_replay_fails]
# 0.5.9 / 0.5.10: one check a mode (the cases the assertions above were written on; in one process)
PER_MODE = {f"triton:{m}": check(BACKEND, m) for m in ("extend", "decode", "verify_chain", "draft_extend",
                                                       "draft_decode")}
VERSIONS = {
    "0.5.9": ({**SCRIPTS, **PER_MODE, **COMMON},
              COMMON_CHECKS + [triton_draft_extend_reads_the_new_rows_twice]),
    "0.5.10": ({**SCRIPTS, **PER_MODE, **COMMON, **PLANTS,
                "open_tree": check(f"{PLANTED}:OpenTreeReplayBackend", "verify_tree")},
               COMMON_CHECKS + [triton_draft_extend_reads_the_new_rows_twice, planted_open_tree_mask_fails]
               + PLANT_CHECKS),
    # the newest release: one case a mode for the Triton backend (its draft extend fails I13 once a case)
    "0.5.23": ({**SCRIPTS, "triton": check(BACKEND, cases=1), **COMMON, **PLANTS,
                "packed_trtllm": check(f"{PLANTED}:PackedDraftExtendTRTLLMBackend", "draft_extend")},
               COMMON_CHECKS + [triton_0_5_23_draft_extend_capture, planted_packed_trtllm_draft_extend_fails]
               + PLANT_CHECKS),
}


@pytest.mark.parametrize("version", list(VERSIONS))
def test_sglang_adapters(version, tmp_path):
    """Every job of ``version`` in one process, then every named check; all failing checks reported."""
    jobs, checks = VERSIONS[version]
    rs = run_jobs(version, jobs, tmp_path)
    assert set(rs["triton"]["checks"]) == {"extend", "decode", "verify_chain", "draft_extend", "draft_decode"}
    errors = []
    for fn in checks:
        try:
            fn(rs, version)
        except AssertionError as e:
            errors.append(f"{fn.__name__}: {e}")
    assert not errors, "\n\n".join(errors)
