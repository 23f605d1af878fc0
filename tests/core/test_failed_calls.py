"""Issue #11 defect 2: every public call that raises leaves the backend, the step and the
runner exactly as they were (fingerprints of every tensor byte and every host field), and the
next valid call gives, bit for bit, what it gave before the bad one."""
import dataclasses
import random

import pytest
import torch

from attn_backends import CaptureHiddenMode as H
from attn_backends import ForwardMode, GraphKey, LayoutError, ModelConfig, SpecInfo, get_backend
from attn_backends.check.scenarios import Scenario, make_memory, materialize, verify_spec
from attn_backends.check.state import fingerprint, state_diff
from attn_backends_runtime.runner_base import RunnerRefusal
from attn_backends_runtime.testing.rig import Rig, RigSpec

CFG = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16)


def _layout(be) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in be.forward_metadata.as_layout().items()}


def _same_layout(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]), k


def _unchanged(objs, call, match):
    """``call`` raises ``match`` and changes none of ``objs``."""
    before = [fingerprint(o) for o in objs]
    with pytest.raises((LayoutError, RunnerRefusal, ValueError), match=match):
        call()
    for o, b in zip(objs, before):
        diff = state_diff(b, fingerprint(o))
        assert not diff, f"a refused call changed {type(o).__name__}: {diff}"


def _tree_setup():
    mem = make_memory(CFG, num_pages=64, max_reqs=16, max_context_len=128, seed=4)
    be = get_backend("torch_native", CFG, mem)
    be.init_cuda_graph_state(4, 16)
    rng = random.Random(0)
    mk = lambda prefixes: materialize(Scenario(ForwardMode.TARGET_VERIFY, 4, prefixes,  # noqa: E731
                                               verify_spec(4, 4, rng, topk=2, steps=2)), mem, 1).batch
    return mem, be, mk


def test_refused_tree_capture_changes_nothing():
    """The reported case: capturing tree verify without a tree mask raises, and the key's next
    valid replay works and gives the layout it gave before."""
    mem, be, mk = _tree_setup()
    cap, a = mk([5, 9, 30]), mk([17, 2])
    be.init_forward_metadata_capture_cuda_graph(cap.graph_inputs())
    be.init_forward_metadata_replay_cuda_graph(a.graph_inputs())
    want = _layout(be)
    bad = cap.graph_inputs()
    bad.spec_info = dataclasses.replace(bad.spec_info, tree_mask=None)
    _unchanged([be, mem], lambda: be.init_forward_metadata_capture_cuda_graph(bad), "tree verify needs tree_mask")
    be.init_forward_metadata_replay_cuda_graph(a.graph_inputs())
    _same_layout(_layout(be), want)


@pytest.mark.parametrize("what", ["chain spec on a tree key", "key width != spec width", "raw_bs over bs",
                                  "uncaptured key", "seq_len over max_context_len"])
def test_refused_capture_or_replay_changes_nothing(what):
    mem, be, mk = _tree_setup()
    cap, a = mk([5, 9, 30]), mk([17, 2])
    be.init_forward_metadata_capture_cuda_graph(cap.graph_inputs())
    be.init_forward_metadata_replay_cuda_graph(a.graph_inputs())
    want = _layout(be)
    gi = a.graph_inputs()
    if what == "chain spec on a tree key":
        gi.spec_info = SpecInfo(4, 1, 3)
        call, match = (lambda: be.init_forward_metadata_capture_cuda_graph(gi)), "tree"
    elif what == "key width != spec width":
        gi.key = GraphKey(ForwardMode.TARGET_VERIFY, 4, 3)
        call, match = (lambda: be.init_forward_metadata_capture_cuda_graph(gi)), "W=3"
    elif what == "raw_bs over bs":
        gi.raw_bs = 5
        call, match = (lambda: be.init_forward_metadata_replay_cuda_graph(gi)), "raw_bs=5"
    elif what == "uncaptured key":
        gi.key = GraphKey(ForwardMode.TARGET_VERIFY, 2, 4)
        call, match = (lambda: be.init_forward_metadata_replay_cuda_graph(gi)), "no graph captured"
    else:
        gi.seq_lens_cpu = gi.seq_lens_cpu.clone()
        gi.seq_lens_cpu[0] = 129
        call, match = (lambda: be.init_forward_metadata_replay_cuda_graph(gi)), "max_context_len=128"
    _unchanged([be, mem], call, match)
    be.init_forward_metadata_replay_cuda_graph(a.graph_inputs())
    _same_layout(_layout(be), want)


def test_refused_step_update_changes_nothing():
    mem, be, mk = _tree_setup()
    be.init_forward_metadata_capture_cuda_graph(mk([5, 9, 30]).graph_inputs())
    plan = be._steps.graph_step                # the step made for a caller without a runner
    key = GraphKey(ForwardMode.TARGET_VERIFY, 4, 4)
    _unchanged([plan], lambda: plan.update(key, 0), "raw_bs=0 outside 1..bs=4")
    _unchanged([plan], lambda: plan.update(GraphKey(ForwardMode.DECODE, 4, 1), 2), "no capture for")
    plan.seq_lens_cpu[1] = 2                       # written by hand: fewer than W tokens
    _unchanged([plan], lambda: plan.update(key, 3), "request 1: seq_len=2 < 4")


# --------------------------------------------------------------------------- runners

RUNNER_KINDS = ["decode", "verify_tree", "draft_extend", "draft_decode", "piecewise"]


def _bad_batches(rig: Rig, reqs: list) -> list:
    """(what, batch, message) that a runner must refuse, including one refused only at the plan's
    host check of seq_lens (after a refusal-free ``can_run``)."""
    out = []
    b = rig.batch(reqs, hidden=H.NULL)
    if rig.kind == "draft_decode":     # only the last draft step runs past the context
        top = rig.spec.max_ctx - rig.spec.steps * rig.spec.topk + 1
        pre = b.prefix_lens_cpu.clone()
        pre[-1] = top
        huge = dataclasses.replace(b, prefix_lens_cpu=pre, prefix_lens=pre.to(b.prefix_lens))
        out.append(("prefix + num_steps*topk over max_context_len", huge, "max_context_len"))
    elif rig.kind != "piecewise":
        seq = b.seq_lens_cpu.clone()
        seq[0] = rig.spec.max_ctx + 1
        out.append(("seq_len over max_context_len", dataclasses.replace(b, seq_lens_cpu=seq,
                                                                         seq_lens=seq.to(b.seq_lens)),
                    "max_context_len"))
    out.append(("hidden mode above the captured one", dataclasses.replace(b, capture_hidden_mode=H.FULL),
                "hidden mode"))
    return out


@pytest.mark.parametrize("kind", RUNNER_KINDS)
def test_refused_run_changes_nothing(kind):
    rig = Rig(RigSpec(kind, buckets=(8, 16) if kind == "piecewise" else (2, 4), hidden=H.LAST))
    rng = random.Random(1)
    reqs = rig.new_requests(3 if kind != "piecewise" else 2, rng)
    good = rig.batch(reqs, hidden=H.LAST)
    want = rig.runner.run(good)
    for what, bad, match in _bad_batches(rig, reqs):
        before = fingerprint(rig.runner)
        can = rig.runner.can_run(bad)
        assert not state_diff(before, fingerprint(rig.runner)), f"can_run changed the runner ({what})"
        if what.startswith("seq_len"):
            assert can, "the seq_len case is meant to pass the runner's own guards"
        _unchanged([rig.runner, rig.mem], lambda: rig.runner.run(bad), match)
        again = rig.runner.run(good)
        for f in ("logits", "hidden", "rows"):
            a, b = getattr(again, f), getattr(want, f)
            assert (a is None and b is None) or torch.equal(a, b), f"{what}: {f} differs after the refusal"
