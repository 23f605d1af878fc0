"""The layout builders: one per mode, the only place stride and extent arithmetic lives.

Eager metadata, graph capture and graph replay all call :func:`build_layout`, through the
step (:mod:`attn_backends.step`), which builds each step's layout once for every layer
and backend. Eager gets fresh tensors sized to the batch; capture and replay pass ``out=``
views of the step's static buffers and the builder writes its result there in place.

Canonical fields (``Layout.as_dict()``), for ``bs`` requests:

===================  ==================  ==============================================
``cu_seqlens_q``     ``[bs+1]`` int32    query rows; ``arange(0, bs*W+1, W)`` in uniform modes
``seq_lens_k``       ``[bs]`` int32      KV tokens incl. this forward's (``prefix + W``)
``prefix_lens``      ``[bs]`` int32      ``seq_lens_k - q_len``
``page_table``       ``[bs, P]`` int32   page ids; 0 (the reserved page) past each row's pages
``kv_indptr``        ``[bs+1]`` int32    cumsum of pages per row (``cdiv(seq_len, page)``)
``kv_indices``       ``[C]`` int32       the pages of all rows back to back, then zeros
``kv_last_page_len`` ``[bs]`` int32      tokens in each row's last page
``custom_mask``      ``[bs*W*W]`` bool   tree verify: draft-block mask, row-major per request
``mask_indptr``      ``[bs+1]`` int32    tree verify: ``arange(0, (bs+1)*W*W, W*W)``
``draft_prefix_lens````[bs]`` int32      draft decode: prompt prefix before the branches
``max_seq_len_q``    host int            ``W`` in uniform modes
``max_seq_len_k``    host int            eager: the batch maximum; graph: the static bound
===================  ==================  ==============================================

Padding (rows ``raw_bs..bs-1``) follows one rule, :func:`canonical_rows` with
:func:`pad_seq_len`, whatever the inputs hold: request row 0, ``seq_len = max(fill, W)``,
causal tree mask, so pad rows are canonical and history-independent. The tree
``custom_mask`` covers only the ``W x W`` draft block; the prefix is always visible, so a
padded request adds a fixed ``W*W`` block, never a length-dependent one.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np
import torch

from .batch import ForwardBatch, ForwardMode, SpecInfo, query_width
from .validation import LayoutError, validate

I32 = torch.int32


class MaskKind(str, enum.Enum):
    CAUSAL = "causal"   # row j of request i sees p <= prefix_i + j (decode: all of seq_len)
    TREE = "tree"       # p < prefix_i, or custom_mask[i, j, p - prefix_i]
    DRAFT = "draft"     # p < draft_prefix_i, or (p - draft_prefix_i) % W == j


@dataclass
class Layout:
    mode: ForwardMode
    bs: int
    width: int                  # W; 0 for ragged EXTEND
    page_size: int
    mask: MaskKind
    cu_seqlens_q: torch.Tensor
    seq_lens_k: torch.Tensor
    prefix_lens: torch.Tensor
    page_table: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    max_seq_len_q: int
    max_seq_len_k: int
    custom_mask: Optional[torch.Tensor] = None
    mask_indptr: Optional[torch.Tensor] = None
    draft_prefix_lens: Optional[torch.Tensor] = None

    def as_dict(self) -> dict:
        skip = {"mode", "bs", "width", "page_size", "mask"}
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in skip and getattr(self, f.name) is not None}


@dataclass(frozen=True)
class LayoutInputs:
    """Everything a builder reads; made from a ForwardBatch or from GraphInputs."""

    mode: ForwardMode
    req_pool_indices: torch.Tensor      # [bs] int32/int64, device
    seq_lens: torch.Tensor              # [bs] int32, device
    seq_lens_cpu: torch.Tensor          # [bs] int32, host
    raw_bs: int
    spec_info: Optional[SpecInfo]
    req_to_token: torch.Tensor          # [rows, max_context_len] int32
    page_size: int
    num_slots: int
    pad_seq_len: int                    # backend fill value, raised to W
    extend_seq_lens: Optional[torch.Tensor] = None
    extend_seq_lens_cpu: Optional[torch.Tensor] = None
    static: bool = False                # graph mode: host scalars from the key alone
    check_device_values: bool = False   # validate device tensors too (syncs; never in replay)
    validated: bool = False             # the caller (the step) has validated it already
    # Graph mode reads raw_bs and draft_step from device scalars ([1] int32), so that the step
    # step's captured builder serves any raw_bs of its key.
    raw_bs_dev: Optional[torch.Tensor] = None
    draft_step_dev: Optional[torch.Tensor] = None

    @property
    def bs(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def max_context_len(self) -> int:
        return int(self.req_to_token.shape[1])


def pad_seq_len(fill: int, width: int) -> int:
    """The seq_len of a padding row: the backend's fill value, raised to the query width W so
    that a pad row's prefix ``seq_len - W`` is never negative (SGLang #31270: a fill of 1 at W = 4 gave
    causal lengths -2..1)."""
    return max(fill, width, 1)


def inputs_from_batch(batch: ForwardBatch, memory, fill: int) -> LayoutInputs:
    """Builder inputs of an eager batch. Device values are validated only where that costs no
    device sync (tensors on the CPU)."""
    w = batch.width if batch.forward_mode.is_uniform() else 1
    return LayoutInputs(batch.forward_mode, batch.req_pool_indices, batch.seq_lens, batch.seq_lens_cpu,
                        batch.raw_bs, batch.spec_info, memory.req_to_token, memory.page_size, memory.num_slots,
                        pad_seq_len(fill, w), batch.extend_seq_lens, batch.extend_seq_lens_cpu,
                        static=False, check_device_values=batch.seq_lens.device.type == "cpu")


def stream_capturing() -> bool:
    """True while a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def mask_kind(mode: ForwardMode, spec: Optional[SpecInfo]) -> MaskKind:
    if spec is not None and mode == ForwardMode.TARGET_VERIFY and spec.topk > 1:
        return MaskKind.TREE
    if spec is not None and mode == ForwardMode.DECODE and spec.is_draft_decode and spec.topk > 1:
        return MaskKind.DRAFT
    return MaskKind.CAUSAL


# --------------------------------------------------------------------------- builders

def _fresh(mode, bs, width, page_size, mask, max_k, n_pages_total, device) -> Layout:
    z = lambda *s, dtype=I32: torch.zeros(*s, dtype=dtype, device=device)  # noqa: E731
    maxp = -(-max_k // page_size)
    tree, draft = mask == MaskKind.TREE, mask == MaskKind.DRAFT
    return Layout(mode, bs, width, page_size, mask, z(bs + 1), z(bs), z(bs), z(bs, maxp), z(bs + 1),
                  z(n_pages_total), z(bs), width, max_k,
                  z(bs * width * width, dtype=torch.bool) if tree else None,
                  z(bs + 1) if tree else None, z(bs) if draft else None)


def canonical_rows(inp: LayoutInputs):
    """(req, seq) with pad rows forced to request row 0 and ``pad_seq_len``: the one pad rule."""
    real = real_rows(inp)
    req = torch.where(real, inp.req_pool_indices.to(torch.int64), 0)
    seq = torch.where(real, inp.seq_lens.to(I32), inp.pad_seq_len)
    return req, seq


def write_canonical_pad(inp: LayoutInputs, w: int, tokens: Optional[torch.Tensor] = None) -> None:
    """Write the pad rule into the pad rows of the inputs, in place (the step's prep): request
    row 0 and ``pad_seq_len``, accept length 1, a causal ``w x w`` tree mask, and for ``tokens``
    (``[3, bs*w]`` input ids, positions, out_cache_loc) id 0, position 0 and the reserved slot 0."""
    real, spec = real_rows(inp), inp.spec_info
    req, seq = canonical_rows(inp)
    inp.req_pool_indices.copy_(req)
    inp.seq_lens.copy_(seq)
    # written in place (no temporary copied back: compute-sanitizer's initcheck flagged those
    # copies inside the prep graph as reads of unwritten memory)
    if spec is not None and spec.accept_lens is not None:
        spec.accept_lens.masked_fill_(real.logical_not(), 1)
    if spec is not None and spec.tree_mask is not None:
        tril = torch.tril(torch.ones(w, w, dtype=torch.bool, device=real.device))
        torch.where(real[:, None, None], spec.tree_mask, tril, out=spec.tree_mask)
    if tokens is not None:
        tokens.mul_(real.repeat_interleave(w, output_size=tokens.shape[1]))


def prep_layout(inp: LayoutInputs, width: int, tokens: Optional[torch.Tensor], out: Layout,
                fused: Optional[bool] = None, max_bs: int = 0, max_width: int = 0) -> None:
    """The step's prep of a captured key: :func:`write_canonical_pad`, then the layout into
    ``out``. A uniform mode without a tree mask does both in one launch (``kernels/layout_prep.py``:
    the same values; a graph replays it once per forward); ``fused`` None: on CUDA. ``max_bs`` /
    ``max_width``: the step's largest key, so that its keys share the kernel's block sizes."""
    spec = inp.spec_info
    draft = out.draft_prefix_lens is not None
    can = (out.mask != MaskKind.TREE and inp.raw_bs_dev is not None and (inp.draft_step_dev is not None or not draft)
           and inp.mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND))
    if fused and not can:
        raise LayoutError(f"no fused prep for {inp.mode.name} with a {out.mask.value} mask")
    if not (can and (inp.seq_lens.is_cuda if fused is None else fused)):
        write_canonical_pad(inp, width, tokens)
        build_layout(inp, out=out)
        return
    if (out.bs, out.width) != (inp.bs, width):
        raise LayoutError(f"buffers bound for (bs={out.bs}, W={out.width}) but the batch is (bs={inp.bs}, W={width})")
    from attn_backends_kernels.layout_prep import uniform_prep
    uniform_prep(inp.req_to_token, inp.page_size, width, inp.pad_seq_len, inp.req_pool_indices, inp.seq_lens,
                 inp.raw_bs_dev, out.cu_seqlens_q, out.prefix_lens, out.seq_lens_k, out.kv_last_page_len,
                 out.page_table, out.kv_indptr, out.kv_indices, tokens=tokens,
                 accept_lens=spec.accept_lens if spec is not None else None,
                 draft_prefix_lens=out.draft_prefix_lens, draft_step=inp.draft_step_dev if draft else None,
                 max_bs=max_bs, max_width=max_width)
    out.max_seq_len_q, out.max_seq_len_k = width, _host_max_k(inp)[0]


def host_seq_lens(seq_lens_cpu: torch.Tensor, raw_bs: int, pad: int) -> np.ndarray:
    """``[bs]`` int64 host copy of the canonical ``seq_lens`` (rows ``raw_bs..`` hold ``pad``):
    what :func:`canonical_rows` writes on the device, derived without reading the device."""
    seq = seq_lens_cpu.numpy().astype(np.int64)
    seq[raw_bs:] = pad
    return seq


def real_rows(inp: LayoutInputs) -> torch.Tensor:
    """``[bs]`` bool: rows below raw_bs (from the device scalar when there is one)."""
    rows = torch.arange(inp.bs, device=inp.seq_lens.device, dtype=I32)
    return rows < (inp.raw_bs_dev if inp.raw_bs_dev is not None else inp.raw_bs)


def _host_max_k(inp: LayoutInputs) -> tuple[int, int]:
    """(max_seq_len_k, total pages) from host values: the static bound in graph mode."""
    ps = inp.page_size
    if inp.static:           # graph mode: nothing from the batch (replay reads no host values here)
        return inp.max_context_len, inp.bs * (inp.max_context_len // ps)
    seq = inp.seq_lens_cpu[:inp.raw_bs].to(torch.int64)
    pad = inp.bs - inp.raw_bs
    max_k = max(int(seq.max()), inp.pad_seq_len if pad else 0)
    pages = int(((seq + ps - 1) // ps).sum()) + pad * (-(-inp.pad_seq_len // ps))
    return max_k, pages


def _write_kv(out: Layout, inp: LayoutInputs, req: torch.Tensor, seq: torch.Tensor) -> None:
    """seq_lens_k, page_table, kv_indptr, kv_indices, kv_last_page_len: no host sync."""
    ps = inp.page_size
    maxp = out.page_table.shape[1]
    npages = (seq + ps - 1) // ps                                       # [bs]
    out.seq_lens_k.copy_(seq)
    out.kv_last_page_len.copy_(seq - (npages - 1) * ps)
    if seq.is_cuda:
        # one kernel for page_table, kv_indptr and kv_indices (same values as below)
        from attn_backends_kernels.index_build import build_page_indices
        build_page_indices(inp.req_to_token, req, seq, ps, out.page_table, out.kv_indptr, out.kv_indices)
        return
    cols = torch.arange(maxp, device=seq.device)
    first_slot = inp.req_to_token[req][:, ::ps][:, :maxp]               # [bs, maxp]
    out.page_table.copy_(torch.where(cols[None, :] < npages[:, None], first_slot // ps, 0))
    flatten_pages(out, npages)


def flatten_pages(out: Layout, npages: torch.Tensor) -> None:
    """``kv_indptr`` (cumsum of ``npages``) and ``kv_indices`` (the first ``npages[i]`` entries of
    each row of ``out.page_table`` back to back, then zeros) of ``out``, in place, no host sync."""
    bs, maxp = out.bs, out.page_table.shape[1]
    out.kv_indptr[:1].zero_()          # not `[0] = 0`: a scalar write is a host-to-device copy
    torch.cumsum(npages, 0, out=out.kv_indptr[1:])
    # kv_indices[j] = page_table[row(j), j - kv_indptr[row(j)]], zeros past the used part.
    j = torch.arange(out.kv_indices.shape[0], device=npages.device, dtype=I32)
    row = torch.searchsorted(out.kv_indptr[1:], j, right=True)          # [C] in 0..bs
    inside = row < bs
    row_c = row.clamp(max=bs - 1)
    col = (j - out.kv_indptr[row_c]).clamp(0, maxp - 1)
    out.kv_indices.copy_(torch.where(inside, out.page_table[row_c, col], 0))


def _uniform(inp: LayoutInputs, width: int, mask: MaskKind, out: Optional[Layout]) -> Layout:
    max_k, n_pages = _host_max_k(inp)
    if out is None:
        out = _fresh(inp.mode, inp.bs, width, inp.page_size, mask, max_k, n_pages, inp.seq_lens.device)
    elif (out.bs, out.width, out.mask) != (inp.bs, width, mask):
        raise LayoutError(f"buffers bound for (bs={out.bs}, W={out.width}, {out.mask.value}) "
                          f"but the batch is (bs={inp.bs}, W={width}, {mask.value})")
    req, seq = canonical_rows(inp)
    out.cu_seqlens_q.copy_(torch.arange(0, (inp.bs + 1) * width, width, dtype=I32, device=seq.device))
    out.prefix_lens.copy_(seq - width)
    _write_kv(out, inp, req, seq)
    out.max_seq_len_q, out.max_seq_len_k = width, max_k
    return out


def build_decode(inp: LayoutInputs, out: Optional[Layout] = None) -> Layout:
    """DECODE: W=1, or draft decode with W=topk branch rows per request."""
    spec = inp.spec_info
    if spec is not None and spec.is_draft_decode:
        return build_draft_decode(inp, out)
    return _uniform(inp, 1, MaskKind.CAUSAL, out)


def build_draft_decode(inp: LayoutInputs, out: Optional[Layout] = None) -> Layout:
    spec = inp.spec_info
    w = spec.topk
    lay = _uniform(inp, w, mask_kind(inp.mode, spec), out)
    if lay.draft_prefix_lens is not None:
        step = inp.draft_step_dev if inp.draft_step_dev is not None else spec.draft_step
        lay.draft_prefix_lens.copy_((lay.seq_lens_k - w * step).clamp(min=0))
    return lay


def build_target_verify(inp: LayoutInputs, out: Optional[Layout] = None) -> Layout:
    spec = inp.spec_info
    w = query_width(inp.mode, spec)
    lay = _uniform(inp, w, mask_kind(inp.mode, spec), out)
    if lay.custom_mask is not None:
        dev = lay.custom_mask.device
        tril = torch.tril(torch.ones(w, w, dtype=torch.bool, device=dev))
        tree = spec.tree_mask.to(device=dev, dtype=torch.bool)
        if tree.shape[0] < inp.bs:   # only the real rows are read; pad to bs rows
            tree = torch.cat([tree, tril.expand(inp.bs - tree.shape[0], w, w)])
        torch.where(real_rows(inp)[:, None, None], tree[:inp.bs], tril,             # pad rows: causal
                    out=lay.custom_mask.view(inp.bs, w, w))
        lay.mask_indptr.copy_(torch.arange(0, (inp.bs + 1) * w * w, w * w, dtype=I32, device=dev))
    return lay


def build_draft_extend(inp: LayoutInputs, out: Optional[Layout] = None) -> Layout:
    """DRAFT_EXTEND: every request owns N rows; accept lengths only select rows afterwards."""
    return _uniform(inp, query_width(inp.mode, inp.spec_info), MaskKind.CAUSAL, out)


def build_extend(inp: LayoutInputs, out: Optional[Layout] = None) -> Layout:
    """EXTEND: ragged query lengths; eager only (never captured as a uniform graph)."""
    if out is not None:
        raise LayoutError("EXTEND is ragged and has no static graph layout")
    max_k, n_pages = _host_max_k(inp)
    ext_cpu = inp.extend_seq_lens_cpu.to(torch.int64).clone()
    ext_cpu[inp.raw_bs:] = 1
    lay = _fresh(inp.mode, inp.bs, 0, inp.page_size, MaskKind.CAUSAL, max_k, n_pages, inp.seq_lens.device)
    req, seq = canonical_rows(inp)
    real = torch.arange(inp.bs, device=seq.device) < inp.raw_bs
    ext = torch.where(real, inp.extend_seq_lens.to(I32), 1)
    lay.cu_seqlens_q[:1].zero_()
    torch.cumsum(ext, 0, out=lay.cu_seqlens_q[1:])
    lay.prefix_lens.copy_(seq - ext)
    _write_kv(lay, inp, req, seq)
    lay.max_seq_len_q, lay.max_seq_len_k = int(ext_cpu.max()), max_k
    return lay


BUILDERS = {
    ForwardMode.EXTEND: build_extend,
    ForwardMode.DECODE: build_decode,
    ForwardMode.TARGET_VERIFY: build_target_verify,
    ForwardMode.DRAFT_EXTEND: build_draft_extend,
}


def build_layout(inp: LayoutInputs, out: Optional[Layout] = None) -> Layout:
    try:
        builder = BUILDERS[inp.mode]
    except KeyError:
        if inp.mode == ForwardMode.IDLE:
            raise LayoutError("IDLE batches carry no tokens and get no attention metadata") from None
        raise LayoutError(f"forward_mode={inp.mode.name} has no attention layout") from None
    if not inp.validated:
        validate(inp)
    return builder(inp, out)


def select_rows(bs: int, width: int, accept_lens: torch.Tensor) -> torch.Tensor:
    """Output rows kept after a uniform forward: ``arange(bs)*N + accept_lens - 1``."""
    return torch.arange(bs, device=accept_lens.device) * width + accept_lens.to(torch.int64) - 1
