"""Pack the mask of a uniform batch into FlashInfer's bit layout, in place, on the device.

FlashInfer's prefill kernels read a custom mask as bits: request ``i`` owns a ``[W, kv_i]``
row-major block (``W`` query rows against all ``kv_i`` KV positions), bit ``e`` of it at
``mask[mask_indptr[i] + e // 8] >> (e % 8) & 1`` (little bit order), where ``mask_indptr``
counts *bytes*. FlashInfer 0.7.2's ``plan(packed_custom_mask=...)`` computes ``mask_indptr``
as the element count ``cumsum(W * kv_i)``, so request ``i``'s packed block starts here at byte
``W * sum(kv_r, r < i)``: the blocks sit sparsely in a buffer of ``W * sum(kv)`` bytes
(``ceil(W * kv_i / 8)`` bytes used of each ``W * kv_i``), which is exactly where the kernel
looks. Bits (visible = 1):

* ``tree`` (tree verify): ``p < kv_i - W`` (the prefix), or ``tree[i, j, p - (kv_i - W)]``;
* ``draft`` (draft decode, ``W = topk`` branches): ``p < base_i``, or
  ``(p - base_i) % W == j`` (the row's own branch), ``base_i`` the draft prefix.

Programs ``(i, block)`` each write ``BLOCK`` bytes of request ``i``; a request's offset is the
sum of the earlier rows' ``W * kv`` (recomputed per program from ``seq_lens``): no host value
but ``W`` and the grid bound, no allocation, no host sync.
"""

import torch
import triton
import triton.language as tl

from .launch_record import cdiv, pow2


@triton.jit
def _pack_mask_kernel(
    seq_lens_ptr, tree_ptr, base_ptr, out_ptr, bs, width, capacity,
    TREE: tl.constexpr, BLOCK_BS: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_BS)
    lens = tl.load(seq_lens_ptr + offs_b, mask=offs_b < bs, other=0).to(tl.int64)
    start = width * tl.sum(tl.where(offs_b < i, lens, 0), 0)             # byte offset of request i
    kv = tl.maximum(tl.sum(tl.where(offs_b == i, lens, 0), 0), 1)
    nbits = width * kv
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)                  # [BLOCK] bytes
    bit = tl.arange(0, 8)
    e = j.to(tl.int64)[:, None] * 8 + bit[None, :]                        # [BLOCK, 8] element index
    valid = e < nbits
    row = e // kv
    col = e % kv
    if TREE:
        d = col - (kv - width)
        in_tree = d >= 0
        t = tl.load(tree_ptr + i * width * width + row * width + d, mask=valid & in_tree, other=0)
        on = (d < 0) | (t != 0)
    else:
        base = tl.load(base_ptr + i).to(tl.int64)
        on = (col < base) | ((col - base) % width == row)
    packed = tl.sum(tl.where(valid & on, 1, 0) << bit[None, :], 1)
    dst = start + j
    tl.store(out_ptr + dst, packed.to(tl.uint8), mask=(j < (nbits + 7) // 8) & (dst < capacity))


def packed_mask_bytes(width: int, kv_lens_sum: int) -> int:
    """Bytes the packed blocks of a batch span (the sparse layout above)."""
    return width * kv_lens_sum


def pack_uniform_mask(seq_lens: torch.Tensor, width: int, max_kv: int, out: torch.Tensor,
                      tree_mask: torch.Tensor = None, draft_prefix_lens: torch.Tensor = None) -> torch.Tensor:
    """Write the packed mask of ``bs = len(seq_lens)`` requests of ``width`` rows into ``out``.

    Parameters
    ----------
    seq_lens : ``[bs]`` int32, device: ``kv_i`` (this forward's tokens included).
    width : ``W``, query rows per request.
    max_kv : host bound on ``kv_i`` (the grid covers ``ceil(W * max_kv / 8)`` bytes per request).
    out : ``[capacity]`` uint8: receives the blocks; bytes outside them are left alone.
    tree_mask : ``[bs * W * W]`` bool (tree verify), or
    draft_prefix_lens : ``[bs]`` int32 (draft decode): exactly one of the two.
    """
    if (tree_mask is None) == (draft_prefix_lens is None):
        raise ValueError("pack_uniform_mask needs exactly one of tree_mask (tree verify) and "
                         "draft_prefix_lens (draft decode)")
    if out.dtype != torch.uint8 or out.dim() != 1:
        raise ValueError(f"out must be a 1-D uint8 buffer, got {out.dtype} {tuple(out.shape)}")
    bs = int(seq_lens.shape[0])
    if tree_mask is not None and tree_mask.numel() < bs * width * width:
        raise ValueError(f"tree_mask has {tree_mask.numel()} entries, needs bs*W*W = {bs * width * width}")
    tree = tree_mask.view(torch.uint8) if tree_mask is not None else seq_lens
    base = draft_prefix_lens if draft_prefix_lens is not None else seq_lens
    block = 128
    grid = (bs, max(1, cdiv(cdiv(width * max_kv, 8), block)))
    _pack_mask_kernel[grid](seq_lens, tree, base, out, bs, width, out.numel(),
                            TREE=tree_mask is not None, BLOCK_BS=pow2(bs), BLOCK=block)
    return out
