"""Float64 PyTorch references and random paged batches for the kernel tests.

The references gather K/V position by position through the page table and apply the
masks exactly as the project contract states them; they share no code with the kernels.
"""

import math

import torch

CAUSAL, TREE, DRAFT = "causal", "tree", "draft"
# Long requests of 4-8k tokens among short ones: at 4 chunks a request the capped fit's last wave of 128 heads'
# programs is nearly empty on 132 SMs, and the MLA chunk plan takes larger chunks (test_chunk_plan.py)
BIMODAL = [481, 289, 6883, 87, 555, 454, 384, 7181, 397, 415, 4166, 561, 5730, 146, 330, 177, 4476, 7753, 475, 379,
           379, 87, 273, 5284]


def make_paged_batch(seq_lens, page_size, pad_rows=0, pad_len=1, spare_pages=3,
                     device="cpu", seed=0):
    """Shuffled page layout for ``seq_lens`` plus ``pad_rows`` padding rows.

    Real requests get pages from a random permutation of 1..num_pages-1 (page 0 is the
    reserved padding page); padding rows point only at page 0 with ``seq_len = pad_len``.
    The page table has spare columns (row stride > any row's page count).
    Returns (page_table [bs, max_pages] int32, seq_lens_k [bs] int32, num_pages).
    """
    g = torch.Generator().manual_seed(seed)
    counts = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = 1 + sum(counts) + spare_pages
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    max_pages = max(counts + [math.ceil(pad_len / page_size)]) + 2
    bs = len(seq_lens) + pad_rows
    page_table = torch.zeros(bs, max_pages, dtype=torch.int32)
    for i, c in enumerate(counts):
        page_table[i, :c] = torch.tensor(perm[:c], dtype=torch.int32)
        perm = perm[c:]
    lens = torch.tensor(list(seq_lens) + [pad_len] * pad_rows, dtype=torch.int32)
    return page_table.to(device), lens.to(device), num_pages


def gather_tokens(buffer, page_row, seq_len, page_size):
    """[seq_len, heads, dim] float64 rows of ``buffer`` for one request (on its device)."""
    pos = torch.arange(seq_len, device=buffer.device)
    slots = page_row.long()[pos // page_size] * page_size + pos % page_size
    return buffer[slots].double()


def ref_paged_attention(q, k_buffer, v_buffer, page_table, seq_lens_k, cu_seqlens_q,
                        page_size, sm_scale, mask=CAUSAL, custom_mask=None,
                        draft_prefix_lens=None, window=None, softcap=None, sinks=None):
    """Float64 attention of q [T, H, D] over the paged cache; returns [T, H, Dv] float64.
    ``window`` (causal rows: by index), ``softcap`` (on the scaled score, before the mask) and
    ``sinks [H]`` (a value-less softmax column) as ``AttentionLayer`` states them."""
    if window is not None and mask != CAUSAL:
        raise ValueError("ref_paged_attention: windows by index hold for causal rows alone")
    dev = q.device
    q = q.double()
    cu = cu_seqlens_q.cpu().tolist()
    lens = seq_lens_k.cpu().tolist()
    T, H, _ = q.shape
    Hkv = k_buffer.shape[1]
    G = H // Hkv
    out = torch.zeros(T, H, v_buffer.shape[2], dtype=torch.float64, device=dev)
    mask_off = 0
    for i in range(len(cu) - 1):
        q_len, L = cu[i + 1] - cu[i], lens[i]
        if q_len == 0:
            continue
        prefix = L - q_len
        k = gather_tokens(k_buffer, page_table[i], L, page_size)  # [L, Hkv, D]
        v = gather_tokens(v_buffer, page_table[i], L, page_size)
        qi = q[cu[i]:cu[i + 1]].view(q_len, Hkv, G, -1)  # GQA: head h uses KV head h // G
        s = torch.einsum("jkgd,pkd->kgjp", qi, k) * sm_scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        j = torch.arange(q_len, device=dev)[:, None]
        p = torch.arange(L, device=dev)[None, :]
        if mask == CAUSAL:
            vis = p <= prefix + j
        elif mask == TREE:
            block = custom_mask.bool()[mask_off:mask_off + q_len * q_len]
            block = block.view(q_len, q_len)
            mask_off += q_len * q_len
            vis = p < prefix
            tail = torch.zeros(q_len, L, dtype=torch.bool, device=dev)
            tail[:, prefix:] = block
            vis = vis | tail
        elif mask == DRAFT:
            dp = int(draft_prefix_lens[i])
            vis = (p < dp) | (((p - dp) % q_len) == j)
        else:
            raise ValueError(mask)
        if window is not None:
            vis = vis & (p > prefix + j - window)
        s = s.masked_fill(~vis, float("-inf"))
        if sinks is not None:           # [Hkv, G, q_len, 1]: head kv * G + g's logit
            col = sinks.double().to(dev).view(Hkv, G, 1, 1).expand(Hkv, G, q_len, 1)
            w = torch.softmax(torch.cat([s, col], -1), dim=-1)[..., :-1]
        else:
            w = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows -> zeros
        o = torch.einsum("kgjp,pkd->jkgd", w, v)
        out[cu[i]:cu[i + 1]] = o.reshape(q_len, H, -1)
    return out


def rel_err(out, ref):
    out = out.double()
    ref = ref.to(out.device).double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out, ref, tol):
    assert not torch.isnan(out).any(), "some output elements were never written (NaN poison)"
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.3e} >= {tol}"
