"""The forward of :class:`vllm_adapter.triton.VLLMTritonBackend`: vLLM's ``TritonAttentionImpl`` (its
``unified_attention`` kernel) on vLLM's metadata, and its KV store (``triton_reshape_and_cache_flash``)
at vLLM's slot mapping.

vLLM's cache is one tensor per layer, logically ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
(K then V in the last dimension); ours is two pools ``[num_slots, Hkv, D]``. The store writes into views
of our pools (``[pages, page_size, Hkv, D]``, the shape vLLM's store takes after its own transpose and
split); the attention reads a packed copy made for the call (two pools cannot be one tensor's views).
"""
from __future__ import annotations

import types

import torch


def _impl(backend, layer):
    """vLLM's impl of one layer: its logit softcap and sink logits (gpt-oss's: each head's softmax
    denominator gains ``exp(sinks[h])``, our ``torch_native``'s semantics) handed over as vLLM's
    ``Attention`` layer hands them."""
    key = (layer.layer_id, layer.softcap, None if layer.sinks is None else layer.sinks.data_ptr())
    impl = backend.impls.get(key)
    if impl is None:
        from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
        impl = backend.impls[key] = TritonAttentionImpl(
            num_heads=layer.num_q_heads, head_size=layer.qk_dim, scale=layer.scaling,
            num_kv_heads=layer.num_kv_heads, alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
            logits_soft_cap=layer.softcap, sinks=layer.sinks)
    return impl


def _vllm_layer(device):
    """The scales vLLM's attention layer carries (``_q_scale`` / ``_k_scale`` / ``_v_scale``), 1.0: our
    suites run the model's dtype here (no FP8 declared)."""
    one = torch.ones((), dtype=torch.float32, device=device)
    return types.SimpleNamespace(_q_scale=one, _k_scale=one, _v_scale=one)


def run(backend, q, k, v, layer, meta, save_kv_cache: bool):
    mem = backend.memory
    pool, ps = mem.pool, mem.page_size
    kc, vc = pool.k[layer.layer_id], pool.v[layer.layer_id]
    pages = kc.shape[0] // ps
    vl = _vllm_layer(q.device)
    vm = meta.vm
    kb, vb = kc.view(pages, ps, *kc.shape[1:]), vc.view(pages, ps, *vc.shape[1:])    # [pages, page, Hkv, D]
    if k is not None and save_kv_cache:
        from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash
        n = vm.slot_mapping.shape[0]
        triton_reshape_and_cache_flash(k[:n], v[:n], kb, vb, vm.slot_mapping, "auto", vl._k_scale, vl._v_scale)
    packed = torch.cat([kb, vb], -1).transpose(1, 2)
    out = torch.zeros(q.shape[0], layer.num_q_heads, layer.v_dim, dtype=q.dtype, device=q.device)
    _impl(backend, layer).forward(vl, q, None, None, packed, vm, out)
    return out
