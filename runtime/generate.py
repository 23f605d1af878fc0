"""``attn-backends generate``: greedy generation on a tiny model through the engine, plain or
EAGLE speculative decoding, printing the tokens and a summary (mean accept length, tokens per
second, graph replays vs eager fallbacks per mode).

Registered in the ``attn_backends.commands`` entry-point group, so ``attn_backends.cli`` finds it
without importing this package (dependencies point one way).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import replace
from typing import TextIO

import torch

from .draft_model import ACCEPTANCE_LEVELS
from .eagle import SpecConfig
from .engine import Engine, EngineConfig
from .models import TinyConfig
from .request import SamplingParams

MODELS = {"tiny-gqa": False, "tiny-mla": True}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="greedy generation on a tiny model (plain decode or EAGLE)",
                              description="Greedy generation on a tiny model through the engine: random "
                                          "prompts, plain decode or EAGLE / EAGLE-3 speculative decoding.")
    p.add_argument("--model", choices=list(MODELS), default="tiny-gqa")
    p.add_argument("--backend", default="torch_native", help="a registered backend (default: torch_native)")
    p.add_argument("--spec", choices=("none", "eagle", "eagle3"), default="none")
    p.add_argument("--topk", type=int, default=1, help="draft branches (> 1: tree verify)")
    p.add_argument("--steps", type=int, default=3, help="draft token levels per round")
    p.add_argument("--draft-tokens", type=int, default=None, help="N, tokens verified per request (default steps+1)")
    p.add_argument("--acceptance", choices=list(ACCEPTANCE_LEVELS), default="high",
                   help="the draft's agreement with the target (its noise level)")
    p.add_argument("--draft-layers", type=int, default=None, help="draft trunk layers (default: all)")
    p.add_argument("--batch", type=int, default=4, help="requests (all running at once)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16, help="longest prompt (lengths vary down to half)")
    p.add_argument("--stop", type=int, nargs="*", default=[], help="stop token ids")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--page-size", type=int, choices=(1, 16, 64), default=16)
    p.add_argument("--size", choices=("tiny", "bench"), default="tiny",
                   help="tiny: CPU test sizes; bench: TinyConfig.gpu_gqa/gpu_mla (4 layers, hidden 1024)")
    p.add_argument("--no-graphs", action="store_true", help="run every forward eagerly")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.set_defaults(handler=run_generate)


def engine_config(args) -> EngineConfig:
    mla = MODELS[args.model]
    if args.size == "bench":
        base = TinyConfig.gpu_mla() if mla else TinyConfig.gpu_gqa()
    else:
        base = TinyConfig(is_mla=mla)
    model = replace(base, page_size=args.page_size, dtype=DTYPES[args.dtype])
    spec = None
    if args.spec != "none":
        spec = SpecConfig(args.spec, args.topk, args.steps, args.draft_tokens or args.steps + 1,
                          noise=ACCEPTANCE_LEVELS[args.acceptance], draft_layers=args.draft_layers)
    ps = args.page_size
    ctx = -(-(args.prompt_len + args.max_tokens + (spec.headroom + 1 if spec else 0)) // ps) * ps
    prefill = max(16, args.batch * args.prompt_len)
    return EngineConfig(model, args.backend, spec, args.device, max_batch=args.batch, max_context_len=ctx,
                        max_prefill_tokens=prefill, graphs=not args.no_graphs)


class Progress:
    """A tqdm bar on a terminal; elsewhere a line at every tenth of the work or every 5 s."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.stream, self.start = total, stream, time.monotonic()
        self.bar, self.last_line, self.last_frac = None, self.start, 0
        if stream.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, file=stream, unit="tok", desc="generate")

    def __call__(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            return
        now, frac = time.monotonic(), int(10 * done / max(self.total, 1))
        if frac > self.last_frac or now - self.last_line >= 5:
            print(f"generate: {done}/{self.total} tokens, {now - self.start:.1f} s", file=self.stream, flush=True)
            self.last_line, self.last_frac = now, frac

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_generate(args, out: TextIO = None, err: TextIO = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    if args.device == "cuda" and not torch.cuda.is_available():
        print("attn-backends generate: error: --device cuda but CUDA is not available here", file=err)
        return 2
    try:
        cfg = engine_config(args)
        engine = Engine(cfg)
    except ValueError as e:                 # an unknown or unsuitable backend, a bad spec shape
        print(f"attn-backends generate: error: {e}", file=err)
        return 2
    rng = random.Random(args.seed)
    vocab = cfg.model.vocab_size
    params = SamplingParams(args.max_tokens, tuple(args.stop))
    for _ in range(args.batch):
        n = rng.randint(max(1, args.prompt_len // 2), args.prompt_len)
        engine.add_request([rng.randrange(vocab) for _ in range(n)], params)
    progress = Progress(args.batch * args.max_tokens, err)
    reqs = engine.run(progress)
    progress.close()
    for r in reqs:
        head = f"[{r.rid}] prompt {len(r.prompt)} tokens ->"
        if r.error:
            print(f"{head} error: {r.error}", file=out)
        else:
            print(f"{head} {len(r.output)} tokens ({r.finish_reason}): {' '.join(map(str, r.output))}", file=out)
    spec = cfg.spec
    what = "plain decode" if spec is None else (f"{spec.method} topk={spec.topk} steps={spec.num_steps} "
                                                f"N={spec.num_draft_tokens} acceptance={args.acceptance}")
    print(f"\n{args.model} on {args.backend} ({args.device}, {args.dtype}, "
          f"{'eager' if args.no_graphs else 'graphs'}), {what}", file=out)
    print(engine.summary(), file=out)
    return 0


if __name__ == "__main__":      # python -m attn_backends_runtime.generate ...
    parser = argparse.ArgumentParser(prog="generate")
    register(parser.add_subparsers(dest="command", required=True))
    a = parser.parse_args(["generate"] + sys.argv[1:])
    sys.exit(a.handler(a))
