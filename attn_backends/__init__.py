"""attn-backends: pluggable attention backends that stay correct under CUDA graphs."""
from .base import AttentionBackend, Capabilities, ForwardMetadata, GraphSupport, LayoutBackend
from .batch import CaptureHiddenMode, ForwardBatch, ForwardMode, GraphInputs, GraphKey, SpecInfo, query_width
from .config import AttentionLayer, ModelConfig
from .kv_cache import KVCacheFullError, KVMemory
from .layout import Layout, LayoutError, build_layout, select_rows
from .registry import get_backend, list_backends, register, select

__all__ = [
    "AttentionBackend", "AttentionLayer", "Capabilities", "CaptureHiddenMode", "ForwardBatch",
    "ForwardMetadata", "ForwardMode", "GraphInputs", "GraphKey", "GraphSupport", "KVCacheFullError",
    "KVMemory", "Layout", "LayoutBackend", "LayoutError", "ModelConfig", "SpecInfo", "build_layout",
    "get_backend", "list_backends", "query_width", "register", "select", "select_rows",
]
__version__ = "0.1.0"
