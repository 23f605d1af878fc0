"""What a :class:`sweep_flashinfer.FiCall` asks FlashInfer to compute, in PyTorch.

The CPU check of the arguments the sweep hands FlashInfer (``--smoke``): it reads only the
call (plan and run arguments) and follows FlashInfer's documented semantics: CSR pages
(``kv_indptr``/``kv_indices``, ``kv_len = (pages - 1) * page_size + last_page_len``), NHD
pages ``[pages, page_size, Hkv, D]``, causal masks aligned bottom-right (query ``j`` of
``n`` sees ``p <= kv_len - n + j``), ``custom_mask`` flattened per request over
``[q_len, kv_len]`` (True: visible), an FP8 cache read as value times ``run()``'s
``k_scale`` / ``v_scale``, MLA packed ``[.., 512 + 64]`` with V the first 512.
If this agrees with our backend, the arguments describe the attention we compute.
"""
from __future__ import annotations

import torch


def _attend(q, k, v, visible, scale, cap=0.0):
    """``q [n, H, D]``, ``k [kv, H, D]``, ``v [kv, H, Dv]``, ``visible [n, kv]`` -> ``[n, H, Dv]``;
    ``cap`` > 0: FlashInfer's logits soft cap on the scaled score, ``cap * tanh(s / cap)``."""
    s = torch.einsum("nhd,khd->hnk", q.float(), k.float()) * scale
    if cap > 0:
        s = cap * torch.tanh(s / cap)
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnk,khd->nhd", torch.softmax(s, dim=-1), v.float())


def _visible(n, kv, causal, mask, offset, device):
    if mask is not None:
        return mask[offset:offset + n * kv].view(n, kv).to(torch.bool)
    if causal:
        return torch.arange(kv, device=device)[None, :] <= (kv - n + torch.arange(n, device=device)[:, None])
    return torch.ones(n, kv, dtype=torch.bool, device=device)


def _gqa(call):
    kw = call.plan_kwargs
    q, (kp, vp) = call.run_args
    if call.kind == "decode":
        indptr, indices, last, heads, kv_heads, _, ps = call.plan_args
        width = kw["q_len_per_req"]
        qo = torch.arange(0, (len(last) + 1) * width, width)
        causal, mask = width > 1, None
    else:
        qo, indptr, indices, last, heads, kv_heads, _, ps = call.plan_args
        causal, mask = kw["causal"], kw.get("custom_mask")
    out = torch.empty(q.shape[0], heads, vp.shape[-1], dtype=q.dtype, device=q.device)
    rep, offset = heads // kv_heads, 0
    for i in range(len(last)):
        pages = indices[int(indptr[i]):int(indptr[i + 1])].long()
        kv = (len(pages) - 1) * ps + int(last[i])
        k = kp[pages].reshape(-1, kv_heads, kp.shape[-1])[:kv].repeat_interleave(rep, 1).float()
        v = vp[pages].reshape(-1, kv_heads, vp.shape[-1])[:kv].repeat_interleave(rep, 1).float()
        k, v = k * call.run_kwargs.get("k_scale", 1.0), v * call.run_kwargs.get("v_scale", 1.0)
        lo, hi = int(qo[i]), int(qo[i + 1])
        vis = _visible(hi - lo, kv, causal, mask, offset, q.device)
        if kw.get("window_left", -1) >= 0:          # query j of n at kv - n + j sees window_left back
            rows = kv - (hi - lo) + torch.arange(hi - lo, device=q.device)[:, None]
            vis = vis & (torch.arange(kv, device=q.device)[None, :] >= rows - kw["window_left"])
        out[lo:hi] = _attend(q[lo:hi], k, v, vis, kw["sm_scale"], kw.get("logits_soft_cap", 0.0)).to(q.dtype)
        offset += (hi - lo) * kv
    return out


def _mla(call):
    kw = call.plan_kwargs
    qo, indptr, indices, kv_lens = kw["metadata"]
    q, pages_kv = call.run_kwargs["query"], call.run_kwargs["kv_cache"]
    ckv, ps = kw["head_dim_ckv"], kw["page_size"]
    out = torch.empty(q.shape[0], q.shape[1], ckv, dtype=q.dtype, device=q.device)
    for i in range(len(kv_lens)):
        pages = indices[int(indptr[i]):int(indptr[i + 1])].long()
        kv = int(kv_lens[i])
        if len(pages) != -(-kv // ps):
            raise AssertionError(f"request {i}: {len(pages)} pages for kv_len {kv}")
        k = pages_kv[pages].reshape(-1, pages_kv.shape[-1])[:kv, None, :]     # [kv, 1, 576]
        lo, hi = int(qo[i]), int(qo[i + 1])
        vis = _visible(hi - lo, kv, kw["causal"], None, 0, q.device)
        heads = q.shape[1]
        kk = k.expand(kv, heads, k.shape[-1])
        out[lo:hi] = _attend(q[lo:hi], kk, kk[..., :ckv], vis, kw["sm_scale"]).to(q.dtype)
    return out


def emulate(call) -> torch.Tensor:
    return _mla(call) if call.kind == "mla" else _gqa(call)
