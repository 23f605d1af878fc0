"""The tiny engine: plain greedy decode against the independent reference with continuous
batching and stop rules, admission (a prompt over capacity fails alone, a small pool queues
requests), eager fallbacks counted, nothing leaked; settings refused, naming the value and the
limit, before anything is allocated."""
import pytest
from engine_reference import (
    assert_all_graphs,
    assert_matches,
    assert_no_leaks,
    make_cases,
    reference_model,
    run_cases,
)

from attn_backends_runtime import engine as engine_mod
from attn_backends_runtime import limits
from attn_backends_runtime.draft import MAX_DRAFT_STEPS, MultiStepDraftRunner
from attn_backends_runtime.eagle import MAX_STEPS, SpecConfig
from attn_backends_runtime.engine import Engine, EngineConfig, powers_of_two
from attn_backends_runtime.limits import ConfigError
from attn_backends_runtime.models import TinyConfig
from attn_backends_runtime.request import SamplingParams

MAX_TOKENS = [12, 8, 16, 6, 10]
STOP_AT = {1: 4, 3: 2}


def engine_for(tc, spec=None, **kw) -> Engine:
    cfg = dict(max_batch=3, max_context_len=64, buckets=(1, 2, 4), token_buckets=(16, 32, 64))
    cfg.update(kw)
    return Engine(EngineConfig(tc, "torch_native", spec, "cpu", **cfg))


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_plain_decode_matches_the_reference(mla):
    """Five requests, three at a time: they queue, one joins a running batch, two stop on a stop
    token, all finish at different steps; DECODE and EXTEND replayed, no eager fallback, no leak."""
    tc = TinyConfig(is_mla=mla, page_size=16)
    cases = make_cases(reference_model(tc), MAX_TOKENS, seed=11, stop_at=STOP_AT)
    engine = engine_for(tc)
    assert_matches(run_cases(engine, cases, join_after=4), cases)
    assert_all_graphs(engine, {("target", "extend"), ("target", "decode")})
    assert_no_leaks(engine)
    assert engine.stats.tokens == sum(len(c.expected) for c in cases)


@pytest.mark.parametrize("spec", [None, SpecConfig("eagle", 2, 3, 4)], ids=["plain", "eagle-tree"])
def test_prompt_over_capacity_fails_alone(spec):
    tc = TinyConfig(page_size=16)
    cases = make_cases(reference_model(tc), [10, 7], seed=6)
    engine = engine_for(tc, spec)
    ok0 = engine.add_request(cases[0].prompt, cases[0].params)
    bad = engine.add_request(list(range(60)), SamplingParams(10))
    ok1 = engine.add_request(cases[1].prompt, cases[1].params)
    engine.run()
    r = engine.requests[bad]
    assert r.finish_reason == "error" and r.output == []
    headroom = f"+ {spec.headroom + 1} speculative positions = {71 + spec.headroom}" if spec else \
        "+ 0 speculative positions = 70"
    assert r.error == f"request {bad}: prompt of 60 tokens + max_tokens=10 {headroom} exceeds max_context_len=64"
    assert_matches([engine.requests[ok0], engine.requests[ok1]], cases)
    assert_no_leaks(engine)


def test_request_larger_than_the_pool_fails_and_a_small_pool_queues():
    """A pool of 6 pages of 16: a request whose worst case needs 7 pages fails at once; three
    that need 2 pages each run at most three at a time and all finish."""
    tc = TinyConfig(page_size=16)
    cases = make_cases(reference_model(tc), [12, 12, 12, 12], seed=9)
    engine = engine_for(tc, num_pages=7, max_batch=4, max_context_len=128)
    big = engine.add_request(list(range(100)), SamplingParams(4))
    ids = [engine.add_request(c.prompt, c.params) for c in cases]
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, len(engine.running))
    assert engine.requests[big].error == f"request {big}: needs 7 KV pages, the pool has 6"
    assert peak == 3, f"at most 3 requests of 2 pages fit 6 pages, ran {peak} at once"
    assert_matches([engine.requests[i] for i in ids], cases)
    assert_no_leaks(engine)


@pytest.mark.parametrize("spec", [None, SpecConfig("eagle3", 1, 2, 3)], ids=["plain", "eagle3"])
def test_finish_at_prefill(spec):
    """max_tokens=1, or a stop token as the first token: done after the prefill, state released."""
    tc = TinyConfig(page_size=1)
    cases = make_cases(reference_model(tc), [1, 5], seed=1, stop_at={1: 0})
    engine = engine_for(tc, spec)
    reqs = run_cases(engine, cases)
    assert_matches(reqs, cases)
    assert [len(r.output) for r in reqs] == [1, 1]
    assert engine.stats.decode_tokens == 0 and engine.stats.rounds == 0
    if spec:
        assert not engine.worker.candidates
    assert_no_leaks(engine)


@pytest.mark.parametrize("spec", [None, SpecConfig("eagle", 1, 3, 4, noise=0.1)], ids=["plain", "eagle"])
def test_batches_past_the_largest_bucket_run_eagerly_and_are_counted(spec):
    """Three running requests with buckets (1, 2): those steps fall back to eager, visibly."""
    tc = TinyConfig(page_size=16)
    cases = make_cases(reference_model(tc), [4, 16, 10], seed=12)    # 3, then 2, then 1 running
    engine = engine_for(tc, spec, buckets=(1, 2), token_buckets=(16,))
    assert_matches(run_cases(engine, cases), cases)
    counts = {(ex.name, m): c for ex in engine.executors for m, c in ex.counts.items()}
    key = ("target", "verify") if spec else ("target", "decode")
    assert counts[key]["eager"] > 0 and counts[key]["graph"] > 0, counts
    assert counts[("target", "extend")]["eager"] == 1, counts     # 3 prompts > 16 tokens: one eager prefill
    assert_no_leaks(engine)


def test_config_errors_name_value_and_limit():
    with pytest.raises(ValueError, match="^num_draft_tokens=5 outside 2..num_steps\\+1=4$"):
        SpecConfig("eagle", 1, 3, 5)
    with pytest.raises(ValueError, match="^num_draft_tokens=8 outside 2..num_steps\\*topk\\+1=7$"):
        SpecConfig("eagle", 2, 3, 8)
    with pytest.raises(ValueError, match="^method='medusa' is not one of"):
        SpecConfig("medusa")
    with pytest.raises(ValueError, match="^num_steps=0 outside 1..65: "):       # the steps, not N = steps + 1
        SpecConfig("eagle", 1, 0, 1)
    with pytest.raises(ValueError, match=f"^num_steps=80 outside 1..{MAX_STEPS}: a round runs at most 64 draft"):
        SpecConfig("eagle", 1, 80, 4)
    with pytest.raises(ValueError, match=f"^num_steps={MAX_STEPS + 1} outside 1..{MAX_STEPS}"):
        SpecConfig("eagle", 1, MAX_STEPS + 1, 4)
    assert SpecConfig("eagle", 1, MAX_STEPS, MAX_STEPS + 1).headroom == MAX_STEPS + 1
    with pytest.raises(ValueError, match="^draft_layers=0 must be >= 1"):
        SpecConfig("eagle", draft_layers=0)
    with pytest.raises(ValueError, match="max_tokens=0 must be >= 1"):
        SamplingParams(0)
    assert powers_of_two(12) == (1, 2, 4, 8, 12) and powers_of_two(64, 16) == (16, 32, 64)


# ----------------------------------------------------------------------------- refused before allocating

def no_allocation(monkeypatch) -> None:
    monkeypatch.setattr(engine_mod, "KVMemory", lambda **kw: pytest.fail(f"KV memory allocated: {kw}"))
    monkeypatch.setattr(engine_mod, "TinyModel", lambda *a, **kw: pytest.fail("target model built"))


@pytest.mark.parametrize("spec,kw,message", [
    (SpecConfig("eagle", draft_layers=3), {}, "draft_layers=3 exceeds the target's 2 layers"),
    (SpecConfig("eagle", 129, 1, 2), {}, "topk=129 exceeds the vocabulary size 128"),
    (None, dict(max_batch=0), "max_batch=0 must be >= 1"),
    (None, dict(skippable_from=3), "skippable_from=3 outside 1..2 (the target's layers)"),
    (None, dict(max_batch=10 ** 9), "max_batch=1000000000, max_context_len=64: the engine would take at least"),
])
def test_engine_settings_refused_before_allocating(monkeypatch, spec, kw, message):
    no_allocation(monkeypatch)
    with pytest.raises(ConfigError) as e:
        engine_for(TinyConfig(), spec, **kw)
    assert str(e.value).startswith(message), str(e.value)


def test_memory_refusal_names_the_bytes_needed_and_available(monkeypatch):
    """An engine larger than the free memory (here a patched 1 MiB) is refused before its KV pool."""
    monkeypatch.setattr(limits, "available_bytes", lambda device: (1 << 20, "patched"))
    no_allocation(monkeypatch)
    cfg = EngineConfig(TinyConfig(), "torch_native", SpecConfig("eagle"), "cpu", max_batch=8, max_context_len=512)
    need = sum(limits.engine_bytes(cfg).values())
    with pytest.raises(ConfigError, match=f"^max_batch=8, max_context_len=512: the engine would take at least "
                                          f"{need:,} bytes \\(0.0 GiB\\), the KV pool .* GiB of it; 1,048,576 "
                                          "bytes \\(0.0 GiB\\) available \\(patched\\)$"):
        Engine(cfg)
    assert need > 1 << 20


def test_engine_bytes_counts_the_kv_pool_and_the_weights():
    """The count the memory check uses, against the tensors an engine holds."""
    tc = TinyConfig(page_size=16)
    engine = engine_for(tc, SpecConfig("eagle", 2, 3, 5), max_context_len=64)
    parts = limits.engine_bytes(engine.cfg)
    pool = engine.memory.pool
    assert parts["the KV pool"] == sum(t.numel() * t.element_size() for t in pool.k + pool.v)
    assert parts["the request table"] == engine.memory.req_to_token.numel() * 4
    feats = engine.draft_model.features
    assert parts["the draft's features"] == feats.numel() * feats.element_size()
    own = sum(p.numel() for p in engine.target_model.parameters())
    own += engine.draft_model.lm_head.perturb.weight.numel() + engine.draft_model.fc.weight.numel()
    assert parts["the weights"] == own * 4


def test_multi_step_draft_runner_refuses_more_steps_than_its_plans_load():
    """The draft runner's bound (64 draft forwards) before any plan is allocated; SpecConfig's
    MAX_STEPS is that bound plus the level-1 top-k."""
    with pytest.raises(ValueError, match=f"^num_steps={MAX_DRAFT_STEPS + 1} draft steps outside 1..64"):
        MultiStepDraftRunner(None, [None] * (MAX_DRAFT_STEPS + 1), None, 1, MAX_DRAFT_STEPS + 1, (1,))
    assert MAX_STEPS == MAX_DRAFT_STEPS + 1
