"""Issue #38 item 8: a numbers failure says where. The layout suite's I9n and the runner suite's
I9 name the request, query row, head and worst element with our value and the reference's
(``attn_backends.check.numbers.mismatch``, the one helper of both), so that a causal
off-by-one (every row of a request off but its last) and a transposed tree mask are
recognisable from the message alone."""
import dataclasses
import random
import re

import pytest
import torch

from attn_backends import CaptureHiddenMode as H
from attn_backends import ForwardMode, ModelConfig, SpecInfo
from attn_backends.backends import torch_native as TN
from attn_backends.backends.torch_native import TorchNativeBackend
from attn_backends.check.numbers import batch_spans, mismatch
from attn_backends.check.report import SuiteReport
from attn_backends.check.scenarios import Scenario, make_memory, materialize, verify_spec
from attn_backends.check.suite import CaseSpec, run_case
from attn_backends.layout import MaskKind
from attn_backends_runtime.testing.rig import Rig, RigSpec
from attn_backends_runtime.testing.runner_checks import attention_diagnosis
from attn_backends_runtime.testing.runner_suite import check_case

WORST = re.compile(r"worst at request (\d+), query row (\d+) of (\d+), head (\d+), element (\d+): "
                   r"ours (\S+), reference (\S+);")


class CausalOffByOne(TorchNativeBackend):
    """Planted: the causal mask lets each query row see one key more (row j sees prefix + j + 1)."""

    name = "bug_causal_off_by_one"

    def _run(self, q, layer, meta):
        lay = meta.layout
        if lay.mask == MaskKind.CAUSAL:
            lay = dataclasses.replace(lay, prefix_lens=lay.prefix_lens + 1)
        return super()._run(q, layer, dataclasses.replace(meta, view=meta.view._replace(layout=lay)))


class TreeTransposed(TorchNativeBackend):
    """Planted: the tree mask read transposed (each draft token sees its descendants, not its ancestors)."""

    name = "bug_tree_transposed"

    def _run(self, q, layer, meta):
        lay = meta.layout
        if lay.mask == MaskKind.TREE:
            w = lay.width
            cm = lay.custom_mask.view(lay.bs, w, w).transpose(1, 2).reshape(-1)
            lay = dataclasses.replace(lay, custom_mask=cm)
        return super()._run(q, layer, dataclasses.replace(meta, view=meta.view._replace(layout=lay)))


def _brute_force_worst(got, want, spans):
    """(request, row, head, element, ours, reference) of the largest |got - want|, by plain loops."""
    best, where = -1.0, None
    for i, (start, n) in enumerate(spans):
        for j in range(n):
            for h in range(got.shape[1]):
                for e in range(got.shape[2]):
                    d = abs(float(got[start + j, h, e]) - float(want[start + j, h, e]))
                    if d > best:
                        best, where = d, (i, j, h, e, float(got[start + j, h, e]), float(want[start + j, h, e]))
    return where


def _outputs(bug, scn: Scenario, seed: int = 3):
    cfg = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16)
    mem = make_memory(cfg, num_pages=40, max_reqs=8, max_context_len=256, page_order="shuffled", seed=seed)
    m = materialize(scn, mem, 1)
    q = torch.randn(m.batch.num_tokens, 4, 16, generator=torch.Generator().manual_seed(seed))
    outs = []
    for cls in (bug, TorchNativeBackend):
        be = cls(cfg, mem)
        be.init_forward_metadata(m.batch)
        outs.append(be.forward(q, None, None, cfg.layer(0), m.batch, save_kv_cache=False))
    return m.batch, outs[0], outs[1]


CHAIN = Scenario(ForwardMode.TARGET_VERIFY, 4, [10, 20, 30], SpecInfo(4, 1, 3))
TREE = Scenario(ForwardMode.TARGET_VERIFY, 4, [5, 40, 17], verify_spec(5, 4, random.Random(3), topk=2, steps=2))


@pytest.mark.parametrize("bug,scn", [(CausalOffByOne, CHAIN), (TreeTransposed, TREE)], ids=["causal", "tree"])
def test_message_names_the_worst_request_row_head_and_both_values(bug, scn):
    batch, got, want = _outputs(bug, scn)
    spans = batch_spans(batch)
    real = sum(n for _, n in spans)
    msg = mismatch(got[:real], want[:real], 1e-4, spans)
    i, j, h, e, ours, ref = _brute_force_worst(got, want, spans)
    assert f"worst at request {i}, query row {j} of {spans[i][1]}, head {h}, element {e}: " \
           f"ours {ours:.6g}, reference {ref:.6g};" in msg, msg
    if bug is CausalOffByOne:       # every row of each request off but its last: the off-by-one's signature
        assert "rows off: request 0 rows 0-2 of 4; request 1 rows 0-2 of 4; request 2 rows 0-2 of 4;" in msg, msg
    else:                           # a row's descendants are never its ancestors: every row off
        assert "rows off: request 0 rows 0-4 of 5; request 1 rows 0-4 of 5; request 2 rows 0-4 of 5;" in msg, msg
    assert "heads off: 0-3 of 4" in msg
    assert mismatch(want[:real], want[:real], 1e-4, spans) is None


def test_layout_suite_i9n_locates_a_causal_off_by_one():
    """Through the suite: the I9n failure of a verify case with 3 requests of width 4."""
    c = CaseSpec("verify_chain", 16, "shuffled", mla=False, bs=4, n=4, steps=3, seed=5,
                 batches=[([3, 40, 17, 90], None), ([10, 20, 30], None), ([5], None)])
    rep = SuiteReport()
    run_case(CausalOffByOne, c, rep)
    numbers = [f for f in rep.failures if f.invariant == "I9n"]
    assert len(numbers) == 2, rep.failed_invariants()
    for f in numbers:               # the first eager batch and the first replay, both A = [10, 20, 30]
        m = WORST.search(f.message)
        assert m and int(m[2]) < 3 and m[3] == "4" and float(m[6]) != float(m[7]), f.message
        assert "rows off: request 0 rows 0-2 of 4; request 1 rows 0-2 of 4; request 2 rows 0-2 of 4" in f.message


def _rows_off(msg: str) -> list:
    return re.findall(r"request (\d+) rows ([\d, -]+) of (\d+)", msg.split("attention of layer")[1])


def test_runner_i9_locates_the_attention_of_a_causal_off_by_one(monkeypatch):
    orig = TN.visible
    monkeypatch.setattr(TN, "visible", lambda lay, q, k: orig(lay, q + 1 if lay.mask == MaskKind.CAUSAL else q, k))
    found = {}
    check_case(Rig(RigSpec(kind="verify", n=3, seed=0)), random.Random(0),
               lambda inv, msgs: msgs and found.setdefault(inv, []).extend(msgs), tol=1e-5)
    msg = next(m for m in found["I9"] if "attention of layer" in m)
    assert "attention of layer 0, eager, vs the float64 reference" in msg, msg
    m = WORST.search(msg.split("attention of layer")[1])
    assert m and int(m[2]) < 2 and m[3] == "3" and float(m[6]) != float(m[7]), msg
    assert _rows_off(msg) and all(rows == "0-1" and n == "3" for _, rows, n in _rows_off(msg)), msg


def test_runner_diagnosis_of_a_transposed_tree_mask(monkeypatch):
    orig = TN.visible

    def transposed(lay, q, k):
        if lay.mask == MaskKind.TREE:
            w = lay.width
            lay = dataclasses.replace(lay, custom_mask=lay.custom_mask.view(lay.bs, w, w).transpose(1, 2).reshape(-1))
        return orig(lay, q, k)
    rig = Rig(RigSpec(kind="verify_tree", n=5, topk=2, steps=2, seed=1))
    reqs = rig.new_requests(3, random.Random(1))
    assert attention_diagnosis(rig, reqs, H.NULL, 2e-3).startswith("the eager attention of every layer agrees")
    monkeypatch.setattr(TN, "visible", transposed)
    msg = attention_diagnosis(rig, reqs, H.NULL, 2e-3)
    m = WORST.search(msg)
    assert msg.startswith("attention of layer 0") and m and m[3] == "5" and float(m[6]) != float(m[7]), msg
    assert [r for r, _, _ in _rows_off(msg)] == ["0", "1", "2"], msg
