"""An independent float64 dense attention: K/V gathered through ``req_to_token`` (not the
backend's page table), masks derived from the batch definition (not from the layout)."""
from __future__ import annotations

import torch

from attn_backends import ForwardMode


def _visible(mode, spec, i, prefix, n_new, seq_len):
    """[n_new, seq_len] bool for request i, from first principles."""
    q = torch.arange(n_new)[:, None]
    p = torch.arange(seq_len)[None, :]
    if spec is not None and mode == ForwardMode.DECODE and spec.is_draft_decode:
        topk = spec.topk
        base = seq_len - topk * spec.draft_step          # the prompt prefix
        own = ((p - base) >= 0) & ((p - base) % topk == q)
        return (p < base) | own
    if spec is not None and mode == ForwardMode.TARGET_VERIFY and spec.topk > 1:
        tm = spec.tree_mask[i].cpu()
        vis = (p < prefix).expand(n_new, seq_len).clone()
        vis[:, prefix:] = tm
        return vis
    return p <= prefix + q                              # causal (decode: sees all)


def dense_reference(batch, memory, layer_id, q, scaling, kv_lora_rank=None, k_scale=1.0, v_scale=1.0):
    """``q [T, H, D]`` -> float64 ``[T, H, Dv]`` for the real rows (pad rows left NaN), over the
    cache dequantized (``value * scale``: an FP8 cache's per-tensor scales; MLA: ``k_scale``)."""
    spec, mode = batch.spec_info, batch.forward_mode
    seq = batch.seq_lens_cpu.tolist()
    if mode == ForwardMode.EXTEND:
        new = batch.extend_seq_lens_cpu.tolist()
    else:
        new = [batch.width] * batch.batch_size
    if memory.is_mla:
        kv = memory.pool.kv[layer_id].double().cpu() * k_scale
        kc, vc = kv, kv[..., :kv_lora_rank]
    else:
        kc = memory.pool.k[layer_id].double().cpu() * k_scale
        vc = memory.pool.v[layer_id].double().cpu() * v_scale
    h = q.shape[1]
    out = torch.full((q.shape[0], h, vc.shape[-1]), float("nan"), dtype=torch.float64)
    row0 = 0
    for i in range(batch.batch_size):
        n = new[i]
        if i < batch.raw_bs:
            req = int(batch.req_pool_indices[i])
            slots = memory.req_to_token[req, :seq[i]].long().cpu()
            k, v = kc[slots], vc[slots]                 # [S, Hkv, D]
            rep = h // k.shape[1]
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            qq = q[row0:row0 + n].double().cpu()
            s = torch.einsum("qhd,khd->hqk", qq, k) * scaling
            vis = _visible(mode, spec, i, seq[i] - n, n, seq[i])
            s = s.masked_fill(~vis[None], float("-inf"))
            out[row0:row0 + n] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)
        row0 += n
    return out
