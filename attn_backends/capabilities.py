"""What a backend declares it can do (:class:`Capabilities`) and how much of a forward a CUDA graph
may hold (:class:`GraphSupport`); ``select``, ``list`` and the suites decide from them alone.
``attn_backends.base`` re-exports both."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

from .batch import ForwardMode
from .config import FP8_KV, ModelConfig

# How a refusal names each attention feature (config.FEATURES) a backend does not declare.
FEATURE_WORDS = {"windows": "sliding windows", "sinks": "attention sinks", "softcap": "logit softcapping"}


class GraphSupport(enum.IntEnum):
    """How much of a forward a backend lets a CUDA graph hold (ordered)."""

    NEVER = 0
    UNIFORM_BATCH = 1   # DECODE / TARGET_VERIFY / DRAFT_EXTEND at a fixed (bs, W)
    ALWAYS = 2


@dataclass(frozen=True)
class Capabilities:
    """What a backend declares it can do; ``select``, ``list`` and the suite decide from it alone.

    Attributes
    ----------
    modes : frozenset of ForwardMode
        The forward modes it runs (EXTEND, DECODE, TARGET_VERIFY, DRAFT_EXTEND).
    mha, mla : bool
        Whether it runs MHA/GQA models, and (absorbed) MLA models.
    page_sizes : tuple of int
        KV page sizes it supports (the memory's ``page_size``).
    topk_gt1 : bool
        Tree verify (TARGET_VERIFY with ``topk > 1``, a ``custom_mask``) and draft decode with
        several branches per request (the draft-branch mask).
    draft_decode : bool
        Multi-step draft decode (DECODE with ``spec_info.draft_step > 0``).
    graph : GraphSupport
        How much of a forward a CUDA graph may hold with it (UNIFORM_BATCH: captured per
        GraphKey; NEVER: eager only).
    devices : tuple of str
        "cpu" and/or "cuda".
    min_sm : int
        Least CUDA compute capability (90 for Hopper-only kernels; 0: any).
    head_dims : tuple of int or None
        Supported ``qk_dim`` (head dim, or latent + rope for MLA); None: any.
    requires : tuple of str
        Importable modules it needs; a missing one makes it unavailable with an install hint.
    preference : int
        ``select()`` ranks backends that serve a request by this first (higher first; the
        built-ins declare 0), then registry order; the reference ``torch_native`` comes last.
    dtypes : tuple of torch.dtype
        Model dtypes (q, the output, the KV it is handed).
    kv_dtypes : tuple of torch.dtype
        KV cache dtypes it reads besides the model's (``config.FP8_KV``; ``ModelConfig.kv_dtype``).
    fp8_min_sm : int
        Least CUDA compute capability on which it reads an FP8 cache (89: kernels that convert
        FP8 in hardware; 0: any, as PyTorch's casts).
    fp8_model_dtypes : tuple of torch.dtype or None
        The model dtypes with which it reads an FP8 cache (None: each of ``dtypes``).
    fp8_below_sm : int or None
        An FP8 cache read only on GPUs below this compute capability (None: no ceiling).
    windows, sinks, softcap : bool
        Sliding-window layers, per-head sink logits and logit softcapping (``ModelConfig``'s
        ``sliding_window``, ``sinks``, ``logit_softcap``); a backend that does not declare one is
        refused the models (or with ``layer``, the layers) that use it.
    topk_gt1_features : tuple of str or None
        The features it serves with ``topk > 1`` (None: every one it declares); a model using
        another is refused ``topk > 1``.
    apart : tuple of (str, str)
        Pairs of declared features it does not serve in one model.
    why_not : tuple of (str, str)
        ``(feature, reason)``: why a feature is refused (not declared, not with ``topk > 1``, or not
        with the other of an ``apart`` pair: key ``"a+b"``), appended to that refusal.
    layout_only : str
        Why its ``forward`` cannot run on any declared device (empty: it runs): an adapter of an
        engine whose kernel needs hardware the check does not run on. ``check`` then runs the
        layout invariants alone and reports the checks that need a forward as not run, with this
        reason; ``select`` refuses it for serving.
    """

    modes: frozenset
    mha: bool = True
    mla: bool = False
    page_sizes: tuple = (1, 16, 64)
    topk_gt1: bool = False
    draft_decode: bool = True
    graph: GraphSupport = GraphSupport.UNIFORM_BATCH
    devices: tuple = ("cpu", "cuda")
    min_sm: int = 0
    head_dims: Optional[tuple] = None
    requires: tuple = ()
    preference: int = 0
    dtypes: tuple = (torch.float32, torch.float16, torch.bfloat16)
    kv_dtypes: tuple = ()
    fp8_min_sm: int = 89
    fp8_model_dtypes: Optional[tuple] = None
    fp8_below_sm: Optional[int] = None
    mode_graph: tuple = ()
    cannot: str = ""
    windows: bool = False
    sinks: bool = False
    softcap: bool = False
    topk_gt1_features: Optional[tuple] = None
    apart: tuple = ()
    why_not: tuple = ()
    layout_only: str = ""

    def features(self) -> tuple:
        """The attention features (``config.FEATURES``) it declares."""
        return tuple(f for f in FEATURE_WORDS if getattr(self, f))

    def kv_reads(self) -> str:
        """The KV caches it reads, in words: "the model's dtype[, float8_e4m3fn, ...]"."""
        return "the model's dtype" + "".join(f", {str(d)[6:]}" for d in self.kv_dtypes)

    def graph_for(self, mode: ForwardMode) -> GraphSupport:
        """The graph support of ``mode`` (``graph`` unless ``mode_graph`` says otherwise)."""
        return dict(self.mode_graph).get(mode, self.graph)

    def refusal(self, cfg: ModelConfig, mode: Optional[ForwardMode] = None, device: str = "cpu",
                sm: Optional[int] = 0, topk: int = 1, layer: Optional[int] = None) -> Optional[str]:
        """Why this backend cannot serve ``cfg``/``mode`` (with ``topk`` branches) on ``device`` of
        compute capability ``sm`` (None: not checked); None if it can. ``layer``: serve that layer
        alone (its window, sinks, cap); None: every layer. The model's and the request's reasons
        come first (they hold on any device), then the device's."""
        if cfg.is_mla and not self.mla:
            return "MHA/GQA only, model is MLA"
        if not cfg.is_mla and not self.mha:
            return "MLA only, model is MHA/GQA"
        if cfg.page_size not in self.page_sizes:
            return f"page_size={cfg.page_size} not in {self.page_sizes}"
        if mode is not None and mode not in self.modes:
            return f"mode {mode.name} not supported"
        if topk > 1 and not self.topk_gt1:
            return f"topk={topk} > 1 not supported" + (f": {self.cannot}" if self.cannot else "")
        if self.head_dims is not None and cfg.qk_dim not in self.head_dims:
            return f"head_dim={cfg.qk_dim} not in {self.head_dims}"
        if cfg.dtype not in self.dtypes:
            return f"dtype {str(cfg.dtype)[6:]} not in ({', '.join(str(d)[6:] for d in self.dtypes)})"
        if cfg.cache_dtype != cfg.dtype and cfg.cache_dtype not in self.kv_dtypes:
            return f"KV dtype {str(cfg.cache_dtype)[6:]} not read ({self.kv_reads()})"
        fp8 = cfg.cache_dtype in FP8_KV
        if fp8 and (why := self.fp8_model_refusal(cfg)):
            return why
        value = {"windows": f" (w={cfg.sliding_window})", "softcap": f" (c={cfg.logit_softcap})", "sinks": ""}
        used, why = cfg.features(layer), dict(self.why_not)
        missing = [f for f in used if not getattr(self, f)]
        where = f" in layer {layer}" if layer is not None else ""
        if missing:     # an MLA kernel has no reason to grow them: no MLA model uses them
            return (f"{', '.join(FEATURE_WORDS[f] + value[f] for f in missing)} not supported"
                    + (" (no MLA model uses them)" if cfg.is_mla else "") + where
                    + "".join(f": {why[f]}" for f in missing if f in why))
        for a, b in self.apart:
            if a in used and b in used:
                return (f"{FEATURE_WORDS[a]} with {FEATURE_WORDS[b]}{value[b]} not supported" + where
                        + (f": {why[a + '+' + b]}" if a + "+" + b in why else ""))
        off = [f for f in used if topk > 1 and self.topk_gt1_features is not None and f not in self.topk_gt1_features]
        if off:
            return (f"{', '.join(FEATURE_WORDS[f] + value[f] for f in off)} with topk={topk} > 1 not supported"
                    + where + "".join(f": {why[f]}" for f in off if f in why))
        if device not in self.devices:
            return f"device {device} not supported (needs {', '.join(self.devices)})"
        if self.layout_only:
            return f"its forward does not run here, layout checks only: {self.layout_only}"
        if device == "cuda" and sm is not None and sm < self.min_sm:
            return f"needs sm_{self.min_sm}+, device is sm_{sm}"
        if device == "cuda" and sm is not None and fp8:
            return self.fp8_gpu_refusal(sm)
        return None

    def fp8_model_refusal(self, cfg: ModelConfig) -> Optional[str]:
        """Why it cannot read an FP8 cache for ``cfg``'s model dtype; None if it can."""
        if self.fp8_model_dtypes is not None and cfg.dtype not in self.fp8_model_dtypes:
            return (f"an FP8 KV cache is read with a {' or '.join(str(d)[6:] for d in self.fp8_model_dtypes)} "
                    f"model only, model is {str(cfg.dtype)[6:]}")
        return None

    def fp8_gpu_refusal(self, sm: int) -> Optional[str]:
        """Why it cannot read an FP8 cache on a GPU of compute capability ``sm``; None if it can."""
        if sm < self.fp8_min_sm:
            return f"an FP8 KV cache needs sm_{self.fp8_min_sm}+ (FP8 conversions), device is sm_{sm}"
        if self.fp8_below_sm is not None and sm >= self.fp8_below_sm:
            return f"an FP8 KV cache is read below sm_{self.fp8_below_sm} only, device is sm_{sm}"
        return None
