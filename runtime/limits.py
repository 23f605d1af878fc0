"""Refusals of bad engine settings, before anything is allocated.

One rule, one message, two namings: the Python API names its fields (``num_steps=80``),
``attn-backends generate`` its flags (``--steps 80``). A :class:`ConfigError` keeps the message
as a function of the naming (:class:`Names`), so the command line re-words it without a second
copy of the rule.

Memory: :func:`engine_bytes` counts what an engine allocates up front (the KV pool, the request
table, the draft's feature pool, the weights, the captured graphs' layout buffers, the largest
prefill's logits); :func:`memory_refusal` compares it with what the device has free (CUDA:
``torch.cuda.mem_get_info``; CPU: ``MemAvailable`` of ``/proc/meminfo``, else psutil where
installed; neither: no check). It is a lower bound: activations and allocator slack come on top.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

GiB = 2 ** 30


class Names:
    """How a message names a setting: ``flags`` maps field names to command-line flags."""

    def __init__(self, flags: Optional[dict] = None) -> None:
        self.flags = flags or {}

    def __call__(self, field: str) -> str:
        return self.flags.get(field, field)

    def set(self, field: str, value) -> str:
        """A setting and its value: ``num_steps=80`` or ``--steps 80``."""
        flag = self.flags.get(field)
        return f"{flag} {value}" if flag else f"{field}={value}"


FIELDS = Names()


class ConfigError(ValueError):
    """A setting refused; ``render(names)`` words the message for the API or the command line."""

    def __init__(self, render: Callable[[Names], str]) -> None:
        self.render = render
        super().__init__(render(FIELDS))


def size(n: int) -> str:
    return f"{n:,} bytes ({n / GiB:.1f} GiB)"


def available_bytes(device) -> Optional[tuple]:
    """``(bytes, where they were read)`` free for new tensors on ``device``; None: unknown here."""
    dev = torch.device(device)
    if dev.type == "cuda":   # what PyTorch's allocator holds unused is free to this process too
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return (torch.cuda.mem_get_info(dev)[0] + cached,
                "free on the GPU (torch.cuda.mem_get_info) plus held unused by PyTorch's allocator")
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kb * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, StopIteration, ValueError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory().available, "available (psutil)"


def weight_count(model_config, aux_hidden_layers=()) -> int:
    """Parameters of the target, counted on the meta device (nothing allocated)."""
    from .models import TinyModel
    with torch.random.fork_rng(devices=[]), torch.device("meta"):     # TinyModel seeds the global RNG
        return sum(p.numel() for p in TinyModel(model_config, "meta", aux_hidden_layers).parameters())


def engine_bytes(cfg) -> dict:
    """What an engine of :class:`EngineConfig` ``cfg`` allocates up front, by part, in bytes."""
    c, spec = cfg.model, cfg.spec
    elt = torch.finfo(c.dtype).bits // 8
    slots = cfg.pages * c.page_size
    per_slot = c.kv_lora_rank + c.qk_rope_head_dim if c.is_mla else 2 * c.num_kv_heads * c.head_dim
    aux = spec.target_aux_layers(c.num_layers) if spec else ()
    kv_elt = torch.finfo(c.attention().cache_dtype).bits // 8
    parts = {"the KV pool": (c.num_layers + cfg.draft_layers) * slots * per_slot * kv_elt,
             "the request table": (cfg.max_batch + 1) * cfg.max_context_len * 4,
             "the weights": weight_count(c, aux) * elt,
             "the prefill logits": cfg.max_prefill_tokens * c.vocab_size * 4}
    if spec:
        features = c.hidden_size * max(1, len(aux))
        parts["the draft's features"] = slots * features * elt
        parts["the weights"] += (c.vocab_size + features) * c.hidden_size * elt   # its noise head and fc
    if cfg.graphs:          # page table + kv indices of each graph step: decode or verify, draft extend, steps
        steps, max_bs = 1 + (spec.num_steps if spec else 0), max(cfg.buckets or (cfg.max_batch,))
        parts["the graphs' layout buffers"] = steps * 2 * max_bs * (cfg.max_context_len // c.page_size) * 4
    return parts


def memory_refusal(cfg, subject: str) -> Optional[str]:
    """Why an engine of ``cfg`` cannot fit on its device (``subject`` names the settings), or None."""
    free = available_bytes(cfg.device)
    if free is None:
        return None
    parts = engine_bytes(cfg)
    need = sum(parts.values())
    if need <= free[0]:
        return None
    big = max(parts, key=parts.get)
    return (f"{subject}: the engine would take at least {size(need)}, {big} {parts[big] / GiB:.1f} GiB of it; "
            f"{size(free[0])} available ({free[1]})")
