"""The KV walk the paged GQA kernels share: a request's tokens ``[start, end)`` in ``BLOCK_N``-token
tiles through its page-table row, each tile one online-softmax step (``paged_tile_update``), with
the extend kernels' masks (``visible_mask``) or none (decode). The split and the chunk passes of
``decode_attention`` and ``extend_attention`` differ only in which range a program walks.
"""
import torch
import triton
import triton.language as tl

MASK_KINDS = {"causal": 0, "tree": 1, "draft": 2}
NO_MASK = tl.constexpr(-1)      # decode: every token of the range is visible
# log2(e) twice: a softcap's tanh by exp2 on scores in log2 units (``_capped`` in the interpreter).
_TWO_LOG2E = tl.constexpr(2.8853900817779268)
# The interpreter runs no inline PTX: it widens FP8 by Triton's cast.
_PTX = tl.constexpr(not triton.knobs.runtime.interpret)


@triton.jit
def _cvt_f16x2(x, CVT: tl.constexpr):
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; " + CVT + " $0, lo; " + CVT + " $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _capped(s, cap):
    """``cap * tanh(s / cap)``: on the GPU by the SFU's tanh (``tanh.approx``, relative error 2^-11, as FlashInfer's
    cap), one SFU op a score where tanh by exp2 and a reciprocal took two (bench/RESULTS.md, 'Windows'); the
    interpreter runs no PTX: tanh by exp2 there, exact at both ends (exp2 of +-inf)."""
    if _PTX:
        r = cap * tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [s * (1.0 / cap)], dtype=tl.float32,
                                            is_pure=True, pack=1)
    else:
        r = cap - 2.0 * cap / (tl.exp2(s * (_TWO_LOG2E / cap)) + 1.0)
    return r


@triton.jit
def widen_fp8(x):
    """An FP8 tile as float16, exactly, converted in registers where it was loaded (``cvt.f16x2``,
    two values an instruction). Triton moves its own cast, and a pure asm, after the shared-memory
    staging, where the MMA's transposed operand gathers FP8 bytes one at a time."""
    if _PTX:
        if x.dtype == tl.float8e4nv:
            w = _cvt_f16x2(x, "cvt.rn.f16x2.e4m3x2")
        else:
            w = _cvt_f16x2(x, "cvt.rn.f16x2.e5m2x2")
    else:
        w = x.to(tl.float16)
    return w


@triton.jit
def paged_tile_update(q, k_ptr, v_ptr, slot, mask_n, vis, kvh, stride_ks, stride_kh, stride_vs,
                      stride_vh, offs_d, mask_d, offs_dv, mask_dv, scale_log2, v_scale, m_i, l_i, acc,
                      softcap_log2, INPUT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """One KV tile of the online softmax, shared by the decode and extend kernels.

    q [M, BLOCK_D]; slot [BLOCK_N] cache slots (int32 or int64: ``slot64``) (mask_n: in range); vis [M, BLOCK_N]
    (or broadcastable): which (row, position) pairs are visible. Returns (m_i, l_i, acc). An FP8
    cache is widened exactly to q's dtype (``fp8_query`` made it float16 for bf16 models; every
    e4m3 and e5m2 value is a float16): K's scale folded into ``scale_log2`` by the caller, V's
    (``v_scale``) on the float32 product P.V; V by ``widen_fp8`` (the ways measured: bench/RESULTS.md,
    'FP8 KV'). Other dtypes: the code as it was. ``SOFTCAP``: the scores (log2 units) capped at
    ``softcap_log2`` (the cap times log2 e) as ``C * tanh(s / C)`` before the mask (``_capped``).
    """
    k = tl.load(k_ptr + slot[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
    if k.dtype.is_fp8():
        k = k.to(q.dtype)
    s = tl.dot(q, k, input_precision=INPUT_PRECISION) * scale_log2
    if SOFTCAP:
        s = _capped(s, softcap_log2)
    s = tl.where(vis, s, float("-inf"))
    # A row may see nothing in this tile (masks); keep its exponents finite.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_dv[None, :],
                mask=mask_n[:, None] & mask_dv[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
    if v.dtype.is_fp8():
        if q.dtype == tl.float16:
            v = widen_fp8(v)
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=INPUT_PRECISION)
        acc = acc * alpha[:, None] + pv * v_scale
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def fp8_query(q, k_ptr, scale_log2):
    """``(q, scale_log2)`` for the tile dots: with an FP8 cache and a bf16 q, each row of q moved by
    a power of two (folded into its ``scale_log2``: [M, 1] then) to a largest magnitude in
    [8192, 16384) and made float16 (exact but for elements below 2**-30 of the row's largest,
    which fall to float16's subnormals), so that the cache widens to float16 in one conversion
    (bfloat16 takes three); per row: a row's result is the same in any batch."""
    if k_ptr.dtype.element_ty.is_fp8():
        if q.dtype == tl.bfloat16:
            qf = q.to(tl.float32)
            qmax = tl.max(tl.abs(qf), 1, keep_dims=True)
            e = tl.floor(tl.log2(16383.0 / tl.maximum(qmax, 1e-30))).to(tl.int32)
            e = tl.where(qmax > 0, tl.minimum(tl.maximum(e, -126), 127), 0)
            shift = ((e + 127) << 23).to(tl.float32, bitcast=True)          # 2 ** e, exactly
            q = (qf * shift).to(tl.float16)
            scale_log2 = scale_log2 / shift
    return q, scale_log2


@triton.jit
def visible_mask(offs_n, j, q_len, seq_len, prefix, draft_prefix, mask_ptr, mask_base,
                 MASK: tl.constexpr):
    """[BLOCK_M, BLOCK_N] visibility of KV positions offs_n for query indices j."""
    vis = (offs_n[None, :] < seq_len) & (j[:, None] < q_len)
    if MASK == 0:
        vis = vis & (offs_n[None, :] <= prefix + j[:, None])
    elif MASK == 1:
        rel = offs_n[None, :] - prefix
        in_tail = vis & (rel >= 0)
        bits = tl.load(mask_ptr + mask_base + j[:, None] * q_len + rel, mask=in_tail, other=0)
        vis = vis & ((rel < 0) | (bits != 0))
    else:
        rel = offs_n[None, :] - draft_prefix
        vis = vis & ((rel < 0) | (rel % q_len == j[:, None]))
    return vis


@triton.jit
def key_positions(offs, prefix, draft_prefix, q_len, mask_ptr, mask_base, MASK: tl.constexpr, BLOCK_W: tl.constexpr):
    """The absolute positions of a request's KV entries ``offs`` (a window's measure): the entry's
    index, but a tree's draft entry ``prefix + r`` sits at ``prefix + depth(r)`` (its row of the W x W
    mask counts its ancestors and itself) and a draft branch's entry at ``draft_prefix + step``."""
    pos = offs
    if MASK == 1:
        rel = offs - prefix
        tail = (rel >= 0) & (rel < q_len)
        w = tl.arange(0, BLOCK_W)
        bits = tl.load(mask_ptr + mask_base + rel[:, None] * q_len + w[None, :],
                       mask=tail[:, None] & (w < q_len)[None, :], other=0)
        pos = tl.where(tail, prefix - 1 + tl.sum((bits != 0).to(tl.int32), 1), offs)
    elif MASK == 2:
        pos = tl.where(offs >= draft_prefix, draft_prefix + (offs - draft_prefix) // tl.maximum(q_len, 1), offs)
    return pos


@triton.jit
def window_lo(seq_len, q_len, draft_prefix, first_row, window, MASK: tl.constexpr):
    """The first KV entry a request's rows from ``first_row`` on can see within ``window``
    positions (elementwise: scalars or one per request): causal rows and decode (``NO_MASK``, one
    row) by index; a tree's rows sit at the prefix or deeper, a draft branch's at its step, and
    entries past the prefix (draft_prefix) are positioned by depth (step), so the bound stops there
    and the per-key window (``walk_paged``) does the rest."""
    prefix = seq_len - q_len
    if MASK == 2:
        lo = tl.minimum(draft_prefix + (prefix - draft_prefix) // tl.maximum(q_len, 1) - window + 1, draft_prefix)
    elif MASK == 1:
        lo = prefix - window + 1
    else:
        lo = prefix + first_row - window + 1
    return tl.maximum(lo, 0)


@triton.jit
def sink_state(sinks_ptr, heads, ok, owner, m_i, l_i, SINKS: tl.constexpr):
    """``(m_i, l_i)`` of a program's online softmax before its KV: where ``SINKS`` and the program
    ``owner`` (exactly one of a request's splits or chunks), each row's head sink logit as a
    column with no value (log2 units); the merges then count it once in the denominator."""
    if SINKS:
        live = ok & owner
        m_i = tl.where(live, tl.load(sinks_ptr + heads, mask=live, other=0.0).to(tl.float32) * 1.4426950408889634,
                       m_i)
        l_i = tl.where(live, 1.0, l_i)
    return m_i, l_i


@triton.jit
def head_and_item(HEADS_FIRST: tl.constexpr):
    """``(KV head, item, KV heads)`` of a program of the grid ``(Hkv, items, ...)`` where
    ``HEADS_FIRST`` (an item's KV heads adjacent: they read the same tokens' rows of the cache),
    else ``(items, Hkv, ...)``; the item is a request or a chunk."""
    kvh = tl.program_id(1)
    item = tl.program_id(0)
    num_kvh = tl.num_programs(1)
    if HEADS_FIRST:
        kvh = tl.program_id(0)
        item = tl.program_id(1)
        num_kvh = tl.num_programs(0)
    return kvh, item, num_kvh


@triton.jit
def walk_paged(q, k_ptr, v_ptr, pt_row, start, end, kvh, stride_ks, stride_kh, stride_vs, stride_vh,
               offs_d, mask_d, offs_dv, mask_dv, scale_log2, v_scale, m_i, l_i, acc,
               j, q_len, seq_len, prefix, draft_prefix, mask_ptr, mask_base, window, softcap_log2,
               PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr,
               WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_W: tl.constexpr, SLOT64: tl.constexpr):
    """Tokens ``[start, end)`` of the request whose page-table row is ``pt_row`` into the running
    ``(m_i, l_i, acc)``; ``MASK``: a ``MASK_KINDS`` value (with the row indices ``j`` and the
    mask's inputs) or ``NO_MASK``. ``WINDOW``: with a mask, row ``j`` sees the keys whose position
    (``key_positions``) is within ``window`` of its own (decode's range starts at its window:
    ``window_lo``); ``BLOCK_W``: a tree's W, to a power of two."""
    q, scale_log2 = fp8_query(q, k_ptr, scale_log2)
    if WINDOW and MASK >= 0:
        q_lo = key_positions(prefix + j, prefix, draft_prefix, q_len, mask_ptr, mask_base, MASK, BLOCK_W) - window
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(pt_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        if SLOT64:      # the cache's element offsets pass 2^31 (``slot64``)
            page = page.to(tl.int64)
        slot = page * PAGE_SIZE + offs_n % PAGE_SIZE
        vis = mask_n[None, :]
        if MASK >= 0:
            vis = vis & visible_mask(offs_n, j, q_len, seq_len, prefix, draft_prefix, mask_ptr, mask_base, MASK)
            if WINDOW:
                k_pos = key_positions(offs_n, prefix, draft_prefix, q_len, mask_ptr, mask_base, MASK, BLOCK_W)
                vis = vis & (k_pos[None, :] > q_lo[:, None])
        m_i, l_i, acc = paged_tile_update(
            q, k_ptr, v_ptr, slot, mask_n, vis, kvh, stride_ks, stride_kh, stride_vs, stride_vh,
            offs_d, mask_d, offs_dv, mask_dv, scale_log2, v_scale, m_i, l_i, acc, softcap_log2, INPUT_PRECISION,
            SOFTCAP)
    return m_i, l_i, acc


def slot64(*buffers: torch.Tensor) -> bool:
    """Whether a KV buffer's largest element offset reaches 2^31: its slot arithmetic then in int64
    (``walk_paged``'s ``SLOT64``), else in int32, a tenth fewer instructions a tile and 7-8 fewer
    registers on sm_90 (``bench/probes/offline_sm90.py``). A contiguous buffer of at most 2^31 elements is read
    from its size alone (an eager decode asks on every call)."""
    return any(not (b.numel() <= 2 ** 31 and b.is_contiguous())
               and sum((n - 1) * s for n, s in zip(b.shape, b.stride())) >= 2 ** 31 for b in buffers)


def feature_args(name: str, q, window, softcap, sinks) -> tuple:
    """A wrapper's window, softcap and sinks checked in one line each and turned into the kernels'
    ``(window, softcap_log2, sinks_ptr, constexprs)`` (None: the feature off, its kernel code
    compiled out; ``sinks``: one logit a query head, on q's device, contiguous); the launch adds ``SLOT64``."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{name}: window={window!r} must be an int >= 1 (None: no window)")
    if softcap is not None and not (isinstance(softcap, (int, float)) and 0 < softcap < float("inf")):
        raise ValueError(f"{name}: softcap={softcap!r} must be a finite float > 0 (None: no cap)")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != q.shape[1] or sinks.device != q.device
                              or not sinks.is_floating_point() or sinks.stride(0) != 1):
        raise ValueError(f"{name}: sinks {tuple(sinks.shape)} {sinks.dtype} on {sinks.device} must be one float "
                         f"logit a query head ({q.shape[1]}), contiguous, on {q.device}")
    consts = dict(WINDOW=window is not None, SOFTCAP=softcap is not None, SINKS=sinks is not None)
    return (window or 0, float(softcap) * 1.4426950408889634 if softcap else 1.0,
            q if sinks is None else sinks, consts)
