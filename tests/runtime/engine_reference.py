"""The independent greedy reference of the engine tests, and their shared helpers.

The reference decodes one request at a time with the target model's eager forward on the
``torch_native`` backend: an EXTEND of the prompt, then one DECODE per token. It records the
top-2 logit margin of every step. A verify forward computes N tokens at once while the
reference computes one, so rounding alone could flip an argmax at a near tie; the tests use
only prompts whose greedy continuation has a margin above ``TAU`` (orders of magnitude above
float32 rounding) at every step, and on those require exact token equality.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from attn_backends import ForwardBatch, ForwardMode, KVMemory, get_backend
from attn_backends_runtime.draft_model import make_top_layers_skippable
from attn_backends_runtime.models import TinyConfig, TinyModel
from attn_backends_runtime.request import SamplingParams
from attn_backends_runtime.runner_base import run_eager

TAU = 2e-3
I32 = torch.int32


def reference_model(tc: TinyConfig, skippable_from=None, device="cpu") -> TinyModel:
    """The target as the engine builds it (same seed; ``EngineConfig.skippable_from`` applied)."""
    model = TinyModel(tc, device)
    if skippable_from is not None:
        make_top_layers_skippable(model, skippable_from)
    return model


def greedy(model: TinyModel, prompt: list, max_tokens: int) -> tuple[list, float]:
    """``(tokens, smallest top-2 margin)`` of plain greedy decoding."""
    tc, dev = model.config, next(model.parameters()).device
    ctx = -(-(len(prompt) + max_tokens) // tc.page_size) * tc.page_size
    mem = KVMemory(num_layers=tc.num_layers, num_pages=ctx // tc.page_size + 1, page_size=tc.page_size, max_reqs=1,
                   max_context_len=ctx, is_mla=tc.is_mla, num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim,
                   kv_lora_rank=tc.kv_lora_rank, rope_dim=tc.qk_rope_head_dim, dtype=tc.dtype, device=dev)
    be = get_backend("torch_native", tc.attention(), mem)
    row, n = mem.new_request(), len(prompt)
    req = torch.tensor([row], dtype=I32, device=dev)
    seq = torch.tensor([n], dtype=I32)
    batch = ForwardBatch(ForwardMode.EXTEND, 1, req, seq.to(dev), seq, mem.extend(row, n), torch.arange(n, device=dev),
                         seq.to(dev), seq, input_ids=torch.tensor(prompt, device=dev))
    logits = run_eager(model, be, batch, 0).logits[-1]
    out, margin = [], float("inf")
    while True:
        top = logits.topk(2).values
        margin = min(margin, float(top[0] - top[1]))
        out.append(int(logits.argmax()))
        if len(out) == max_tokens:
            return out, margin
        pos = mem.seq_len(row)
        seq = torch.tensor([pos + 1], dtype=I32)
        batch = ForwardBatch(ForwardMode.DECODE, 1, req, seq.to(dev), seq, mem.extend(row, 1),
                             torch.tensor([pos], device=dev), input_ids=torch.tensor([out[-1]], device=dev))
        logits = run_eager(model, be, batch, 1).logits[0]


@dataclass
class Case:
    prompt: list
    params: SamplingParams
    expected: list          # the reference's tokens under params (stop token included)
    reason: str             # "stop" or "length"


def make_cases(model: TinyModel, max_tokens: list, seed: int, stop_at: dict = None, lengths=(3, 12)) -> list:
    """One case per ``max_tokens`` entry, each with a margin-safe random prompt. ``stop_at[i] = k``
    makes the reference's k-th token request i's stop token (so it stops early, at its first
    occurrence)."""
    rng, cases = random.Random(seed), []
    vocab = model.config.vocab_size
    for i, m in enumerate(max_tokens):
        for _ in range(50):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(*lengths))]
            ref, margin = greedy(model, prompt, m)
            if margin > TAU:
                break
        else:
            raise AssertionError(f"no margin-safe prompt in 50 tries (seed {seed}, request {i})")
        stop = () if not stop_at or i not in stop_at else (ref[stop_at[i]],)
        cut = next((j + 1 for j, t in enumerate(ref) if t in stop), len(ref))
        cases.append(Case(prompt, SamplingParams(m, stop), ref[:cut], "stop" if stop else "length"))
    return cases


def run_cases(engine, cases: list, join_after: int = 0) -> list:
    """Submit the cases (the ones past ``join_after`` after two steps, so they join a running
    batch) and run the engine dry; returns the finished requests in case order."""
    first = join_after or len(cases)
    ids = [engine.add_request(c.prompt, c.params) for c in cases[:first]]
    for _ in range(2):
        engine.step()
    ids += [engine.add_request(c.prompt, c.params) for c in cases[first:]]
    engine.run()
    return [engine.requests[i] for i in ids]


def assert_matches(reqs: list, cases: list) -> None:
    for i, (r, c) in enumerate(zip(reqs, cases)):
        assert r.output == c.expected, (f"request {i}: engine {r.output}\n  reference {c.expected}\n"
                                        f"  accept lengths {r.accept_lens}")
        assert r.finish_reason == c.reason, f"request {i}: finished by {r.finish_reason}, expected {c.reason}"


def assert_no_leaks(engine) -> None:
    """Every page back in the allocator, every request row cleared, no reservation left."""
    mem = engine.memory
    assert not engine.running and not engine.waiting
    assert mem.pages.num_free == mem.pages.num_pages - 1, (
        f"{mem.pages.num_pages - 1 - mem.pages.num_free} pages not returned")
    assert int(mem.req_to_token.abs().sum()) == 0, "req_to_token rows still point at slots"
    assert engine.budget.reserved == 0


def assert_all_graphs(engine, modes: set) -> None:
    """Every expected mode replayed a graph at least once, and nothing fell back to eager."""
    seen = {(ex.name, m): c for ex in engine.executors for m, c in ex.counts.items()}
    for key in modes:
        assert seen.get(key, {}).get("graph", 0) > 0, f"{key}: no graph replay ({seen})"
    for key, c in seen.items():
        assert c["eager"] == 0, f"{key}: {c['eager']} eager fallbacks ({seen})"
