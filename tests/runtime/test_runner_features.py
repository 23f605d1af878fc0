"""The runner suite on windows, sinks and softcap: a case of tree verify and of multi-step draft
decode with every feature passes every invariant, I17 included; torch_native planted to ignore the
window in tree verify alone fails I9 against the float64 reference and I17."""
import random

import pytest

import attn_backends.backends.torch_native as tn
from attn_backends.check.features import Features
from attn_backends.layout import MaskKind
from attn_backends_runtime.testing.rig import Rig, RigSpec
from attn_backends_runtime.testing.runner_suite import check_case

FEATURES = Features(window=2, window_kind="w<W", softcap=1.0, sinks=(12.0, -12.0, 3.0, -5.0))


def _judged(kind: str) -> dict:
    spec = RigSpec(kind, page_size=1, n=4, topk=2, steps=3, buckets=(2, 4), features=FEATURES, seed=4)
    found: dict = {}

    def judge(inv, msgs):
        found.setdefault(inv, []).extend(msgs)
    check_case(Rig(spec), random.Random(4), judge, tol=1e-5)
    return found


@pytest.mark.parametrize("kind", ["verify_tree", "draft_decode"])
def test_runner_case_with_every_feature_passes(kind):
    found = _judged(kind)
    assert "I17" in found and "I9" in found
    assert not any(found.values()), {k: v[:1] for k, v in found.items() if v}


def test_window_ignored_in_tree_verify_fails(monkeypatch):
    real = tn.in_window
    monkeypatch.setattr(tn, "in_window", lambda lay, qp, kp, w: real(lay, qp, kp, 10 ** 6 if lay.mask == MaskKind.TREE
                                                                         else w))
    found = _judged("verify_tree")
    assert found["I9"] and any("float64 reference" in m for m in found["I9"])
    assert found["I17"]
