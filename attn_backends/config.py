"""Model-level attention configuration and the per-layer record backends receive."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

# The FP8 KV cache dtypes a config may name (e4m3: more mantissa, the engines' default; e5m2: more range).
FP8_KV = (torch.float8_e4m3fn, torch.float8_e5m2)
# the command lines' names of a KV dtype (vLLM's --kv-cache-dtype names); model: the model's dtype
KV_DTYPE_NAMES = {"model": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Hugging Face's ``layer_types`` names of a layer's attention.
FULL, SLIDING = "full_attention", "sliding_attention"
# The attention features beyond plain causal attention, by the Capabilities flag that declares each.
FEATURES = ("windows", "sinks", "softcap")


@dataclass(frozen=True)
class ModelConfig:
    """The attention shape of a model, as backends and ``select`` see it.

    MHA/GQA: ``num_q_heads``, ``num_kv_heads``, ``head_dim`` (``v_head_dim`` defaults to it).
    MLA (absorbed): ``num_kv_heads == 1``; q and the cache rows are
    ``kv_lora_rank + qk_rope_head_dim`` wide (512 + 64); the output is ``kv_lora_rank`` wide.

    Attention beyond plain causal (Mistral, Gemma 2/3, gpt-oss), in Hugging Face's terms:
    ``sliding_window`` ``w``: the query at absolute position ``p`` attends the keys at ``p - w + 1 .. p``
    in the layers ``layer_types`` names ``"sliding_attention"`` (None: every layer, as Mistral's
    config says it); ``logit_softcap`` ``c``: every layer's scaled scores become ``c * tanh(s / c)``
    before masking; ``sinks``: every layer has a learned sink logit per query head, a weight the
    model hands to :meth:`layer` (the softmax denominator gains ``exp(sink)``, with no value).
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int = 1
    head_dim: int = 128
    v_head_dim: int = 0
    is_mla: bool = False
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128   # MLA: the unabsorbed head size; only the softmax scale uses it
    page_size: int = 1
    dtype: torch.dtype = torch.float32
    # The KV cache's dtype (None: the model's) and, for an FP8 cache, the per-tensor (k, v) scale of
    # each layer as checkpoints ship them (None: 1.0): the cache holds value / scale, saturated.
    kv_dtype: Optional[torch.dtype] = None
    kv_scales: Optional[tuple] = None
    sliding_window: Optional[int] = None
    layer_types: Optional[tuple] = None
    logit_softcap: Optional[float] = None
    sinks: bool = False

    def __post_init__(self) -> None:
        self._check_kv()
        self._check_layer_types()
        if self.is_mla:
            if self.num_kv_heads != 1:
                raise ValueError(f"MLA has one latent KV head, got num_kv_heads={self.num_kv_heads}")
        else:
            if self.num_q_heads % self.num_kv_heads:
                raise ValueError(f"num_q_heads={self.num_q_heads} is not a multiple of "
                                 f"num_kv_heads={self.num_kv_heads}")
            if not self.v_head_dim:
                object.__setattr__(self, "v_head_dim", self.head_dim)

    @property
    def qk_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def out_dim(self) -> int:
        return self.kv_lora_rank if self.is_mla else self.v_head_dim

    @property
    def sm_scale(self) -> float:
        if self.is_mla:
            return 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype the KV cache holds: ``kv_dtype``, else the model's."""
        return self.kv_dtype or self.dtype

    def _check_kv(self) -> None:
        if self.kv_dtype not in (None, self.dtype) + FP8_KV:
            raise ValueError(f"kv_dtype={self.kv_dtype} is neither the model's dtype {self.dtype} nor one of {FP8_KV}")
        if self.kv_scales is None:
            return
        object.__setattr__(self, "kv_scales", tuple((float(k), float(v)) for k, v in self.kv_scales))  # hashable
        if self.cache_dtype not in FP8_KV:
            raise ValueError(f"kv_scales need an FP8 kv_dtype {FP8_KV}, the cache is {self.cache_dtype}")
        if len(self.kv_scales) != self.num_layers:
            raise ValueError(f"kv_scales has {len(self.kv_scales)} (k, v) pairs, the model {self.num_layers} layers")
        for i, (ks, vs) in enumerate(self.kv_scales):
            if not (math.isfinite(ks) and math.isfinite(vs) and ks > 0 and vs > 0):
                raise ValueError(f"kv_scales[{i}] = ({ks}, {vs}): scales are finite and > 0")
            if self.is_mla and ks != vs:     # one latent row is both K and V
                raise ValueError(f"kv_scales[{i}] = ({ks}, {vs}): MLA's latent cache has one scale (k == v)")

    def _check_layer_types(self) -> None:
        w, types = self.sliding_window, self.layer_types
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"sliding_window={w!r} must be an int >= 1 (None: full attention)")
        if types is None:
            object.__setattr__(self, "layer_types", (SLIDING if w is not None else FULL,) * self.num_layers)
        else:
            types = tuple(types)                # hashable, as the config
            object.__setattr__(self, "layer_types", types)
            if len(types) != self.num_layers:
                raise ValueError(f"layer_types has {len(types)} entries, the model {self.num_layers} layers")
            bad = [t for t in types if t not in (FULL, SLIDING)]
            if bad:
                raise ValueError(f"layer_types entry {bad[0]!r} is neither {FULL!r} nor {SLIDING!r}")
            if SLIDING in types and w is None:
                raise ValueError(f"layer {types.index(SLIDING)} is {SLIDING!r} but sliding_window is None")
            if w is not None and SLIDING not in types:
                raise ValueError(f"sliding_window={w} but no layer of layer_types is {SLIDING!r}")
        c = self.logit_softcap
        if c is not None and not (isinstance(c, (int, float)) and math.isfinite(c) and c > 0):
            raise ValueError(f"logit_softcap={c!r} must be finite and > 0 (None: no cap)")

    def window(self, layer_id: int) -> Optional[int]:
        """Layer ``layer_id``'s sliding window (None: full attention)."""
        if not 0 <= layer_id < self.num_layers:      # a tuple index would wrap -1 to the last layer
            raise ValueError(f"layer_id={layer_id} outside 0..{self.num_layers - 1}")
        return self.sliding_window if self.layer_types[layer_id] == SLIDING else None

    def features(self, layer_id: Optional[int] = None) -> tuple:
        """The :data:`FEATURES` layer ``layer_id`` uses (None: any layer of the model)."""
        ids = range(self.num_layers) if layer_id is None else (layer_id,)
        on = {"windows": any(self.window(i) is not None for i in ids), "sinks": self.sinks,
              "softcap": self.logit_softcap is not None}
        return tuple(f for f in FEATURES if on[f])

    def layer(self, layer_id: int, sinks: Optional[torch.Tensor] = None) -> "AttentionLayer":
        """The record of layer ``layer_id``; ``sinks`` its sink logits ``[num_q_heads]`` (a model's
        learned weight: required exactly when the config says ``sinks``)."""
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(f"layer_id={layer_id} outside 0..{self.num_layers - 1}")
        if (sinks is not None) != self.sinks:
            raise ValueError(f"layer {layer_id}: the config says sinks={self.sinks}, "
                             f"sink logits {'given' if sinks is not None else 'missing'}")
        ks, vs = self.kv_scales[layer_id] if self.kv_scales is not None else (1.0, 1.0)
        return AttentionLayer(layer_id, self.num_q_heads, self.num_kv_heads, self.qk_dim,
                              self.out_dim, self.sm_scale, self.is_mla, float(ks), float(vs),
                              self.window(layer_id), self.logit_softcap, sinks)


@dataclass(frozen=True)
class AttentionLayer:
    """What ``forward`` needs to know of the calling layer.

    ``window``: the query at absolute position ``p`` attends keys ``p - window + 1 .. p`` (None: all
    it may see); ``softcap``: scaled scores become ``softcap * tanh(s / softcap)`` before masking;
    ``sinks``: ``[num_q_heads]`` float logits, ``exp(sinks[h])`` joins head ``h``'s softmax
    denominator with no value. ``features`` names the ones set (``config.FEATURES``).
    """

    layer_id: int
    num_q_heads: int
    num_kv_heads: int
    qk_dim: int
    v_dim: int
    scaling: float
    is_mla: bool = False
    k_scale: float = 1.0      # an FP8 cache's per-tensor scales: the cache holds value / scale
    v_scale: float = 1.0
    window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = field(default=None, compare=False)   # a weight: not part of equality

    def __post_init__(self) -> None:
        if self.is_mla and self.k_scale != self.v_scale:     # one latent row is both K and V
            raise ValueError(f"MLA layer {self.layer_id}: k_scale {self.k_scale} != v_scale {self.v_scale} "
                             "(the latent cache has one scale)")
        w, c, s = self.window, self.softcap, self.sinks
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"layer {self.layer_id}: window={w!r} must be an int >= 1 (None: full attention)")
        if c is not None and not (isinstance(c, (int, float)) and math.isfinite(c) and c > 0):
            raise ValueError(f"layer {self.layer_id}: softcap={c!r} must be finite and > 0 (None: no cap)")
        if s is not None:
            if not isinstance(s, torch.Tensor) or not s.is_floating_point() or tuple(s.shape) != (self.num_q_heads,):
                what = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
                raise ValueError(f"layer {self.layer_id}: sinks must be a float tensor "
                                 f"[num_q_heads={self.num_q_heads}], got {what}")
        on = {"windows": w is not None, "sinks": s is not None, "softcap": c is not None}
        object.__setattr__(self, "features", frozenset(f for f in FEATURES if on[f]))   # read on every forward
