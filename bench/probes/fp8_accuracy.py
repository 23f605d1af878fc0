"""What an FP8 KV cache costs in accuracy on the tiny models (issue #41): one prefill (EXTEND) of
random prompts through the model in its dtype, the cache in the model's dtype against e4m3 and
e5m2 (scale 1, and a scale from the cache's own largest value: amax / the format's largest finite),
the logits compared (max abs difference, the least and mean cosine of a row, top-1 agreement).

    python bench/probes/fp8_accuracy.py [--device cuda] [--size bench] [--dtype bfloat16]

Every backend reads the same bytes the same way up to its rounding; this runs ``torch_native``,
the reference (the FP8 cache dequantized to float32).
"""
from __future__ import annotations

import argparse
import random
from dataclasses import replace

import torch

from attn_backends import get_backend
from attn_backends.check.scenarios import make_memory
from attn_backends_runtime.batches import extend_batch
from attn_backends_runtime.models import TinyConfig, TinyModel
from attn_backends_runtime.runner_base import run_eager

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def prefill(tc: TinyConfig, prompts: list, device: str, model=None) -> torch.Tensor:
    """The logits of one EXTEND of ``prompts`` (``model``: the model of ``tc`` unless given)."""
    model = model or TinyModel(tc, device)
    ps = tc.page_size
    mem = make_memory(tc.attention(), num_pages=sum(-(-len(p) // ps) for p in prompts) + 2,
                      max_reqs=len(prompts), max_context_len=-(-max(len(p) for p in prompts) // ps) * ps,
                      page_order="shuffled", device=device, fill=False)
    rows = [mem.new_request() for _ in prompts]
    for r, p in zip(rows, prompts):
        mem.extend(r, len(p))
    backend = get_backend("torch_native", tc.attention(), mem)
    return run_eager(model, backend, extend_batch(mem, rows, [0] * len(prompts), prompts), 0).logits.float()


def kv_amax(tc: TinyConfig, prompts: list, device: str) -> float:
    """The largest |K| or |V| the model writes for these prompts (its cache in the model's dtype)."""
    model = TinyModel(tc, device)
    seen = []
    for block in model.layers:
        def spy(h, pos, _orig=block.pre_attn):
            q, k, v = _orig(h, pos)
            seen.extend(float(t.abs().max()) for t in (k, v) if t is not None)
            return q, k, v
        block.pre_attn = spy
    prefill(tc, prompts, device, model)
    return max(seen)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", choices=("tiny", "bench"), default="tiny")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    args = p.parse_args(argv)
    rng = random.Random(0)
    print(f"torch {torch.__version__}, {args.device}, {args.size}, {args.dtype}, torch_native, "
          f"{args.batch} prompts of {args.prompt_len // 2}-{args.prompt_len} tokens")
    print("| model | cache | scale | max abs | cosine min | cosine mean | top-1 agree |")
    print("|---|---|---|---:|---:|---:|---:|")
    for mla in (False, True):
        base = (TinyConfig.gpu_mla() if mla else TinyConfig.gpu_gqa()) if args.size == "bench" else \
            TinyConfig(is_mla=mla, page_size=16)
        tc = replace(base, dtype=DTYPES[args.dtype])
        prompts = [[rng.randrange(tc.vocab_size) for _ in range(rng.randint(args.prompt_len // 2, args.prompt_len))]
                   for _ in range(args.batch)]
        ref = prefill(tc, prompts, args.device)
        amax = kv_amax(tc, prompts, args.device)
        for name, kv in KV.items():
            for scale in (1.0, amax / torch.finfo(kv).max):
                got = prefill(replace(tc, kv_dtype=kv, kv_scale=(scale, scale)), prompts, args.device)
                cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
                agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
                print(f"| tiny-{'mla' if mla else 'gqa'} | {name} | {scale:.3g} | {float((got - ref).abs().max()):.4f} "
                      f"| {float(cos.min()):.5f} | {float(cos.mean()):.5f} | {agree:.3f} |", flush=True)


if __name__ == "__main__":
    main()
