"""Issue #38 item 9: every run of the runner suite draws each (runner kind, mode) the backend
declares, whatever ``--suite-cases`` says, so a bug in a runner kind cannot pass a small run by
never being drawn (at ``--suite-cases 6`` the seeds 0-5 once drew no piecewise case)."""
import dataclasses

import pytest

from attn_backends import ForwardMode
from attn_backends.check.cli import main
from attn_backends.registry import builtin_names, get_backend_class
from attn_backends_runtime import piecewise
from attn_backends_runtime.runner_base import GraphRunnerBase
from attn_backends_runtime.testing.rig import RUNNER_KINDS
from attn_backends_runtime.testing.runner_cases import kinds_for, plan_cases
from attn_backends_runtime.testing.runner_suite import run_runner_suite


def piecewise_accepts_target_verify(mp):
    """The piecewise runner without its mode guard: it would replay a TARGET_VERIFY batch."""
    def refusal(self, batch):
        if batch.num_tokens > self.max_bs:
            return f"{batch.num_tokens} tokens exceed the largest captured token bucket {self.max_bs}"
        return GraphRunnerBase.refusal(self, batch)
    mp.setattr(piecewise.PiecewiseRunner, "refusal", refusal)


def piecewise_ignores_input_embeds(mp):
    """The piecewise runner embeds the token ids and never loads the given embeddings (it still
    hands them back, so only the numbers show it)."""
    orig = piecewise.PiecewiseRunner._run

    def run(self, batch):
        out = orig(self, dataclasses.replace(batch, input_embeds=None))
        if batch.input_embeds is not None:
            out.input_embeds = batch.input_embeds[:batch.num_tokens].clone()
        return out
    mp.setattr(piecewise.PiecewiseRunner, "_run", run)


@pytest.mark.parametrize("name", sorted(builtin_names()))
@pytest.mark.parametrize("count", range(1, 7))
def test_every_declared_kind_is_drawn_at_any_count(name, count):
    caps = get_backend_class(name).capabilities
    kinds = kinds_for(caps)
    for seed in (0, 5, 123):
        plan = plan_cases(caps, count, seed)
        assert {kind for _, kind, _ in plan} == set(kinds), (name, count, seed)
        assert len(plan) == max(count, len(kinds))
        assert [s for s, _, _ in plan] == list(range(seed, seed + len(plan)))
        # a case is its seed: the replay (--seed s --suite-cases 1) runs the same case first
        assert all(plan_cases(caps, 1, s)[0] == (s, k, m) for s, k, m in plan)
    both = caps.mha and caps.mla
    if both:   # each kind on both model kinds within two rounds
        two = plan_cases(caps, 2 * len(kinds), 0)
        assert {(k, m) for _, k, m in two} == {(k, m) for k in kinds for m in (False, True)}


@pytest.mark.parametrize("drop", [(), (ForwardMode.DRAFT_EXTEND,), (ForwardMode.TARGET_VERIFY,),
                                  (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND)])
def test_each_kind_meets_both_model_kinds_whatever_the_kind_count(drop):
    """Odd kind counts too: kind s mod K on model kind (s mod K + s div K) mod 2 alternates per round
    (with s + s div K, an odd K kept each kind on one model kind forever)."""
    base = get_backend_class("torch_native").capabilities
    caps = dataclasses.replace(base, modes=frozenset(base.modes) - set(drop))
    kinds = kinds_for(caps)
    two = plan_cases(caps, 2 * len(kinds), 3)
    assert {(k, m) for _, k, m in two} == {(k, m) for k in kinds for m in (False, True)}, len(kinds)


@pytest.mark.parametrize("topk_gt1", [False, True])
def test_draft_extend_draws_topk_above_1_only_where_declared(topk_gt1):
    """A backend that declares no topk > 1 (flashinfer_mla) is never handed a multi-branch draft
    extend: the suite asked for what it does not declare, and reported its refusal as a crash."""
    import random

    from attn_backends_runtime.testing.runner_cases import random_spec
    caps = dataclasses.replace(get_backend_class("torch_native").capabilities, topk_gt1=topk_gt1)
    topks = {random_spec(random.Random(s), "draft_extend", "torch_native", caps, True, "cpu", s).topk
             for s in range(40)}
    assert topks == ({1, 2} if topk_gt1 else {1})


def test_run_reports_every_kind_at_one_case():
    rep = run_runner_suite("torch_native", cases=1, seed=0)
    assert rep.ok, "\n".join(map(str, rep.failures))
    assert {m for _, m in rep.cases} == {k.label for k in RUNNER_KINDS.values()} | {"runner:executor"}


def test_a_run_of_some_kinds_runs_those_alone():
    rep = run_runner_suite("torch_native", cases=1, seed=0, kinds=("decode", "draft_extend"))
    assert rep.ok, "\n".join(map(str, rep.failures))
    assert {m for _, m in rep.cases} == {"runner:decode", "runner:draft_extend", "runner:executor"}
    with pytest.raises(ValueError, match="none of them declared"):
        plan_cases(get_backend_class("torch_native").capabilities, 1, 0, ("nonexistent",))


@pytest.mark.parametrize("plant,invariant", [(piecewise_accepts_target_verify, "I11"),
                                             (piecewise_ignores_input_embeds, "I9")],
                         ids=["accepts_target_verify", "ignores_input_embeds"])
def test_check_at_six_suite_cases_catches_a_piecewise_bug(plant, invariant, monkeypatch, capsys):
    plant(monkeypatch)
    assert main(["check", "--suite", "runner", "--suite-cases", "6"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {invariant} [torch_native runner:piecewise]" in out, out
