"""``hybrid``: a composite backend that delegates each forward mode to a sub-backend.

The registered ``hybrid`` runs EXTEND (prefill) on FlashInfer (``flashinfer`` /
``flashinfer_mla``) and DECODE, TARGET_VERIFY and DRAFT_EXTEND on our Triton kernels
(``triton`` / ``triton_mla``). :func:`compose` builds (and may register) any other
composition, :func:`compose_selected` the one :func:`attn_backends.select` picks per mode.
Per-layer choice is the model's: ``TinyModel`` takes a backend per layer, and a runner
refreshes each distinct instance.

Capabilities: the union of the modes, and per mode the delegate's (its graph support, in
``mode_graph``); what every delegate must allow (page sizes, devices, dtypes, head dims, topk)
is intersected, and ``graph`` is the least graph support of any mode. Every call goes to the
delegate of the batch's mode; a replay refreshes that delegate (the one whose metadata the
captured graph reads, so ``sub_backends(mode)`` of the runner suite's I12 check), whose own
refresh covers its plans and wrappers.
"""
from __future__ import annotations

import re
from types import MappingProxyType
from typing import ClassVar, Optional

import torch

from ..base import AttentionBackend, Capabilities, GraphSupport
from ..batch import ForwardBatch, ForwardMode, GraphInputs
from ..config import FEATURES
from ..layout import LayoutError

UNIFORM = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)
DEFAULT = MappingProxyType({ForwardMode.EXTEND: ("flashinfer", "flashinfer_mla"),
                            **{m: ("triton", "triton_mla") for m in UNIFORM}})   # read only


def _pair(name) -> tuple:
    """``(MHA backend, MLA backend)`` of a composition entry: a name serves both kinds, a pair
    names one per kind (None: that kind is not served)."""
    return tuple(name) if isinstance(name, (tuple, list)) else (name, name)


def _mode(m) -> ForwardMode:
    return m if isinstance(m, ForwardMode) else ForwardMode[str(m).upper()]


def _fp8_model_dtypes(caps: list) -> Optional[tuple]:
    """The model dtypes with which every member reads an FP8 cache (None: no member limits them)."""
    limits = [c.fp8_model_dtypes for c in caps if c.fp8_model_dtypes is not None]
    return tuple(d for d in limits[0] if all(d in x for x in limits)) if limits else None


def compose_capabilities(by_mode: dict) -> Capabilities:
    """The capabilities of a composition ``{ForwardMode: (mha name, mla name)}``."""
    from ..registry import get_backend_class
    chains = [[get_backend_class(p[k]).capabilities for p in by_mode.values() if p[k]] for k in (0, 1)]
    kinds = [bool(ch) and all(p[k] for p in by_mode.values()) for k, ch in enumerate(chains)]
    mha = kinds[0] and all(c.mha for c in chains[0])
    mla = kinds[1] and all(c.mla for c in chains[1])
    caps = [c for k, ch in enumerate(chains) if (mha, mla)[k] for c in ch] or chains[0] + chains[1]
    per_mode = {m: [get_backend_class(n).capabilities for n in p if n] for m, p in by_mode.items()}
    mode_graph = tuple((m, min(c.graph_for(m) for c in cs)) for m, cs in sorted(per_mode.items()))
    common = lambda field: tuple(x for x in getattr(caps[0], field)  # noqa: E731
                                 if all(x in getattr(c, field) for c in caps))
    heads = [c.head_dims for c in caps if c.head_dims is not None]
    topk_users = [c for m in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY) for c in per_mode.get(m, [])]
    return Capabilities(
        modes=frozenset(by_mode), mha=mha, mla=mla, page_sizes=common("page_sizes"),
        topk_gt1=bool(topk_users) and all(c.topk_gt1 for c in topk_users),
        draft_decode=all(c.draft_decode for c in per_mode.get(ForwardMode.DECODE, [])),
        graph=min((g for _, g in mode_graph), default=GraphSupport.NEVER), mode_graph=mode_graph,
        devices=common("devices"), min_sm=max(c.min_sm for c in caps),
        head_dims=tuple(sorted({d for h in heads for d in h})) if heads else None,
        dtypes=common("dtypes"), kv_dtypes=common("kv_dtypes"), fp8_min_sm=max(c.fp8_min_sm for c in caps),
        fp8_model_dtypes=_fp8_model_dtypes(caps), fp8_below_sm=min((c.fp8_below_sm for c in caps
                                                                    if c.fp8_below_sm is not None), default=None),
        cannot="; ".join(sorted({c.cannot for c in topk_users if c.cannot})),
        topk_gt1_features=tuple(f for f in FEATURES if all(f in (c.features() if c.topk_gt1_features is None
                                                                 else c.topk_gt1_features) for c in topk_users)),
        apart=tuple(dict.fromkeys(p for c in caps for p in c.apart)),
        why_not=tuple(dict.fromkeys(p for c in caps + topk_users for p in c.why_not)),
        layout_only="; ".join(dict.fromkeys(c.layout_only for c in caps if c.layout_only)),   # one layout-only part
        **{f: all(getattr(c, f) for c in caps) for f in FEATURES})    # every delegate runs every layer


class HybridBackend(AttentionBackend):
    name: ClassVar[str] = "hybrid"
    by_mode: ClassVar[dict] = DEFAULT

    def __init__(self, config, memory) -> None:
        super().__init__(config, memory)
        from ..registry import get_backend
        names = {m: p[1 if config.is_mla else 0] for m, p in self.by_mode.items()}
        missing = [m.name for m, n in names.items() if not n]
        if missing:
            raise ValueError(f"backend {self.name} serves no {'MLA' if config.is_mla else 'MHA/GQA'} model "
                             f"in {', '.join(missing)}")
        instances = {n: get_backend(n, config, memory) for n in dict.fromkeys(names.values())}
        self.delegates = {m: instances[n] for m, n in names.items()}
        self._active: Optional[AttentionBackend] = None

    @property
    def replay_work(self) -> bool:
        """A runner may record the step's prep in its graph only if no delegate does replay work."""
        return any(getattr(d, "replay_work", True) for d in self.sub_backends())

    @classmethod
    def extra_unavailable_reason(cls, device: str) -> Optional[str]:
        from ..registry import get_backend_class, unavailable_reason
        for m, p in cls.by_mode.items():
            for n in dict.fromkeys(x for x in p if x):
                why = unavailable_reason(get_backend_class(n), device)
                if why:
                    return f"{m.name} runs on {n}: {why}"
        return None

    # -- which delegate
    def sub_backends(self, mode: Optional[ForwardMode] = None) -> list:
        """The distinct delegates (of ``mode``, or of every mode)."""
        ds = [d for m, d in self.delegates.items() if mode is None or m == mode]
        return list({id(d): d for d in ds}.values())

    def _delegate(self, mode: ForwardMode) -> AttentionBackend:
        d = self.delegates.get(mode)
        if d is None:
            raise LayoutError(f"backend {self.name} does not run mode {mode.name}; it runs "
                              f"{sorted(m.name for m in self.delegates)}")
        return d

    @property
    def forward_metadata(self):
        return None if self._active is None else self._active.forward_metadata

    @forward_metadata.setter
    def forward_metadata(self, value) -> None:
        if value is not None:
            raise AttributeError("a hybrid backend's metadata is its active delegate's")

    # -- the contract, delegated
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._active = self._delegate(batch.forward_mode)
        self._active.init_forward_metadata(batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        for d in self.sub_backends():
            d.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, inputs: GraphInputs) -> None:
        self._active = self._delegate(inputs.key.forward_mode)
        self._active.init_forward_metadata_capture_cuda_graph(inputs)

    def init_forward_metadata_replay_cuda_graph(self, inputs: GraphInputs) -> None:
        self._active = self._delegate(inputs.key.forward_mode)
        self._active.init_forward_metadata_replay_cuda_graph(inputs)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return max(d.get_cuda_graph_seq_len_fill_value() for d in self.sub_backends())

    def graph_buffers(self) -> dict[str, torch.Tensor]:
        out = {}
        for d in self.sub_backends():
            out.update({f"{d.name}.{k}": v for k, v in d.graph_buffers().items()})
        return out

    @property
    def graph_steps(self) -> list:
        views = [v for d in self.sub_backends() for v in getattr(d, "graph_steps", [])]
        return list({v.origin: v for v in views}.values())

    def forward(self, q, k, v, layer, batch: ForwardBatch, save_kv_cache: bool = True):
        return self._delegate(batch.forward_mode).forward(q, k, v, layer, batch, save_kv_cache)


HybridBackend.capabilities = compose_capabilities(HybridBackend.by_mode)


def compose(by_mode: dict, name: Optional[str] = None) -> type:
    """A :class:`HybridBackend` class running ``by_mode`` (``{mode: backend}``; a mode is a
    ForwardMode or its name, a backend a registered name or an ``(MHA, MLA)`` pair). With
    ``name`` it is registered (``attn_backends.register``), so ``get_backend``, ``list`` and the
    suites know it by that name in this process."""
    from .. import registry
    table = {_mode(m): _pair(n) for m, n in by_mode.items()}
    label = name or "hybrid(" + ",".join(f"{m.name.lower()}={'/'.join(filter(None, p))}"
                                         for m, p in table.items()) + ")"
    cls = type(f"Hybrid_{re.sub(r'[^0-9A-Za-z_]', '_', label)}", (HybridBackend,),
               {"name": label, "by_mode": table, "__module__": __name__})
    cls.capabilities = compose_capabilities(table)
    if name is not None:
        globals()[cls.__name__] = cls                # importable as module:Class, so the registry is lazy
        registry.register(name, f"{__name__}:{cls.__name__}")
    return cls


def compose_selected(model_config, device: Optional[str] = None, name: Optional[str] = None,
                     modes=(ForwardMode.EXTEND, *UNIFORM)) -> tuple:
    """``(class, {mode: Selection})``: the backend :func:`attn_backends.select` picks for each
    mode (hybrids excluded), composed; every Selection carries the reason of each refusal."""
    from ..registry import list_backends, select
    hybrids = [i.name for i in list_backends(device) if i.target.startswith(f"{__name__}:")]
    picks = {m: select(model_config, mode=m, device=device, exclude=hybrids) for m in modes}
    names = {m: (s.name, None) if not model_config.is_mla else (None, s.name) for m, s in picks.items()}
    return compose(names, name), picks
