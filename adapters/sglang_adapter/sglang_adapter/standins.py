"""Stand-ins for the modules SGLang imports that cannot exist on a CPU-only machine.

Each is installed into ``sys.modules`` by :func:`install` before SGLang is imported, and only
when the real module cannot be imported. Nothing here computes attention metadata: SGLang's
own ``TritonAttnBackend`` methods and its Triton index kernels do that.

- ``sgl_kernel``: SGLang's CUDA-only binary extension (compiled CUDA ops). The attention-backend
  modules import a few names from it at module level (``concat_mla_absorb_q`` in
  ``layers/attention/utils.py``, ``fast_topk`` in ``speculative/spec_utils.py``) but the Triton
  backend's metadata and forward paths never call them. The stand-in module hands out, for any
  attribute, a function that raises ``NotImplementedError`` naming the op, so a call that does
  reach it fails loudly instead of computing something.
- ``torchvision``: imported by SGLang's multimodal utilities on the import path of
  ``model_executor`` (image processing); it is a large CUDA-pinned wheel that would change
  torch. The stand-in is an empty package whose attributes raise like the one above;
  ``__version__`` is set so version checks parse.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

STANDINS = {
    "sgl_kernel": "SGLang's CUDA-only binary extension: no CPU build exists",
    "torchvision": "a CUDA-pinned wheel that would replace the project's torch; only multimodal code uses it",
}


class _Missing:
    """A name from a stand-in module: attribute access gives further names (module-level tables
    such as ``scalar_types.uint4b8`` are built at import), a call raises."""

    def __init__(self, full: str, why: str) -> None:
        self._full, self._why = full, why

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._full}.{attr}", self._why)

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._full} is a stand-in ({self._why}); the adapter's path must not call it")

    def __repr__(self) -> str:
        return f"<stand-in {self._full}>"


class _StandIn(types.ModuleType):
    """A stand-in package: every missing attribute is a :class:`_Missing` that raises when called."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(name)
        self.__dict__["_why"] = why
        self.__dict__["__version__"] = "0.0.0+standin"
        self.__dict__["__path__"] = []          # a package: submodules resolve through the finder

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}", self._why)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        root = name.split(".")[0]
        if root in STANDINS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandIn(spec.name, STANDINS[spec.name.split(".")[0]])

    def exec_module(self, module) -> None:
        return None


_FINDER = _Finder()


def install() -> list:
    """Install the stand-ins whose real module is missing; returns the names stood in."""
    used = []
    for name in STANDINS:
        if name in sys.modules:
            if isinstance(sys.modules[name], _StandIn):
                used.append(name)
            continue
        if importlib.util.find_spec(name) is None:
            used.append(name)
    if used and _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)       # last: a real module anywhere on the path wins
    return used
