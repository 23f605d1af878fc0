"""A registry of lazy backend factories.

Entries are ``"module:Class"`` strings: importing :mod:`attn_backends` imports no backend
module, no optional dependency, and allocates nothing on a GPU. Third-party backends join
through the ``attn_backends.backends`` entry-point group and are checked by the same suite.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch

from .batch import ForwardMode
from .config import ModelConfig

ENTRY_POINT_GROUP = "attn_backends.backends"

# Preference order for select(): fastest first, the reference last.
_BUILTIN: dict[str, str] = {
    "triton_mla": "attn_backends.backends.triton_mla:TritonMLABackend",
    "triton": "attn_backends.backends.triton_backend:TritonBackend",
    "torch_native": "attn_backends.backends.torch_native:TorchNativeBackend",
}
_extra: dict[str, str] = {}


def register(name: str, target: str) -> None:
    """Register ``"module:Class"`` under ``name`` (lazy: nothing is imported here)."""
    if ":" not in target:
        raise ValueError(f"target {target!r} must look like 'package.module:Class'")
    _extra[name] = target


def _entries() -> dict[str, str]:
    out = dict(_BUILTIN)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        out.setdefault(ep.name, ep.value)
    out.update(_extra)
    return out


def load_class(target: str):
    """Import ``"module:Class"`` and return the class (ValueError with the cause otherwise)."""
    mod, _, cls = target.partition(":")
    if not cls:
        raise ValueError(f"backend {target!r} is neither a registered name nor 'module:Class'")
    try:
        return getattr(importlib.import_module(mod), cls)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load backend class {target!r}: {e}") from e


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


def get_backend_class(name: str):
    entries = _entries()
    return load_class(entries.get(name, name))


def get_backend(name: str, config: ModelConfig, memory, device: Optional[str] = None):
    """Instantiate backend ``name`` (a registered name or ``module:Class``) for ``config``."""
    cls = get_backend_class(name)
    device = device or memory.device.type
    reason = unavailable_reason(cls, device) or cls.capabilities.refusal(config, None, device, device_sm())
    if reason:
        raise ValueError(f"backend {name!r} cannot serve this model on {device}: {reason}")
    return cls(config, memory)


@dataclass(frozen=True)
class Selection:
    name: str
    refused: dict          # every other backend -> the reason it was not chosen


def select(model_config: ModelConfig, mode: ForwardMode = ForwardMode.DECODE,
           device: Optional[str] = None) -> Selection:
    """The first backend (in preference order) that can serve ``model_config`` in ``mode``."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    chosen, refused = None, {}
    for info in list_backends(device):
        reason = info.reason
        if reason is None:
            reason = info.capabilities.refusal(model_config, mode, device, device_sm())
        if reason is None and chosen is None:
            chosen = info.name
        else:
            refused[info.name] = reason or f"lower preference than {chosen}"
    if chosen is None:
        raise ValueError(f"no backend can serve this model in {mode.name} on {device}: {refused}")
    return Selection(chosen, refused)
