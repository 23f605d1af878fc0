"""Decode tokens per second of the tiny models (GPU only): plain decode vs EAGLE at three
acceptance levels, bs 1, 8 and 64, full graphs vs eager, on the ``triton`` / ``triton_mla``
backends at ``TinyConfig.gpu_gqa()`` / ``gpu_mla()`` sizes (4 layers, bf16).

EAGLE runs a chain of ``N = 8`` (7 draft levels, 6 draft forwards in one graph) with a draft of
the target's first layer; the target's 3 top layers are made unable to change its argmax
(``EngineConfig.skippable_from=1``: ``make_top_layers_skippable``, asked for explicitly, the
engine never does it by itself), so the draft agrees with it at noise 0 up to bf16 near ties,
as a well-trained EAGLE head would, and the acceptance levels are the draft noise levels of
``ACCEPTANCE_LEVELS`` (the mean accept length measured is recorded beside each figure).

One measurement: ``bs`` requests of ``PROMPT`` tokens submitted together, ``MAX_TOKENS`` new
tokens each (so the batch stays at ``bs`` to the end); tokens/s counts the tokens of the decode
steps over their wall time (prefill excluded), the median of ``ROUNDS`` runs after a warm-up
run. Rows go to ``$BENCH_EAGLE_RESULTS`` (JSON lines); ``python bench/bench_eagle.py FILE``
prints the table and checks the target (EAGLE, high acceptance, full graphs, bs 1 >= 2x plain).
``python bench/bench_eagle.py --smoke`` runs the same code on the CPU at test sizes. (Plain
decode runs the same target, skippable layers included: the same model, shapes and cost.)
"""
import json
import os
import statistics
import sys
from dataclasses import replace

import pytest
import torch

from attn_backends_runtime.draft_model import ACCEPTANCE_LEVELS
from attn_backends_runtime.eagle import SpecConfig
from attn_backends_runtime.engine import Engine, EngineConfig
from attn_backends_runtime.models import TinyConfig
from attn_backends_runtime.request import SamplingParams

BATCH_SIZES = (1, 8, 64)
IMPLS = ("graphs", "eager")
METHODS = ("plain",) + tuple(f"eagle-{lvl}" for lvl in ACCEPTANCE_LEVELS)
SPEC = SpecConfig("eagle", topk=1, num_steps=7, num_draft_tokens=8, draft_layers=1)
PROMPT = int(os.environ.get("BENCH_EAGLE_PROMPT", 64))
MAX_TOKENS = int(os.environ.get("BENCH_EAGLE_TOKENS", 128))
ROUNDS = int(os.environ.get("BENCH_EAGLE_ROUNDS", 3))


def engine_config(which: str, method: str, impl: str, device: str = "cuda", tc=None, backend=None,
                  batch_sizes=BATCH_SIZES, prompt=PROMPT, max_tokens=MAX_TOKENS) -> EngineConfig:
    tc = tc or (TinyConfig.gpu_mla() if which == "mla" else TinyConfig.gpu_gqa())
    spec = None if method == "plain" else replace(SPEC, noise=ACCEPTANCE_LEVELS[method.split("-", 1)[1]])
    ps = tc.page_size
    ctx = -(-(prompt + max_tokens + SPEC.headroom + 1) // ps) * ps
    bs = max(batch_sizes)
    tokens = tuple(sorted({prompt, prompt * min(8, bs), prompt * bs}))
    return EngineConfig(tc, backend or ("triton_mla" if tc.is_mla else "triton"), spec, device, max_batch=bs,
                        max_context_len=ctx, max_prefill_tokens=prompt * bs, graphs=impl == "graphs",
                        buckets=batch_sizes, token_buckets=tokens, skippable_from=SPEC.draft_layers)


def generate_once(engine: Engine, bs: int, prompt: int, max_tokens: int, seed: int) -> dict:
    """One batch of ``bs`` requests to the end: decode tokens/s and the mean accept length."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.cfg.model.vocab_size
    before = (engine.stats.decode_tokens, engine.stats.decode_seconds, engine.stats.rounds,
              sum(a * n for a, n in engine.stats.accept_hist.items()))
    engine.generate([torch.randint(0, vocab, (prompt,), generator=g).tolist() for _ in range(bs)],
                    SamplingParams(max_tokens))
    st = engine.stats
    tok, sec = st.decode_tokens - before[0], st.decode_seconds - before[1]
    rounds = st.rounds - before[2]
    accepted = sum(a * n for a, n in st.accept_hist.items()) - before[3]
    return {"tok_s": tok / sec, "mean_accept": accepted / rounds if rounds else 1.0}


def measure(engine: Engine, bs: int, prompt: int = PROMPT, max_tokens: int = MAX_TOKENS, rounds: int = ROUNDS,
            benchmark=None) -> dict:
    generate_once(engine, bs, prompt, min(16, max_tokens), seed=0)           # warm-up (compiles, caches)
    runs = []
    run = lambda: runs.append(generate_once(engine, bs, prompt, max_tokens, seed=len(runs) + 1))  # noqa: E731
    if benchmark is not None:
        benchmark.pedantic(run, rounds=rounds, iterations=1)
    else:
        for _ in range(rounds):
            run()
    return {"tok_s": statistics.median(r["tok_s"] for r in runs),
            "mean_accept": statistics.median(r["mean_accept"] for r in runs)}


_ENGINES: dict = {}


def engine(which: str, method: str, impl: str) -> Engine:
    key = (which, method, impl)
    if key not in _ENGINES:
        _ENGINES.clear()                          # one engine at a time: its graphs and KV pool
        torch.cuda.empty_cache()
        _ENGINES[key] = Engine(engine_config(which, method, impl))
    return _ENGINES[key]


@pytest.mark.parametrize("bs", BATCH_SIZES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("which", ["gqa", "mla"])
def test_decode_tokens_per_second(benchmark, which, method, impl, bs):
    e = engine(which, method, impl)
    m = measure(e, bs, benchmark=benchmark)
    benchmark.extra_info.update(m)
    counts = {f"{ex.name} {k}": dict(c) for ex in e.executors for k, c in ex.counts.items()}
    record({"bench": "eagle", "model": which, "method": method, "impl": impl, "bs": bs, **m,
            "counts": counts, "device": torch.cuda.get_device_name(),
            "cfg": f"{e.cfg.model.num_layers} layers, prompt {PROMPT}, {MAX_TOKENS} new tokens, "
                   f"N={SPEC.num_draft_tokens} chain, draft {SPEC.draft_layers} layer"})


def record(row: dict) -> None:
    path = os.environ.get("BENCH_EAGLE_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def summarize(rows: list, batch_sizes=BATCH_SIZES) -> None:
    tok = {(r["model"], r["method"], r["impl"], r["bs"]): r for r in rows if r.get("bench") == "eagle"}
    if rows and "device" in rows[0]:
        print(f"device: {rows[0]['device']}; {rows[0].get('cfg', '')}")
    print("decode tokens/s (mean accept length)")
    print(f"{'model bs impl':18s}" + "".join(f"{m:>18s}" for m in METHODS))
    for which in ("gqa", "mla"):
        for bs in batch_sizes:
            for impl in IMPLS:
                cells = []
                for m in METHODS:
                    r = tok.get((which, m, impl, bs))
                    cells.append(f"{'-':>18s}" if r is None else
                                 f"{r['tok_s']:11.1f} ({r['mean_accept']:.2f})" if m != "plain" else
                                 f"{r['tok_s']:18.1f}")
                print(f"{f'{which} {bs} {impl}':18s}" + "".join(cells))
    for which in ("gqa", "mla"):
        e, p = tok.get((which, "eagle-high", "graphs", 1)), tok.get((which, "plain", "graphs", 1))
        if e and p:
            ratio = e["tok_s"] / p["tok_s"]
            print(f"{which}: EAGLE high acceptance, full graphs, bs 1: {ratio:.2f}x plain decode "
                  f"(target >= 2x: {'PASS' if ratio >= 2 else 'MISS'})")


def smoke() -> None:
    """The benchmark's code path on the CPU at test sizes (torch_native, eager stand-in graphs)."""
    rows = []
    for which in ("gqa", "mla"):
        tc = replace(TinyConfig(is_mla=which == "mla", page_size=16), num_layers=2)
        for method in METHODS:
            for impl in IMPLS:
                cfg = engine_config(which, method, impl, "cpu", tc, "torch_native", (1, 4), prompt=8, max_tokens=16)
                e = Engine(cfg)
                for bs in (1, 4):
                    m = measure(e, bs, prompt=8, max_tokens=16, rounds=1)
                    rows.append({"bench": "eagle", "model": which, "method": method, "impl": impl, "bs": bs, **m})
    summarize(rows, (1, 4))


if __name__ == "__main__":
    if sys.argv[1:] == ["--smoke"]:
        smoke()
    else:
        summarize([json.loads(line) for line in open(sys.argv[1])])
