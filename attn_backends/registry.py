"""A registry of lazy backend factories.

Entries are ``"module:Class"`` strings (or ``"path/to/file.py:Class"``): importing
:mod:`attn_backends` imports no backend module, no optional dependency, and allocates
nothing on a GPU. Third-party backends join through the ``attn_backends.backends``
entry-point group and are checked by the same suite.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from .base import AttentionBackend, Capabilities
from .batch import ForwardMode
from .config import FP8_KV, ModelConfig

ENTRY_POINT_GROUP = "attn_backends.backends"
REFERENCE = "torch_native"   # select() takes it only when no other backend serves
ENV_BACKEND = "ATTN_BACKENDS_BACKEND"   # forces select()'s choice from outside (vLLM: VLLM_ATTENTION_BACKEND)
AUTO = "auto"                           # select()'s own choice, whatever the variable says
_MODES = {m.name.lower(): m for m in ForwardMode if m != ForwardMode.IDLE}   # per-mode override keys

# Built-in order, the tie-break of select() after the declared preference: fastest first.
_BUILTIN: dict[str, str] = {
    "flashinfer_mla": "attn_backends.backends.flashinfer_mla:FlashInferMLABackend",
    "triton_mla": "attn_backends.backends.triton_mla:TritonMLABackend",
    "trtllm_mla": "attn_backends.backends.trtllm_mla:TrtllmMLABackend",
    "triton": "attn_backends.backends.triton_backend:TritonBackend",
    "flashinfer": "attn_backends.backends.flashinfer_backend:FlashInferBackend",
    "hybrid": "attn_backends.backends.hybrid:HybridBackend",
    "torch_native": "attn_backends.backends.torch_native:TorchNativeBackend",
}
_extra: dict[str, str] = {}


def register(name: str, target: str) -> None:
    """Register ``"module:Class"`` under ``name`` (lazy: nothing is imported here)."""
    if ":" not in target:
        raise ValueError(f"target {target!r} must look like 'package.module:Class'")
    _extra[name] = target


def builtin_names() -> list[str]:
    """The backends this distribution ships, in built-in order (installed plugins excluded)."""
    return list(_BUILTIN)


def _installed() -> dict[str, str]:
    """Plugins of installed distributions (the entry-point group), sorted by name."""
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    return {ep.name: ep.value for ep in sorted(eps, key=lambda e: e.name)}


def _entries() -> dict[str, str]:
    """Built-ins, then installed plugins, then run-time registrations (which may override)."""
    out = dict(_BUILTIN)
    for name, target in _installed().items():
        out.setdefault(name, target)
    out.update(_extra)
    return out


def load_class(target: str):
    """The backend class named by ``"package.module:Class"`` or ``"path/to/file.py:Class"``.

    ValueError with the cause when the module or file cannot be imported, the name is missing,
    or the object is not an :class:`AttentionBackend` subclass with ``capabilities``.
    """
    mod, _, name = target.rpartition(":")
    if not mod or not name:
        raise ValueError(f"backend {target!r} is neither a registered name nor 'module:Class' / 'file.py:Class'")
    try:
        module = _load_file(mod) if mod.endswith(".py") or "/" in mod or os.sep in mod else importlib.import_module(mod)
        obj = getattr(module, name)
    except Exception as e:  # noqa: BLE001 - importing user code can raise anything; name the cause
        raise ValueError(f"cannot load backend class {target!r}: {type(e).__name__}: {e}") from e
    if not (isinstance(obj, type) and issubclass(obj, AttentionBackend)):
        what = type(obj).__name__ if not isinstance(obj, type) else f"class {obj.__qualname__}"
        raise ValueError(f"{target!r} is a {what}, not a subclass of attn_backends.AttentionBackend")
    if not isinstance(getattr(obj, "capabilities", None), Capabilities):
        raise ValueError(f"{target!r} declares no `capabilities = Capabilities(...)`")
    return obj


def _load_file(path: str):
    """Import a source file once per absolute path, under a module name derived from it."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise FileNotFoundError(f"no file {path!r} (from {os.getcwd()})")
    key = "attn_backends_file_" + re.sub(r"\W", "_", full)
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module          # before exec: dataclasses and pickling look the module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    return module


def device_sm() -> int:
    if not torch.cuda.is_available():
        return 0
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def unavailable_reason(cls, device: str) -> Optional[str]:
    """Why ``cls`` cannot run on ``device`` on this machine (None: it can)."""
    caps = cls.capabilities
    for mod in caps.requires:
        if importlib.util.find_spec(mod) is None:
            return f"python package '{mod}' is not installed (pip install 'attn-backends[{mod}]')"
    if device not in caps.devices:
        return f"does not run on {device} (runs on {', '.join(caps.devices)})"
    if device == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available on this machine"
        if device_sm() < caps.min_sm:
            return f"needs sm_{caps.min_sm}+, this GPU is sm_{device_sm()}"
    extra = getattr(cls, "extra_unavailable_reason", None)
    return extra(device) if extra else None


@dataclass(frozen=True)
class BackendInfo:
    name: str
    target: str
    available: bool
    reason: Optional[str]
    capabilities: object


def list_backends(device: Optional[str] = None) -> list[BackendInfo]:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = []
    for name, target in _entries().items():
        try:
            cls = load_class(target)
        except ValueError as e:
            out.append(BackendInfo(name, target, False, str(e), None))
            continue
        reason = unavailable_reason(cls, device)
        out.append(BackendInfo(name, target, reason is None, reason, cls.capabilities))
    return out


def _target(name: str) -> str:
    """``_entries().get(name, name)`` without reading the installed metadata for a name that a
    run-time registration or a built-in settles (installed plugins never override a built-in).
    Every layout case looks up its reference (``torch_native``), every runner case its backend,
    and reading the entry points scans every installed distribution's metadata: hundreds of
    scans would dominate a check's host time."""
    if name in _extra:
        return _extra[name]
    if name in _BUILTIN:
        return _BUILTIN[name]
    return _installed().get(name, name)


def get_backend_class(name: str):
    return load_class(_target(name))


def _refusal(caps, unavailable: Optional[str], cfg: ModelConfig, mode: Optional[ForwardMode], device: str,
             topk: int = 1, layer: Optional[int] = None) -> Optional[str]:
    """The reason that holds on any machine first: the model and request (``caps.refusal``: kind,
    page size, mode, topk, head dim, dtype, then the device kind), then this machine's
    (``unavailable``: a package not installed, no CUDA, the GPU's architecture). Installing a
    package does not make an MLA backend serve a GQA model."""
    if caps is None:                # the class did not load: ``unavailable`` says why
        return unavailable
    why = caps.refusal(cfg, mode, device, None, topk, layer) or unavailable
    if why is None and device == "cuda" and cfg.cache_dtype in FP8_KV:      # this GPU's FP8 floor and ceiling
        why = caps.fp8_gpu_refusal(device_sm())
    return why


def refusal(name: str, model_config: ModelConfig, mode: Optional[ForwardMode] = None,
            device: Optional[str] = None, topk: int = 1, layer: Optional[int] = None) -> Optional[str]:
    """Why backend ``name`` (a registered name or ``module:Class``) cannot serve ``model_config`` in
    ``mode`` (None: any of its modes) on ``device`` here (``layer``: that layer alone, None: every
    layer); None if it can. ValueError if it does not load."""
    cls = get_backend_class(name)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return _refusal(cls.capabilities, unavailable_reason(cls, device), model_config, mode, device, topk, layer)


def get_backend(name: str, config: ModelConfig, memory, device: Optional[str] = None, layers=None):
    """Instantiate backend ``name`` (a registered name or ``module:Class``) for ``config``, to serve
    the layers ``layers`` (None: every layer; its ``forward`` refuses a layer record whose window,
    sinks or cap it does not declare)."""
    cls = get_backend_class(name)
    device = device or memory.device.type
    unavailable = unavailable_reason(cls, device)
    for layer in (None,) if layers is None else layers:
        reason = _refusal(cls.capabilities, unavailable, config, None, device, 1, layer)
        if reason:
            raise ValueError(f"backend {name!r} cannot serve this model on {device}: {reason}")
    return cls(config, memory)


@dataclass(frozen=True)
class Selection:
    name: str
    refused: dict          # every other backend -> the reason it was not chosen
    forced: str = ""       # what forced the choice ("backend='x'", "ATTN_BACKENDS_BACKEND=x"); "": ranked


def parse_override(value: str, how: str) -> dict:
    """``{mode or None: name}`` of an override value: ``"name"`` (every mode: key None) or
    ``"mode=name,..."``; "auto" and empty entries are left out. ValueError for an unknown mode."""
    if "=" not in value:
        return {} if value.strip() in ("", AUTO) else {None: value.strip()}
    out = {}
    for item in value.split(","):
        key, _, name = (x.strip() for x in item.partition("="))
        if key not in _MODES:
            raise ValueError(f"{how}: unknown mode {key!r} (modes: {', '.join(_MODES)})")
        if name not in ("", AUTO):
            out[_MODES[key]] = name
    return out


def _override(backend: Optional[str], mode: ForwardMode) -> tuple:
    """``(name, how)`` forcing select's choice in ``mode``, or ``(None, "")``. The argument, when given,
    wins over the environment variable (the caller's code is nearer than the process's environment);
    "auto" or empty: select's own choice; a mode a per-mode value does not name: likewise."""
    value = backend if backend is not None else os.environ.get(ENV_BACKEND, "")
    how = f"backend={backend!r}" if backend is not None else f"{ENV_BACKEND}={value}"
    names = parse_override(value, how)
    name = names.get(None, names.get(mode))
    return (name, how) if name is not None else (None, "")


def _forced(name: str, how: str, serving: list, refused: dict, model_config: ModelConfig,
            mode: ForwardMode, device: str, topk: int, exclude, what: str, layer: Optional[int]) -> Selection:
    """The Selection of the backend an override names, or ValueError with why it cannot serve
    (never a fallback to another one)."""
    if name in exclude:
        reason = "excluded by the caller"
    elif name in refused:
        reason = refused.pop(name)
    elif any(s[3] == name for s in serving):
        reason = None
    elif ":" not in name:
        raise ValueError(f"unknown backend {name!r} ({how}); known: {', '.join(_entries())}, "
                         "or a 'module:Class' target")
    else:
        try:
            reason = refusal(name, model_config, mode, device, topk, layer)
        except ValueError as e:
            raise ValueError(f"backend {name!r} ({how}) cannot be loaded: {e}") from None
    if reason:
        raise ValueError(f"backend {name!r} ({how}) cannot serve this model in {what} on {device}: {reason}")
    for *_, other in serving:
        if other != name:
            refused[other] = f"serves this too; {name} forced by {how}"
    return Selection(name, refused, how)


def select(model_config: ModelConfig, mode: ForwardMode = ForwardMode.DECODE,
           device: Optional[str] = None, topk: int = 1, exclude=(), backend: Optional[str] = None,
           layer: Optional[int] = None) -> Selection:
    """The best backend for ``model_config`` in ``mode`` on ``device``, and why not each other one.
    ``topk > 1``: tree verify (TARGET_VERIFY) or multi-branch draft decode (DECODE), which
    need a backend with ``topk_gt1``. Backends named in ``exclude`` are not considered.
    ``layer``: the backend of that layer alone (a full layer of a model with sliding ones may take a
    backend without windows); None: one for every layer.

    Ranking: a backend that serves (available here, and its capabilities accept the model,
    mode, page size, device and architecture) beats one that does not. Among those that
    serve: the higher ``Capabilities.preference`` first (built-ins declare 0, a plugin may
    declare more to be chosen first, or less), then registry order (built-ins fastest first,
    then installed plugins by name, then run-time registrations); the reference
    (``torch_native``) comes last whatever it declares.

    Override: ``backend`` (a registered name or ``module:Class``), or when it is None the
    environment variable ``ATTN_BACKENDS_BACKEND``, names the backend to take instead of the
    ranking; the argument wins over the variable, and ``"auto"`` (or an empty variable) leaves
    the choice to the ranking. ``"decode=triton,extend=flashinfer"`` names one per mode (modes:
    extend, decode, target_verify, draft_extend; a mode not named is ranked). A named backend that
    cannot serve the model, mode or device (or is in ``exclude``) raises ValueError with its
    reason, never falls back; an unknown name raises ValueError listing the known ones.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    forced, how = _override(backend, mode)
    serving, refused = [], {}
    for order, info in enumerate(i for i in list_backends(device) if i.name not in exclude):
        reason = _refusal(info.capabilities, info.reason, model_config, mode, device, topk, layer)
        if reason:
            refused[info.name] = reason
        else:
            serving.append((info.name == REFERENCE, -info.capabilities.preference, order, info.name))
    what = (f"{mode.name}" + (f" with topk={topk}" if topk > 1 else "")
            + (f" for layer {layer}" if layer is not None else ""))
    if forced is not None:
        return _forced(forced, how, serving, refused, model_config, mode, device, topk, exclude, what, layer)
    if not serving:
        raise ValueError(f"no backend can serve this model in {what} on {device}: {refused}")
    serving.sort()
    best = serving[0]
    for ref, neg_pref, _, name in serving[1:]:
        if ref:
            why = "the reference, chosen only when no other backend serves"
        elif neg_pref != best[1]:
            why = f"preference {-neg_pref} < {-best[1]}"
        else:
            why = f"same preference {-neg_pref}, later in registry order"
        refused[name] = f"serves this too; ranked below {best[3]} ({why})"
    return Selection(best[3], refused)
