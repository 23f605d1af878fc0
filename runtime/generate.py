"""``attn-backends generate``: greedy generation on a tiny model through the engine, plain or
EAGLE speculative decoding, printing the tokens and a summary (mean accept length, tokens per
second, graph replays vs eager fallbacks per mode).

Registered in the ``attn_backends.commands`` entry-point group, so ``attn_backends.check.cli`` finds it
without importing this package (dependencies point one way).
"""
from __future__ import annotations

import io
import random
import sys
import time
from dataclasses import replace
from typing import TextIO

import torch

from attn_backends.check import cli
from attn_backends.check.cli import UsageError
from attn_backends.config import KV_DTYPE_NAMES

from . import limits
from .draft_model import ACCEPTANCE_LEVELS
from .eagle import MAX_STEPS, SpecConfig
from .engine import Engine, EngineConfig
from .engine import refusal as engine_refusal
from .limits import ConfigError, Names
from .models import TINY_MODELS, TinyConfig
from .request import SamplingParams
from .tp import RankFailed, TensorParallel, launch, shard_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


LOSSLESS = ("speculative tokens equal --spec none's token for token in float32 (tested); in bfloat16 / "
            "float16 the verify and decode kernels sum in different orders (as plain decode does at "
            "different batch sizes), and a near tie between the top two logits can flip a token")
# how the engine's refusals name their settings here (limits.Names)
FLAGS = Names({"method": "--spec", "topk": "--topk", "num_steps": "--steps", "num_draft_tokens": "--draft-tokens",
               "draft_layers": "--draft-layers", "max_batch": "--batch"})


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="greedy generation on a tiny model (plain decode or EAGLE)",
                              description="Greedy generation on a tiny model through the engine: random "
                                          "prompts, plain decode or EAGLE / EAGLE-3 speculative decoding.")
    p.add_argument("--model", choices=list(TINY_MODELS), default="tiny-gqa",
                   help="tiny-gqa (Llama-like), tiny-mla (DeepSeek-like), tiny-gemma2 (sliding and full "
                        "layers, softcap), tiny-gptoss (windowed and full layers, sinks)")
    p.add_argument("--backend", default="torch_native", help="a registered backend (default: torch_native)")
    p.add_argument("--spec", choices=("none", "eagle", "eagle3"), default="none",
                   help=f"speculative decoding (default: none). Greedy and lossless: {LOSSLESS}")
    p.add_argument("--topk", type=cli.count(1), default=None, help="draft branches (> 1: tree verify; default 1)")
    p.add_argument("--steps", type=cli.count(1), default=None,
                   help=f"draft token levels per round, 1..{MAX_STEPS} (default: 3)")
    p.add_argument("--draft-tokens", type=cli.count(2), default=None,
                   help="N, tokens verified per request, 2..steps*topk+1 (default: steps+1)")
    p.add_argument("--acceptance", choices=list(ACCEPTANCE_LEVELS), default=None,
                   help="the draft's agreement with the target (its noise level; default high)")
    p.add_argument("--draft-layers", type=cli.count(1), default=None,
                   help="draft trunk layers, 1..the target's (default: all); the target is unchanged")
    p.add_argument("--batch", type=cli.count(1), default=4, help="requests (all running at once)")
    p.add_argument("--max-tokens", type=cli.count(1), default=32)
    p.add_argument("--prompt-len", type=cli.count(1), default=16, help="longest prompt (lengths vary down to half)")
    p.add_argument("--stop", type=int, nargs="*", default=[], help="stop token ids")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--kv-dtype", choices=list(KV_DTYPE_NAMES), default="model",
                   help="the KV cache's dtype (model: --dtype; FP8 with scale 1 on the backends that read it)")
    p.add_argument("--page-size", type=int, choices=(1, 16, 64), default=16)
    p.add_argument("--size", choices=("tiny", "bench"), default="tiny",
                   help="tiny: CPU test sizes; bench: TinyConfig.gpu_gqa/gpu_mla (4 layers, hidden 1024)")
    p.add_argument("--no-graphs", action="store_true", help="run every forward eagerly")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    p.add_argument("--tp", type=cli.count(1), default=1,
                   help="tensor-parallel ranks, one process each (gloo on cpu, NCCL on cuda: a GPU a rank)")
    p.add_argument("--tp-debug", action="store_true",
                   help="compare every rank's step (requests, tokens, KV slots) after each step; a divergence fails")
    p.set_defaults(handler=run_generate)


# the draft's flags, taken only with --spec eagle / eagle3, and the defaults of those that have one
SPEC_FLAGS = ("topk", "steps", "draft_tokens", "draft_layers", "acceptance")
SPEC_DEFAULTS = {"topk": 1, "steps": 3, "acceptance": "high"}


def engine_config(args) -> EngineConfig:
    """The engine of ``args``; UsageError, worded with the flags, for what it cannot take. Nothing
    is allocated here (the memory it would take is counted, not tried)."""
    tiny = TINY_MODELS[args.model]()
    if args.size == "bench":      # the benchmark sizes, with the tiny model's attention features
        features = {f: getattr(tiny, f) for f in ("sliding_window", "layer_pattern", "logit_softcap", "sinks")}
        base = TinyConfig.gpu_mla(**features) if tiny.is_mla else TinyConfig.gpu_gqa(**features)
    else:
        base = tiny
    model = replace(base, page_size=args.page_size, dtype=DTYPES[args.dtype], kv_dtype=KV_DTYPE_NAMES[args.kv_dtype])
    bad = [t for t in args.stop if not 0 <= t < model.vocab_size]
    if bad:
        raise UsageError(f"--stop {bad[0]} outside the vocabulary 0..{model.vocab_size - 1}")
    spec = None
    given = [f for f in SPEC_FLAGS if getattr(args, f) is not None]
    if args.spec == "none" and given:                 # a draft setting without a draft is a mistake, not a no-op
        flag = given[0]
        raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)} needs --spec eagle or eagle3 "
                         "(none drafts nothing)")
    for flag, default in SPEC_DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, default)
    try:
        if args.spec != "none":
            spec = SpecConfig(args.spec, args.topk, args.steps, args.draft_tokens or args.steps + 1,
                              noise=ACCEPTANCE_LEVELS[args.acceptance], draft_layers=args.draft_layers)
        ps = args.page_size
        ctx = -(-(args.prompt_len + args.max_tokens + (spec.headroom + 1 if spec else 0)) // ps) * ps
        prefill = max(16, args.batch * args.prompt_len)
        cfg = EngineConfig(model, args.backend, spec, args.device, max_batch=args.batch, max_context_len=ctx,
                           max_prefill_tokens=prefill, graphs=not args.no_graphs)
        reason = engine_refusal(cfg)
    except ConfigError as e:
        raise UsageError(e.render(FLAGS)) from None
    if reason is not None:
        raise UsageError(reason(FLAGS))
    too_big = limits.memory_refusal(cfg, f"--batch {args.batch} with --prompt-len {args.prompt_len} and "
                                         f"--max-tokens {args.max_tokens}")
    if too_big:
        raise UsageError(too_big)
    return cfg


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
    """Misuse raises UsageError (one line, exit status 2, from ``attn-backends``' main)."""
    out, err = out or sys.stdout, err or sys.stderr
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but CUDA is not available here")
    cfg = engine_config(args)
    if args.spec != "none" and args.dtype != "float32":
        print(f"generate: note: in {args.dtype} speculative tokens can differ from --spec none's where the top "
              "two logits nearly tie (the verify and decode kernels sum in different orders); float32: identical",
              file=err)
    if args.tp_debug and args.tp == 1:
        raise UsageError("--tp-debug compares ranks: it needs --tp 2 or more")
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        raise UsageError(f"--tp {args.tp} on cuda needs {args.tp} GPUs, this machine has {torch.cuda.device_count()}")
    if args.tp > 1:
        try:
            shard_config(cfg.model, TensorParallel(0, args.tp))
        except ConfigError as e:
            raise UsageError(e.render(FLAGS)) from None
        try:
            text = launch(_generate, args.tp, args.device, (cfg, args), debug=args.tp_debug)[0]
        except RankFailed as e:        # a setting a rank's model refuses: the one line of TP 1
            if e.error.startswith("UsageError: "):
                raise UsageError(e.error[len("UsageError: "):]) from None
            raise
    else:
        text = _generate(None, cfg, args, err)
    print(text, file=out, end="")
    return 0


def _generate(tp, cfg, args, err: TextIO = None) -> str:
    """One rank's generation (every rank runs the same requests): rank 0's report (progress to ``err``,
    default stderr), the other ranks' ''."""
    cfg = replace(cfg, tp=tp)
    out = io.StringIO()
    err = err or (sys.stderr if tp is None or tp.rank == 0 else io.StringIO())
    try:
        engine = Engine(cfg)
    except ValueError as e:                 # an unknown backend, or one that cannot serve this model
        raise UsageError(str(e)) from None
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
    kv = "" if args.kv_dtype == "model" else f", KV {args.kv_dtype}"
    tp_note = f", TP {args.tp}" if args.tp > 1 else ""
    print(f"\n{args.model} on {args.backend} ({args.device}, {args.dtype}{kv}, "
          f"{'eager' if args.no_graphs else 'graphs'}{tp_note}), {what}", file=out)
    mixed = [f"{ex.name} layers: {', '.join(f'{i} {n}' for i, n in ex.layer_names.items())}"    # pool layer ids
             for ex in engine.executors if ex.layer_names and set(ex.layer_names.values()) != {args.backend}]
    for line in mixed:           # layers whose window, sinks or cap the backend asked for lacks
        print(line, file=out)
    print(engine.summary(), file=out)
    return out.getvalue() if tp is None or tp.rank == 0 else ""


if __name__ == "__main__":      # python -m attn_backends_runtime.generate ...: `attn-backends generate ...`
    sys.exit(cli.main(["generate"] + sys.argv[1:]))
