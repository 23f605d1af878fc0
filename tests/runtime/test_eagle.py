"""EAGLE speculative decoding end to end: lossless against an independent greedy reference
(chain and tree, EAGLE and EAGLE-3, GQA and MLA, every backend that runs here), the KV cache
holding exactly the accepted tokens after every step, accept lengths over 1..N, graph path ==
eager path, and the pieces the worker relies on (draft scores, EAGLE-3 hidden states).

CPU: torch_native, and the Triton backends under the interpreter at one-layer sizes (slow).
GPU (``cuda``): every backend with real CUDA graphs, float32 so that the reference's margins hold.
"""
import random
from dataclasses import replace

import pytest
import torch
from engine_reference import (
    assert_all_graphs,
    assert_matches,
    assert_no_leaks,
    make_cases,
    reference_model,
    run_cases,
)

from attn_backends import CaptureHiddenMode as H
from attn_backends import KVMemory, get_backend
from attn_backends.check.scenarios import make_memory
from attn_backends.registry import get_backend_class, unavailable_reason
from attn_backends_runtime.batches import extend_batch
from attn_backends_runtime.draft_model import ACCEPTANCE_LEVELS, DraftModel
from attn_backends_runtime.eagle import SpecConfig
from attn_backends_runtime.engine import Engine, EngineConfig
from attn_backends_runtime.models import TinyConfig, TinyModel
from attn_backends_runtime.piecewise import PiecewiseRunner
from attn_backends_runtime.request import SamplingParams
from attn_backends_runtime.runner_base import run_eager
from attn_backends_runtime.testing.rig import Rig, RigSpec

MID = ACCEPTANCE_LEVELS["mid"]
SPECS = {
    "chain-eagle": SpecConfig("eagle", 1, 3, 4, noise=MID),
    "chain-eagle3": SpecConfig("eagle3", 1, 3, 4, noise=MID),
    "tree-eagle": SpecConfig("eagle", 2, 3, 5, noise=MID),
    "tree-eagle3": SpecConfig("eagle3", 3, 2, 5, noise=MID),
}
ALL_MODES = {("target", "extend"), ("target", "verify"), ("draft", "extend"), ("draft", "draft_extend"),
             ("draft", "draft_decode")}
MAX_TOKENS = [12, 8, 16, 6, 10]           # finish at different steps; request 4 joins a running batch
STOP_AT = {1: 4, 3: 2}                     # and two stop early on a stop token


def engine_for(tc, spec, backend="torch_native", device="cpu", **kw) -> Engine:
    cfg = dict(max_batch=3, max_context_len=64, buckets=(1, 2, 4), token_buckets=(16, 32, 64))
    cfg.update(kw)
    return Engine(EngineConfig(tc, backend, spec, device, **cfg))


def model_config(mla: bool, page_size: int, **kw) -> TinyConfig:
    return TinyConfig(is_mla=mla, page_size=page_size, **kw)


# ----------------------------------------------------------------------------- lossless, torch_native

@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
@pytest.mark.parametrize("name", list(SPECS))
def test_lossless_torch_native(name, mla):
    """Greedy speculative output == greedy target output, token for token, for a batch whose
    requests queue, join and finish at different steps; graphs replayed for every mode, no eager
    fallback, no KV leak. Chains on single-token pages, trees on 16-token pages (moves)."""
    spec = SPECS[name]
    tc = model_config(mla, 16 if name.startswith("tree") else 1)
    cases = make_cases(reference_model(tc), MAX_TOKENS, seed=11, stop_at=STOP_AT)
    engine = engine_for(tc, spec)
    assert_matches(run_cases(engine, cases, join_after=4), cases)
    assert_all_graphs(engine, ALL_MODES)
    assert_no_leaks(engine)
    assert engine.stats.rounds == sum(len(r.accept_lens) for r in engine.requests.values())


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_a_one_layer_draft_serves_the_untouched_target(mla):
    """A draft shorter than the target is a model of its own: the engine serves the seeded target
    (its weights bitwise as built, before and after generating), token for token; the draft,
    missing a layer, is rejected at times (accept lengths below N) and the output stays the target's."""
    tc = model_config(mla, 16)
    seeded = {k: v.clone() for k, v in TinyModel(tc).state_dict().items()}
    cases = make_cases(reference_model(tc), [16, 11], seed=5)
    engine = engine_for(tc, SpecConfig("eagle", 1, 3, 4, draft_layers=1))
    assert len(engine.draft_model.layers) == 1

    def unchanged():
        got = engine.target_model.state_dict()
        assert got.keys() == seeded.keys()
        for k, v in seeded.items():
            assert torch.equal(got[k], v), f"target weight {k} changed"
    unchanged()
    assert_matches(run_cases(engine, cases), cases)
    unchanged()
    assert min(engine.stats.accept_hist) < 4, engine.stats.accept_hist
    assert_no_leaks(engine)


def test_lossless_with_a_one_layer_draft_of_a_skippable_target():
    """The benchmarks' pairing, asked for explicitly: a target whose top layer cannot change its
    argmax (``skippable_from=1``) and a draft of its first layer; lossless against that target
    and, at noise 0, always accepted."""
    tc = model_config(False, 16)
    spec = SpecConfig("eagle", 1, 3, 4, draft_layers=1)
    cases = make_cases(reference_model(tc, skippable_from=1), [16, 11], seed=5)
    engine = engine_for(tc, spec, skippable_from=1)
    assert_matches(run_cases(engine, cases), cases)
    assert set(engine.stats.accept_hist) == {4}, engine.stats.accept_hist
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------- acceptance

@pytest.mark.parametrize("spec", [SpecConfig("eagle", 1, 3, 4), SpecConfig("eagle3", 2, 3, 4)], ids=["chain", "tree"])
def test_accept_lengths_cover_1_to_n_and_are_counted(spec):
    tc = model_config(False, 16)
    cases = make_cases(reference_model(tc), [16, 16, 16], seed=3)
    hist = {}
    for level, noise in ACCEPTANCE_LEVELS.items():
        engine = engine_for(tc, replace(spec, noise=noise))
        reqs = run_cases(engine, cases)
        assert_matches(reqs, cases)
        st = engine.stats
        assert st.rounds == sum(len(r.accept_lens) for r in reqs) and st.rounds > 0
        assert st.decode_tokens == sum(len(r.output) - 1 for r in reqs)      # the first token is the prefill's
        for r in reqs:                       # every round's tokens were kept, but the last round's past the limit
            assert 0 <= sum(r.accept_lens) - (len(r.output) - 1) < spec.num_draft_tokens
        hist[level] = st.accept_hist
    n = spec.num_draft_tokens
    assert set(hist["mid"]) == set(range(1, n + 1)), f"mid level: {hist['mid']} misses some of 1..{n}"
    if spec.topk == 1:
        assert set(hist["high"]) == {n}, f"noise 0, full trunk: always accepted, got {hist['high']}"
    means = {k: sum(a * c for a, c in h.items()) / sum(h.values()) for k, h in hist.items()}
    assert means["high"] > means["mid"] > means["low"] and means["low"] < 1.2, means


# ----------------------------------------------------------------------------- KV bookkeeping

def fresh_prefill(engine, tokens: list, pending: int):
    """K/V, features and draft K/V that a fresh prefill of ``tokens`` (the committed ones) and the
    pending token computes: ``(target kv per layer [T, ...], features [T, F], draft kv [T+1, ...])``."""
    tc, spec = engine.cfg.model, engine.cfg.spec
    k = spec.draft_layers or tc.num_layers
    ctx = -(-(len(tokens) + 1) // tc.page_size) * tc.page_size
    mem = KVMemory(num_layers=tc.num_layers + k, num_pages=ctx // tc.page_size + 1, page_size=tc.page_size,
                   max_reqs=1, max_context_len=ctx, is_mla=tc.is_mla, num_kv_heads=tc.num_kv_heads,
                   head_dim=tc.head_dim, kv_lora_rank=tc.kv_lora_rank, rope_dim=tc.qk_rope_head_dim, dtype=tc.dtype)
    cfg = replace(tc, num_layers=tc.num_layers + k).attention()
    draft = DraftModel(engine.target_model, mem, num_layers=k, noise=spec.noise,
                       temperature=spec.draft_temperature, seed=spec.seed)
    row = mem.new_request()
    slots = mem.extend(row, len(tokens) + 1)
    tb = extend_batch(mem, [row], [0], [tokens], H.FULL)
    out = run_eager(engine.target_model, get_backend("torch_native", cfg, mem), tb, 0)
    draft.features[slots[:-1]] = out.hidden
    db = extend_batch(mem, [row], [0], [tokens + [pending]])
    db.input_embeds = draft.input_embeds(db)
    run_eager(draft, get_backend("torch_native", cfg, mem), db, 0)
    return pool_rows(mem, range(tc.num_layers), slots[:-1]), draft.features[slots[:-1]], \
        pool_rows(mem, range(tc.num_layers, tc.num_layers + k), slots)


def pool_rows(mem, layers, slots) -> list:
    pool = mem.pool
    if mem.is_mla:
        return [pool.kv[i][slots] for i in layers]
    return [t[slots] for i in layers for t in (pool.k[i], pool.v[i])]


@pytest.mark.parametrize("mla,page", [(False, 16), (True, 1)], ids=["gqa-page16", "mla-page1"])
def test_cache_holds_exactly_the_accepted_tokens(mla, page):
    """After every step, for every running request: the memory holds T + 1 positions (the draft one
    ahead); the target's K/V, the draft's features and the draft's K/V at those positions equal a
    fresh prefill of the committed tokens (tree verify: the accepted path was moved into place)."""
    tc = model_config(mla, page)
    spec = SpecConfig("eagle3", 3, 3, 6, noise=MID)
    engine = engine_for(tc, spec, max_batch=2)
    for c in make_cases(reference_model(tc), [16, 12], seed=2):
        engine.add_request(c.prompt, c.params)
    checked = deep = 0
    while engine.has_work():
        engine.step()
        for r in engine.running:
            t = r.num_tokens - 1
            assert engine.memory.seq_len(r.row) == t + 1
            committed = (r.prompt + r.output)[:t]
            slots = engine.memory.req_to_token[r.row, :t + 1].long()
            kv, feats, dkv = fresh_prefill(engine, committed, r.output[-1])
            for got, want in zip(pool_rows(engine.memory, range(tc.num_layers), slots[:-1]), kv):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(engine.draft_model.features[slots[:-1]], feats, rtol=1e-4, atol=1e-4)
            draft_layers = range(tc.num_layers, 2 * tc.num_layers)
            for got, want in zip(pool_rows(engine.memory, draft_layers, slots), dkv):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            checked += 1
    # accepting 3+ tokens with 3 level-1 rows means a level-2 node from row >= 4: its K/V moved
    deep = sum(1 for r in engine.requests.values() for a in r.accept_lens if a >= 3)
    assert checked >= 6 and deep > 0, (checked, deep)
    assert_no_leaks(engine)


def test_graph_path_equals_eager_path():
    """Same tokens and the same accept length in every round, with graphs (padded buckets, the
    draft reading its features inside the captured forward) and without."""
    tc = model_config(True, 16)
    spec = SpecConfig("eagle3", 2, 3, 6, noise=MID)
    cases = make_cases(reference_model(tc), [10, 12, 8], seed=8)
    runs = []
    for graphs in (True, False):
        engine = engine_for(tc, spec, graphs=graphs)
        reqs = run_cases(engine, cases)
        assert_matches(reqs, cases)
        runs.append([r.accept_lens for r in reqs])
        counts = {k: c for ex in engine.executors for k, c in ex.counts.items()}
        assert all((c["graph"] > 0) == graphs for c in counts.values()), counts
    assert runs[0] == runs[1]


# ----------------------------------------------------------------------------- what the worker relies on

def test_draft_runner_scores_are_the_greedy_log_probs():
    rig = Rig(RigSpec("draft_decode", topk=2, steps=3, buckets=(2, 4)))
    reqs = rig.new_requests(3, random.Random(0))
    out = rig.runner.run(rig.batch(reqs))
    ref = rig.ref_draft.run_eager(rig.batch(reqs))
    assert out.scores.shape == (3, 3, 2) and bool((out.scores <= 0).all())
    torch.testing.assert_close(out.scores, ref.scores[:3], rtol=1e-5, atol=1e-5)
    last = torch.log_softmax(out.logits, -1).gather(-1, out.rows[:, -1].reshape(-1, 1)).view(3, 2)
    torch.testing.assert_close(out.scores[:, -1], last, rtol=1e-5, atol=1e-5)


def test_draft_eager_reference_of_a_padded_batch_treats_its_pads_as_pads():
    """The suites' bitwise reference for draft decode (bf16 backends: the eager forward of the batch
    padded to the replay's bucket) marks the padding rows as pads: the layout refuses a real request
    on row 0, and the real rows equal the unpadded reference's."""
    rig = Rig(RigSpec("draft_decode", topk=2, steps=3, buckets=(4,)))
    reqs = rig.new_requests(3, random.Random(0))
    padded = rig.expected(reqs, padded=True)
    plain = rig.expected(reqs)
    assert padded.logits.shape == plain.logits.shape == (6, rig.tc.vocab_size)
    torch.testing.assert_close(padded.logits, plain.logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(padded.rows, plain.rows)
    with pytest.raises(ValueError, match="^DraftInput with pad_rows=1: the graph path pads by itself"):
        rig.runner.run(rig.batch(reqs, 4))


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_eagle3_hidden_states_are_the_aux_streams_sized_per_mode(mla):
    """The target returns [rows, 3 * hidden]: the embeddings, the middle stream and the top
    stream before the final norm; LAST keeps each request's last row, FULL every row, on the
    piecewise runner and the eager path alike."""
    tc = model_config(mla, 16)
    model = TinyModel(tc, aux_hidden_layers=(0, 1, 2))
    mem = make_memory(tc.attention(), num_pages=8, max_reqs=2, max_context_len=32)
    rows = [mem.new_request() for _ in range(2)]
    lens = [5, 3]
    for r, n in zip(rows, lens):
        mem.extend(r, n)
    toks = [[1, 2, 3, 4, 5], [6, 7, 8]]
    runner = PiecewiseRunner(model, get_backend("torch_native", tc.attention(), mem), mem, (16,), H.FULL)
    runner.capture()
    hs = tc.hidden_size
    full = runner.run(extend_batch(mem, rows, [0, 0], toks, H.FULL))
    assert full.hidden.shape == (8, 3 * hs)
    torch.testing.assert_close(full.hidden[:, :hs], model.embed(torch.tensor(sum(toks, []))))
    torch.testing.assert_close(model.lm_head(model.norm(full.hidden[:, 2 * hs:])).float(), full.logits)
    last = runner.run(extend_batch(mem, rows, [0, 0], toks, H.LAST))
    assert last.hidden.shape == (2, 3 * hs)
    torch.testing.assert_close(last.hidden, full.hidden[[4, 7]])
    eager = run_eager(model, get_backend("torch_native", tc.attention(), mem),
                      extend_batch(mem, rows, [0, 0], toks, H.FULL), 0)
    torch.testing.assert_close(eager.hidden, full.hidden, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- Triton backends

@pytest.mark.parametrize("backend,mla,spec", [
    ("triton", False, SpecConfig("eagle3", 2, 2, 3, noise=MID)),
    ("triton_mla", True, SpecConfig("eagle", 1, 2, 3, noise=MID)),
], ids=["triton-gqa-tree-eagle3", "triton_mla-chain-eagle"])
def test_lossless_triton_interpreter(backend, mla, spec):
    """The Triton kernels under the interpreter (one layer, two requests, few tokens: slow)."""
    tc = model_config(mla, 16, num_layers=1)
    cases = make_cases(reference_model(tc), [6, 4], seed=4, lengths=(3, 6))
    engine = engine_for(tc, spec, backend, max_batch=2, buckets=(2,), token_buckets=(16,), max_context_len=32)
    assert_matches(run_cases(engine, cases), cases)
    modes = ALL_MODES if spec.num_steps > 1 else ALL_MODES - {("draft", "draft_decode")}
    assert_all_graphs(engine, modes)
    assert_no_leaks(engine)


# ----------------------------------------------------------------------------- GPU: real CUDA graphs

GPU_CASES = [(b, mla) for b, mla in (("torch_native", False), ("torch_native", True), ("triton", False),
                                      ("triton_mla", True))]


@pytest.mark.cuda
@pytest.mark.parametrize("backend,mla", GPU_CASES, ids=[f"{b}-{'mla' if m else 'gqa'}" for b, m in GPU_CASES])
@pytest.mark.parametrize("name", list(SPECS))
def test_lossless_cuda_graphs(name, backend, mla):
    """Every backend on the GPU with real graphs (float32: the reference's margins hold)."""
    spec = SPECS[name]
    tc = model_config(mla, 16)
    cases = make_cases(reference_model(tc, device="cuda"), MAX_TOKENS, seed=11, stop_at=STOP_AT)
    engine = engine_for(tc, spec, backend, device="cuda")
    assert_matches(run_cases(engine, cases, join_after=4), cases)
    assert_all_graphs(engine, ALL_MODES)
    assert_no_leaks(engine)


BF16_CASES = [("triton", False), ("triton_mla", True), ("flashinfer", False), ("flashinfer_mla", True),
              ("trtllm_mla", True), ("hybrid", True)]


@pytest.mark.cuda
@pytest.mark.parametrize("backend,mla", BF16_CASES, ids=[f"{b}-{'mla' if m else 'gqa'}" for b, m in BF16_CASES])
def test_cuda_bf16_high_acceptance_replays(backend, mla):
    """bf16 at the benchmark pairing (one-layer draft, skippable top layer): graphs replayed hundreds of times, every
    request finishes, nothing leaks, the acceptance stays high. The FlashInfer family runs here
    (it takes bf16 and head dims of 64 and up, not the float32 tiny models of the lossless tests)."""
    reason = unavailable_reason(get_backend_class(backend), "cuda")
    if reason:
        pytest.skip(reason)
    tc = replace(TinyConfig.gpu_mla() if mla else TinyConfig.gpu_gqa(), num_layers=2)
    spec = SpecConfig("eagle", 1, 4, 5, draft_layers=1)
    engine = engine_for(tc, spec, backend, device="cuda", max_batch=4, buckets=(1, 2, 4), max_context_len=512,
                        token_buckets=(32, 128, 256), max_prefill_tokens=256, skippable_from=1)
    rng = random.Random(0)
    reqs = engine.generate([[rng.randrange(tc.vocab_size) for _ in range(rng.randint(8, 64))] for _ in range(16)],
                           SamplingParams(max_tokens=96))
    assert all(r.finish_reason == "length" and len(r.output) == 96 for r in reqs)
    assert engine.stats.mean_accept > 3.5, engine.stats.accept_hist    # bf16 near ties flip a few drafts
    assert_all_graphs(engine, ALL_MODES)
    assert engine.target.counts["verify"]["graph"] > 60          # 16 x 96 tokens, <= 5 per round, 4 at a time
    assert_no_leaks(engine)
