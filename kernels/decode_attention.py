"""Paged GQA decode attention: split-KV pass plus a log-sum-exp merge pass.

One query row per request. Pass 1 runs one program per (request, KV head, split):
it loads every KV page of its split once and scores all query heads of the KV head
group against it (GQA), keeping an online softmax in float32. Split boundaries are
computed in the kernel from ``seq_lens_k`` on the device, so the grid depends only on
host ints (``bs``, ``Hkv``, ``num_kv_splits``) and the launch is CUDA-graph safe.
Pass 2 (``merge_splits``, shared with the extend and MLA kernels) merges the per-split
partial outputs with their log-sum-exp.

Layout: ``k_buffer [num_slots, Hkv, D]``, ``v_buffer [num_slots, Hkv, Dv]``; slot of
position t of request i = ``page_table[i, t // page_size] * page_size + t % page_size``.
"""

import torch
import triton
import triton.language as tl

# exp2 is a single MUFU instruction; scores are scaled by log2(e) once so that every
# softmax exponent is a base-2 one, and partial log-sum-exps are kept in log2 units.
LOG2E = 1.4426950408889634


@triton.jit
def paged_tile_update(q, k_ptr, v_ptr, slot, mask_n, vis, kvh, stride_ks, stride_kh, stride_vs,
                      stride_vh, offs_d, mask_d, offs_dv, mask_dv, scale_log2, m_i, l_i, acc,
                      INPUT_PRECISION: tl.constexpr):
    """One KV tile of the online softmax, shared by the decode and extend kernels.

    q [M, BLOCK_D]; slot [BLOCK_N] int64 cache slots (mask_n: in range); vis [M, BLOCK_N]
    (or broadcastable): which (row, position) pairs are visible. Returns (m_i, l_i, acc).
    """
    k = tl.load(k_ptr + slot[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
    s = tl.dot(q, k, input_precision=INPUT_PRECISION) * scale_log2
    s = tl.where(vis, s, float("-inf"))
    # A row may see nothing in this tile (masks); keep its exponents finite.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_dv[None, :],
                mask=mask_n[:, None] & mask_dv[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def store_partial(acc, m_i, l_i, o_ptrs, o_mask, lse_ptrs, lse_mask, NUM_SPLITS: tl.constexpr):
    """Write a (split's) normalised output and, with splits, its log2-sum-exp. An empty split
    writes zeros and lse = -inf so that the merge gives it weight 0 whatever the workspace
    held before (it may be poisoned or stale)."""
    nonempty = l_i > 0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    tl.store(o_ptrs, out, mask=o_mask)
    if NUM_SPLITS > 1:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptrs, lse, mask=lse_mask)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    scale_log2,
    stride_qb, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_pb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    # Splits are rounded up to whole BLOCK_N tiles so that only the last tile of a
    # split needs a bound mask; trailing splits may be empty (they write lse = -inf).
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < HEAD_DIM
    mask_dv = offs_dv < HEAD_DIM_V

    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    pt_row = page_table_ptr + b * stride_pb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(pt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE  # int64: slot*stride can pass 2^31
        m_i, l_i, acc = paged_tile_update(
            q, k_ptr, v_ptr, slot, mask_n, mask_n[None, :], kvh, stride_ks, stride_kh, stride_vs,
            stride_vh, offs_d, mask_d, offs_dv, mask_dv, scale_log2, m_i, l_i, acc, INPUT_PRECISION)

    o_off = b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_dv[None, :]
    store_partial(acc, m_i, l_i, o_ptr + o_off, mask_h[:, None] & mask_dv[None, :],
                  lse_ptr + b * stride_lb + heads * stride_lh + split, mask_h, NUM_SPLITS)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_pt, stride_ph, stride_ps,
    stride_lt, stride_lh,
    stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_s = offs_s < NUM_SPLITS
    mask_dv = offs_dv < HEAD_DIM_V
    lse = tl.load(lse_ptr + t * stride_lt + h * stride_lh + offs_s, mask=mask_s,
                  other=float("-inf"))  # [BLOCK_S], log2 units
    m = tl.max(lse, 0)
    # A row that saw no visible key at all (every split empty) is defined as zeros.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    part = tl.load(part_ptr + t * stride_pt + h * stride_ph + offs_s[:, None] * stride_ps
                   + offs_dv[None, :], mask=mask_s[:, None] & mask_dv[None, :], other=0.0)
    w_sum = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(w_sum > 0, w_sum, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_dv, out, mask=mask_dv)


def merge_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Merge split-KV partials ``part [T, H, S, Dv]`` (float32, normalised per split)
    with ``lse [T, H, S]`` (float32, log2 units) into ``out [T, H, Dv]``."""
    T, H, S, Dv = part.shape
    if tuple(lse.shape) != (T, H, S) or tuple(out.shape) != (T, H, Dv):
        raise ValueError(f"merge_splits: part {tuple(part.shape)}, lse {tuple(lse.shape)} and "
                         f"out {tuple(out.shape)} disagree")
    if part.stride(-1) != 1 or lse.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("merge_splits: the last dimension of part, lse and out must be contiguous")
    if T == 0:
        return out
    _merge_splits_kernel[(T, H)](
        part, lse, out,
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=S, BLOCK_S=triton.next_power_of_2(S),
        HEAD_DIM_V=Dv, BLOCK_DV=triton.next_power_of_2(Dv),
    )
    return out


def check_paged_inputs(name, q, kv_buffers, page_table, seq_lens_k, page_size, bs):
    """Shared launcher checks: devices, int32 metadata, contiguous head dims, page size."""
    for t_name, t in [("page_table", page_table), ("seq_lens_k", seq_lens_k)]:
        if t.dtype != torch.int32:
            raise ValueError(f"{name}: {t_name}.dtype={t.dtype}, expected torch.int32")
    for t_name, t in [("k/v buffers", kv_buffers[0]), ("page_table", page_table),
                      ("seq_lens_k", seq_lens_k)]:
        if t.device != q.device:
            raise ValueError(f"{name}: {t_name} is on {t.device}, q is on {q.device}")
    if page_table.dim() != 2 or page_table.shape[0] < bs or page_table.stride(1) != 1:
        raise ValueError(f"{name}: page_table shape {tuple(page_table.shape)} / stride "
                         f"{page_table.stride()} needs >= {bs} rows and contiguous columns")
    if seq_lens_k.shape[0] < bs:
        raise ValueError(f"{name}: seq_lens_k has {seq_lens_k.shape[0]} rows, expected >= {bs}")
    if page_size < 1:
        raise ValueError(f"{name}: page_size={page_size} must be >= 1")
    for buf in kv_buffers:
        if buf.dtype != q.dtype:
            raise ValueError(f"{name}: KV buffer dtype {buf.dtype} != q dtype {q.dtype}")
        if buf.dim() != 3 or buf.stride(-1) != 1:
            raise ValueError(f"{name}: KV buffer shape {tuple(buf.shape)} must be "
                             f"[num_slots, heads, dim] with a contiguous last dim")
    if q.stride(-1) != 1:
        raise ValueError(f"{name}: q must have a contiguous last dim, stride={q.stride()}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name}: q.dtype={q.dtype} not in (float16, bfloat16, float32)")


def decode_workspace(num_rows, num_heads, head_dim_v, num_kv_splits, device):
    """Allocate the split-KV workspace once (e.g. at graph capture) for reuse:
    ``(part [rows, H, S, Dv] float32, lse [rows, H, S] float32)``."""
    part = torch.empty(num_rows, num_heads, num_kv_splits, head_dim_v, dtype=torch.float32,
                       device=device)
    lse = torch.empty(num_rows, num_heads, num_kv_splits, dtype=torch.float32, device=device)
    return part, lse


def split_targets(name, out, workspace, num_kv_splits):
    """Where pass 1 writes: straight into ``out [T, H, Dv]`` for one split (no merge
    pass), else into the workspace (allocated here when None, which a graph must avoid).
    Returns (o, lse, (stride_t, stride_h, stride_split), (lse stride_t, stride_h))."""
    T, H, Dv = out.shape
    if num_kv_splits == 1:
        return out, out, (out.stride(0), out.stride(1), 0), (0, 0)
    if workspace is None:
        workspace = decode_workspace(T, H, Dv, num_kv_splits, out.device)
    o, lse = workspace
    if (o.shape[0] < T or tuple(o.shape[1:]) != (H, num_kv_splits, Dv)
            or lse.shape[0] < T or tuple(lse.shape[1:]) != (H, num_kv_splits)
            or o.dtype != torch.float32 or lse.dtype != torch.float32
            or o.stride(-1) != 1 or lse.stride(-1) != 1):
        raise ValueError(f"{name}: workspace {tuple(o.shape)} {o.dtype} / {tuple(lse.shape)} "
                         f"{lse.dtype} does not fit rows={T}, H={H}, splits={num_kv_splits}, "
                         f"Dv={Dv} (float32, contiguous last dim)")
    o, lse = o[:T], lse[:T]
    return o, lse, (o.stride(0), o.stride(1), o.stride(2)), (lse.stride(0), lse.stride(1))


def decode_attention_fwd(q, k_buffer, v_buffer, page_table, seq_lens_k, page_size, sm_scale,
                         num_kv_splits, out, workspace=None, block_n=32, num_warps=4,
                         num_stages=2):
    """Paged GQA decode attention, written into ``out``.

    Parameters
    ----------
    q : [bs, H, D] float16/bfloat16/float32
    k_buffer, v_buffer : [num_slots, Hkv, D] / [num_slots, Hkv, Dv], same dtype as q
    page_table : [>=bs, max_pages] int32; seq_lens_k : [>=bs] int32 (>= 1 each)
    page_size, num_kv_splits : host ints (fixed per captured graph)
    out : [bs, H, Dv], dtype of q
    workspace : optional ``(part [bs, H, S, Dv] f32, lse [bs, H, S] f32)`` from
        ``decode_workspace``; allocated here when None (not inside a graph then).
    """
    bs, H, D = q.shape
    Hkv, Dv = k_buffer.shape[1], v_buffer.shape[2]
    check_paged_inputs("decode_attention_fwd", q, (k_buffer, v_buffer), page_table,
                       seq_lens_k, page_size, bs)
    if H % Hkv != 0 or k_buffer.shape[2] != D or v_buffer.shape[1] != Hkv:
        raise ValueError(f"decode_attention_fwd: q heads {H} x dim {D} incompatible with "
                         f"k_buffer {tuple(k_buffer.shape)} / v_buffer {tuple(v_buffer.shape)}")
    if tuple(out.shape) != (bs, H, Dv) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"decode_attention_fwd: out {tuple(out.shape)} {out.dtype}, "
                         f"expected ({bs}, {H}, {Dv}) {q.dtype} with contiguous last dim")
    if num_kv_splits < 1:
        raise ValueError(f"decode_attention_fwd: num_kv_splits={num_kv_splits} must be >= 1")
    if bs == 0:
        return out
    group = H // Hkv
    # tl.dot needs M >= 16; spare head rows are masked out.
    block_h = max(16, triton.next_power_of_2(group))
    o, lse, o_strides, lse_strides = split_targets("decode_attention_fwd", out, workspace,
                                                   num_kv_splits)
    _decode_split_kernel[(bs, Hkv, num_kv_splits)](
        q, k_buffer, v_buffer, page_table, seq_lens_k, o, lse,
        sm_scale * LOG2E,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        page_table.stride(0),
        *o_strides, *lse_strides,
        GROUP=group, BLOCK_H=block_h,
        HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
        HEAD_DIM_V=Dv, BLOCK_DV=triton.next_power_of_2(Dv),
        PAGE_SIZE=page_size, BLOCK_N=block_n, NUM_SPLITS=num_kv_splits,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_kv_splits > 1:
        merge_splits(o, lse, out)
    return out
