"""Tokens per second at TP 1 and TP N (issue #44): the engine on the bench-size models and on a model
large enough that splitting its heads and MLP can pay, plain decode and EAGLE, each rank's graph
replays against eager fallbacks. TP N runs one process a rank (``runtime/tp.py``: NCCL on CUDA, a GPU
a rank). A TP N row counts the requests whose tokens equal TP 1's on every rank: in float32 (``--smoke``)
all must (exit status 1 otherwise); in bf16 the all-reduce's summation order can flip a near tie, reported,
not failed.

    python bench/bench_tp.py --tp 2 [--device cuda] [--models bench-gqa,bench-mla,large-gqa,llama8b-gqa] [--out FILE]
    python bench/bench_tp.py --tp 2 --device cpu --smoke       # plumbing on the CPU (tiny models, gloo)

One line a (model, spec, tp): tokens/s (all steps, and decode steps alone), the mean accept length,
each rank's replays / fallbacks; JSON lines to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import replace

from attn_backends_runtime.eagle import SpecConfig
from attn_backends_runtime.engine import Engine, EngineConfig
from attn_backends_runtime.models import TinyConfig
from attn_backends_runtime.request import SamplingParams
from attn_backends_runtime.tp import launch

# Llama-8B's widths at 8 layers, and at Llama-8B's 32: where the model's GPU time outgrows the engine's host step
LARGE_GQA = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=8, num_q_heads=32,
                 num_kv_heads=8, head_dim=128, page_size=16)


def models(smoke: bool) -> dict:
    if smoke:
        return {"tiny-gqa": TinyConfig(), "tiny-mla": TinyConfig(is_mla=True)}
    return {"bench-gqa": TinyConfig.gpu_gqa(), "bench-mla": TinyConfig.gpu_mla(),
            "large-gqa": replace(TinyConfig.gpu_gqa(), **LARGE_GQA),
            "llama8b-gqa": replace(TinyConfig.gpu_gqa(), **dict(LARGE_GQA, num_layers=32))}


def run_specs(tp, device: str, model: TinyConfig, specs: tuple, *shape) -> list:
    """``run`` of each spec on this rank (one process start for all of them)."""
    return [run(tp, device, model, spec, *shape) for spec in specs]


def run(tp, device: str, model: TinyConfig, spec, batch: int, prompt: int, tokens: int, dtype) -> dict:
    """One engine run on this rank: its tokens, tokens/s and graph counts."""
    backend = "torch_native" if device == "cpu" else ("triton_mla" if model.is_mla else "triton")
    ctx = -(-(prompt + tokens + (spec.headroom + 1 if spec else 0)) // model.page_size) * model.page_size
    cfg = EngineConfig(replace(model, dtype=dtype), backend, spec, device, max_batch=batch, max_context_len=ctx,
                       max_prefill_tokens=max(16, batch * prompt), tp=tp)
    engine = Engine(cfg)
    rng = random.Random(0)
    prompts = [[rng.randrange(model.vocab_size) for _ in range(prompt)] for _ in range(batch)]
    engine.generate(prompts, SamplingParams(4))     # warm at the run's shapes: their compiles fall outside
    engine.stats = type(engine.stats)()
    warm = {(ex.name, m): (c["graph"], c["eager"]) for ex in engine.executors for m, c in ex.counts.items()}
    reqs = engine.generate(prompts, SamplingParams(tokens))
    s = engine.stats
    counts = {f"{ex.name} {m}": [c["graph"] - warm.get((ex.name, m), (0, 0))[0],
                                 c["eager"] - warm.get((ex.name, m), (0, 0))[1]]
              for ex in engine.executors for m, c in ex.counts.items()}     # the measured run's alone
    return dict(outputs=[r.output for r in reqs], tok_s=s.tokens_per_second(), decode_tok_s=s.tokens_per_second(True),
                accept=s.mean_accept, counts=counts)


def main(argv=None) -> int:
    import torch
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--models", default=None, help="comma-separated (default: all of the size)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--smoke", action="store_true", help="tiny models, few tokens: plumbing only")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.prompt_len, args.max_tokens = 2, 8, 6
    dtype = torch.float32 if args.smoke else torch.bfloat16
    table = models(args.smoke)
    names = args.models.split(",") if args.models else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        print(f"bench_tp.py: --models {unknown[0]}: not one of {', '.join(table)}", file=sys.stderr)
        return 2
    rows = []
    specs = (None, SpecConfig("eagle", 1, 3, 4))
    for name in names:
        shape = (args.device, table[name], specs, args.batch, args.prompt_len, args.max_tokens, dtype)
        ones, by_rank = run_specs(None, *shape), launch(run_specs, args.tp, args.device, shape)
        for k, spec in enumerate(specs):
            one, ranks = ones[k], [r[k] for r in by_rank]
            # requests whose tokens equal TP 1's on every rank (TP 1's own row: None)
            same = sum(all(len(r["outputs"]) == len(one["outputs"]) and r["outputs"][i] == out for r in ranks)
                       for i, out in enumerate(one["outputs"]))
            for tp, res in ((1, [one]), (args.tp, ranks)):
                row = dict(model=name, spec="eagle" if spec else "plain", tp=tp, tok_s=res[0]["tok_s"],
                           decode_tok_s=res[0]["decode_tok_s"], accept=res[0]["accept"],
                           counts=[r["counts"] for r in res], requests_as_tp1=None if tp == 1 else same,
                           requests=len(one["outputs"]))
                rows.append(row)
                graphs = "; ".join(f"rank {i}: " + ", ".join(f"{k} {g}/{e}" for k, (g, e) in sorted(c.items()))
                                   for i, c in enumerate(row["counts"]))
                as_one = "-" if tp == 1 else f"{same}/{len(one['outputs'])}"
                print(f"{name:11s} {row['spec']:6s} TP {tp}: {row['tok_s']:9.1f} tok/s (decode "
                      f"{row['decode_tok_s']:9.1f}), accept {row['accept']:.2f}, requests as TP 1: {as_one} | {graphs}",
                      flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    return 0 if not args.smoke or all(r["requests_as_tp1"] in (None, r["requests"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
