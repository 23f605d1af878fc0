"""The shared core of the paged attention kernels: the split
epilogue, the log-sum-exp merge of split-KV partials, the split workspace and the launcher
checks. ``decode_attention``, ``extend_attention`` and ``mla.attention`` build on it.
"""

import torch
import triton
import triton.language as tl

from .device_facts import capability, cuda_index, max_shared_mem
from .launch_record import cdiv, launch, pow2
from .pdl import split_merge

# exp2 is a single MUFU instruction; scores are scaled by log2(e) once so that every
# softmax exponent is a base-2 one, and partial log-sum-exps are kept in log2 units.
LOG2E = 1.4426950408889634
# merge_splits' grid: about this many programs where rows x heads allow; the output columns of
# 16-bit partials are cut into blocks (of at least MIN_MERGE_DV) where one head a program leaves
# fewer: small batches then spread the merge over more programs (float32 partials of few splits
# lost to it: whole rows there). Figures: bench/RESULTS.md, 'Fused merge'.
MERGE_PROGRAMS = 256
MIN_MERGE_DV = 64
# Float32 partials of at most 128 columns are cut too (to MIN_MERGE_DV_F32) where a head's splits x
# columns reach MERGE_TILE_VALUES: few-program GQA merges of 64-256 splits ran 1.04-1.4x faster; MLA's
# 512-column float32 ones lost to it (None: never; bench/probes/merge_splits.py, RESULTS 'Ragged batches').
MERGE_TILE_VALUES = 8192
MIN_MERGE_DV_F32 = 32


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
def merge_if_last(sem_ptr, part_rows, lse_rows, out_rows, rows_ok, stride_ps, HEAD_DIM_V: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  BLOCK_S: tl.constexpr, CHUNK_DV: tl.constexpr, count, stride_ls):
    """The merge pass fused into the split pass: the split program of a tile that finishes last
    merges the tile's ROWS rows (``part_rows`` / ``lse_rows`` / ``out_rows``: [ROWS] pointers to
    split 0 of each row's partial output and log2-sum-exp, and to its output) as
    ``_merge_splits_kernel`` does, CHUNK_DV output columns at a time (``merge_chunk``: at most 16
    values a thread where 16 columns allow), one [ROWS, CHUNK_DV] partial a step (unrolled: the
    loads are independent; a [ROWS, splits, BLOCK_DV] load took the extend kernel from 103 to 163
    registers on sm_90).
    ``sem_ptr`` is the tile's counter (int32, 0 before the launch): every split program adds 1
    after its partials are stored (release), the one that reads NUM_SPLITS - 1 sees them all
    (acquire) and sets the counter back to 0 for the next launch (graph replays included). ``count``
    (at most NUM_SPLITS; the split passes': NUM_SPLITS) partials are merged, ``stride_ls`` apart in the lse."""
    tl.static_assert(BLOCK_DV % CHUNK_DV == 0)
    tl.debug_barrier()                  # every thread's partial stores precede the release below
    done = tl.atomic_add(sem_ptr, 1, sem="acq_rel", scope="gpu")
    if done == count - 1:
        tl.atomic_xchg(sem_ptr, 0, sem="relaxed", scope="gpu")
        offs_s = tl.arange(0, BLOCK_S)
        lse = tl.load(lse_rows[:, None] + offs_s[None, :] * stride_ls, cache_modifier=".cg",
                      mask=rows_ok[:, None] & (offs_s < count)[None, :], other=float("-inf"))
        m = tl.max(lse, 1)
        m = tl.where(m == float("-inf"), 0.0, m)    # a row no split saw anything of: zeros
        w_sum = tl.sum(tl.exp2(lse - m[:, None]), 1)
        den = tl.where(w_sum > 0, w_sum, 1.0)
        for c in tl.static_range(BLOCK_DV // CHUNK_DV):
            offs_dv = c * CHUNK_DV + tl.arange(0, CHUNK_DV)
            mask = rows_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
            acc = tl.zeros([ROWS, CHUNK_DV], tl.float32)
            for i in tl.static_range(NUM_SPLITS):
                w = tl.exp2(tl.load(lse_rows + i * stride_ls, mask=rows_ok & (i < count), other=float("-inf"),
                                    cache_modifier=".cg") - m)
                part = tl.load(part_rows[:, None] + i * stride_ps + offs_dv[None, :], mask=mask & (i < count),
                               other=0.0, cache_modifier=".cg")
                acc += w[:, None] * part
            tl.store(out_rows[:, None] + offs_dv[None, :], acc / den[:, None], mask=mask)


@triton.jit
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_pt, stride_ph, stride_ps,
    stride_lt, stride_lh,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, BLOCK_HM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, PDL: tl.constexpr = False,
):
    """One row's BLOCK_HM heads, BLOCK_DV output columns of them (the grid's third axis): every
    split of them in one load (a program per (row, head) made many tiny programs where rows x
    heads is large: verify bs 64 launched 16,384). Partials are float32 or 16-bit, summed in
    float32. ``PDL``: a dependent launch (``pdl.py``), every load after ``gdc_wait``."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)   # row offsets in int64: a workspace may pass 2**31 values
    offs_h = tl.program_id(1) * BLOCK_HM + tl.arange(0, BLOCK_HM)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    mask_h = offs_h < NUM_HEADS
    mask_hs = mask_h[:, None] & (offs_s < NUM_SPLITS)[None, :]
    mask_dv = offs_dv < HEAD_DIM_V
    lse = tl.load(lse_ptr + t * stride_lt + offs_h[:, None] * stride_lh + offs_s[None, :], mask=mask_hs,
                  other=float("-inf"))  # [BLOCK_HM, BLOCK_S], log2 units
    m = tl.max(lse, 1)
    # A row that saw no visible key at all (every split empty) is defined as zeros.
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m[:, None])
    # an empty split (lse = -inf) weighs 0: its partial is not read (a short request of many splits)
    live = mask_hs & (lse > float("-inf"))
    part = tl.load(part_ptr + t * stride_pt + offs_h[:, None, None] * stride_ph + offs_s[None, :, None] * stride_ps
                   + offs_dv[None, None, :], mask=live[:, :, None] & mask_dv[None, None, :], other=0.0)
    w_sum = tl.sum(w, 1)
    out = tl.sum(w[:, :, None] * part.to(tl.float32), 1) / tl.where(w_sum > 0, w_sum, 1.0)[:, None]
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_dv[None, :], out,
             mask=mask_h[:, None] & mask_dv[None, :])


def merge_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, block_dv=None) -> torch.Tensor:
    """Merge split-KV partials ``part [T, H, S, Dv]`` (float32 or 16-bit, normalised per split)
    with ``lse [T, H, S]`` (float32, log2 units) into ``out [T, H, Dv]``. A program takes as
    many heads of one row as keep its tile at 8192 partial values and the grid at about 256
    programs or more (at least one head); where one head a program still leaves fewer than
    ``MERGE_PROGRAMS``, 16-bit partials' output columns are cut into blocks of at least
    ``MIN_MERGE_DV``, and float32 ones of many splits (``MERGE_TILE_VALUES``) of ``MIN_MERGE_DV_F32``
    (``block_dv``, a power of two, forces a block width). Empty splits' partials are not read."""
    T, H, S, Dv = part.shape
    if tuple(lse.shape) != (T, H, S) or tuple(out.shape) != (T, H, Dv):
        raise ValueError(f"merge_splits: part {tuple(part.shape)}, lse {tuple(lse.shape)} and "
                         f"out {tuple(out.shape)} disagree")
    if part.stride(-1) != 1 or lse.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("merge_splits: the last dimension of part, lse and out must be contiguous")
    if block_dv is not None and (block_dv < 1 or pow2(block_dv) != block_dv):
        raise ValueError(f"merge_splits: block_dv={block_dv} must be a power of two")
    if T == 0:
        return out
    block_s, full_dv = pow2(S), pow2(Dv)
    # Heads per program: up to 8192 partial values a program, while rows x heads leave about
    # 256 programs: fewer, larger programs where one head a program makes thousands; decode of
    # one row keeps one head a program (figures: bench/RESULTS.md, 'Fused merge').
    cap = max(1, 8192 // (block_s * full_dv))
    block_hm = min(cap, pow2(H), 1 << max(0, (T * H // MERGE_PROGRAMS).bit_length() - 1))
    heads_grid = cdiv(H, block_hm)
    if block_dv is None:   # 16-bit partials of few rows x heads (and float32 ones of many splits): column blocks
        block_dv = full_dv
        wide_f32 = MERGE_TILE_VALUES is not None and full_dv <= 128 and block_s * full_dv >= MERGE_TILE_VALUES
        least = MIN_MERGE_DV if part.element_size() == 2 else MIN_MERGE_DV_F32 if wide_f32 else full_dv
        while block_dv > least and T * heads_grid * (full_dv // block_dv) < MERGE_PROGRAMS:
            block_dv //= 2
    pdl = split_merge(out.device)
    launch(_merge_splits_kernel, (T, heads_grid, cdiv(Dv, block_dv)),
        part, lse, out,
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_HEADS=H, BLOCK_HM=block_hm,
        NUM_SPLITS=S, BLOCK_S=block_s,
        HEAD_DIM_V=Dv, BLOCK_DV=min(block_dv, full_dv), PDL=pdl, launch_pdl=pdl,
    )
    return out


def shared_mem_fits(t: torch.Tensor, nbytes: int) -> bool:
    """Whether ``nbytes`` of shared memory fit one program on ``t``'s device (always on the
    CPU: the interpreter has no such limit)."""
    return not t.is_cuda or nbytes <= max_shared_mem(t.get_device())


# Shared memory a program holds beside its two buffered KV tiles (the query tile, layout scratch):
# above the 16,640 bytes Triton 3.6 gave the float32 64-row MLA tile past its two 64-token tiles.
SMEM_RESERVE = 32 * 1024


def fit_block_n(t: torch.Tensor, block_n: int, token_bytes: int, floor: int = 16) -> int:
    """The largest of ``block_n, block_n / 2, ...`` (not below ``floor``) for which two KV tiles
    of ``token_bytes`` a token fit ``t``'s device beside SMEM_RESERVE, so that every dtype a backend
    serves launches (float32 doubles the bytes of the 16-bit configurations). Two tiles: what
    Triton 3.6 buffered at 2 stages, and more than it took for the 3-stage 16-row MLA decode tile."""
    while block_n > floor and not shared_mem_fits(t, 2 * block_n * token_bytes + SMEM_RESERVE):
        block_n //= 2
    return block_n


# The FP8 KV buffers the GQA kernels read (widened on load, with per-tensor scales).
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_paged_inputs(name, q, kv_buffers, page_table, seq_lens_k, page_size, bs, fp8_ok=False,
                       scales=(1.0, 1.0)):
    """Shared launcher checks: devices, int32 metadata, contiguous head dims, page size; KV
    buffers in q's dtype, or (``fp8_ok``) in one of ``FP8_KV_DTYPES``."""
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
    if scales != (1.0, 1.0) and not all(b.dtype in FP8_KV_DTYPES for b in kv_buffers):
        raise ValueError(f"{name}: k_scale, v_scale = {scales} need FP8 KV buffers, got {kv_buffers[0].dtype}")
    for buf in kv_buffers:
        if buf.dtype != q.dtype and not (fp8_ok and buf.dtype in FP8_KV_DTYPES):
            raise ValueError(f"{name}: KV buffer dtype {buf.dtype} is neither q's {q.dtype}"
                             + (f" nor in {FP8_KV_DTYPES}" if fp8_ok else ""))
        if buf.dim() != 3 or buf.stride(-1) != 1:
            raise ValueError(f"{name}: KV buffer shape {tuple(buf.shape)} must be "
                             f"[num_slots, heads, dim] with a contiguous last dim")
    if q.stride(-1) != 1:
        raise ValueError(f"{name}: q must have a contiguous last dim, stride={q.stride()}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name}: q.dtype={q.dtype} not in (float16, bfloat16, float32)")


def check_fp8_widening(name, q, kv_buffer) -> None:
    """The GQA kernels widen an FP8 cache for a 16-bit query by PTX (``kv_walk.widen_fp8``) that
    sm_89+ has: below, one line here rather than ptxas's error at compile time."""
    if kv_buffer.dtype in FP8_KV_DTYPES and q.device.type == "cuda" and q.dtype != torch.float32:
        major, minor = capability(cuda_index(q.device))
        if (major, minor) < (8, 9):
            raise ValueError(f"{name}: an FP8 KV cache with a {str(q.dtype)[6:]} query needs sm_89+ (its FP8 "
                             f"conversions), this GPU is sm_{major}{minor}")


# Where a tile's split partials are at most this many bytes, the split pass merges them itself
# (``merge_if_last``: one launch instead of two, which saves an eager call's host time); above it
# the separate merge pass, which spreads the reads over many programs where the fused merge has
# the one program that finishes last read them all. The extend kernel's 16-row verify tile lost
# at this bound and tied at a quarter of it, so it fuses up to half of this. Figures:
# bench/RESULTS.md, 'Fused merge'.
FUSED_MERGE_BYTES = 128 << 10

# From this many requests the GQA split passes put a request's KV heads on the fastest grid axis
# (``heads_first``): a token's KV heads are one contiguous run of the paged cache, so the programs
# that read it run side by side: up to 1 % for decode and chain verify at 64-128 requests, 4.7 %
# for trees; below 64 requests within noise either way. Prefill (several query blocks a request)
# was not measured, and keeps the batch-first grid. Figures: bench/RESULTS.md, 'Grid order'.
HEADS_FIRST_BS = 64
MAX_GRID_YZ = 65535     # CUDA's bound on a grid's y and z extents (x: 2**31 - 1)


def heads_first_grid(name: str, heads_first, bs: int, query_blocks: int, heads_grid: tuple,
                     batch_grid: tuple) -> tuple:
    """``(heads_first, grid)``: whether a GQA split pass puts the KV heads on the fastest grid
    axis, and the grid that gives (``heads_grid`` or ``batch_grid``), whose y and z extents CUDA
    bounds at ``MAX_GRID_YZ``. None: heads first from ``HEADS_FIRST_BS`` requests on for launches
    of one query block a request (decode, verify and draft rows: what was measured), where it
    fits. An order asked for, or the only one left, that does not fit is a ValueError."""
    if heads_first is None:
        heads_first = (bs >= HEADS_FIRST_BS and query_blocks == 1
                       and max(heads_grid[1:]) <= MAX_GRID_YZ)
    grid = heads_grid if heads_first else batch_grid
    if max(grid[1:]) > MAX_GRID_YZ:
        raise ValueError(f"{name}: the {'heads' if heads_first else 'batch'}-first grid {grid} "
                         f"has y or z past CUDA's {MAX_GRID_YZ}")
    return bool(heads_first), grid


# Tiles of more than 16 rows merge ``merge_chunk`` columns at a time. Measured were the verify
# and tree tiles of one query block a request: fused, the 32-row tiles were slower or tied at
# every point and chunk (0.0-18.5 %; more instructions in the KV loop: 1047 against 990 for the
# GQA 32/8 tree tile at 64 columns) and keep the separate merge; the 64-row tiles (GQA 64/8
# tree8) were faster where the grid has many programs an SM (15.5 faster; 3.9 and 1.9 slower), up
# to FUSED_MERGE_BYTES of partials a tile. Decode and prefill tiles past the old bound (16 rows at
# Dv 128) were not measured and keep the separate merge. Figures: bench/RESULTS.md, 'Fused merge'.
WIDE_FUSED_ROWS = 64
WIDE_FUSED_PER_SM = 8        # between the 3.9 measured slower and the 15.5 measured faster


def fuse_merge(rows: int, num_kv_splits: int, head_dim_v: int, num_warps: int, workspace=None,
               share: float = 1.0, one_block: bool = False, programs: int = 0, sms=None) -> bool:
    """Whether a split pass whose tiles hold ``rows`` rows merges its own partials: splits, a
    workspace with counters (None: the wrapper allocates one; ``(part, lse)`` alone takes the
    separate merge), and either what fused before the merge summed in chunks (at most ``share``
    x FUSED_MERGE_BYTES of partials a tile and a [rows, Dv] sum of at most 16 values a thread
    on ``num_warps``: tiles of up to 16 rows at Dv 128 on 4 warps), or, for a launch of
    ``one_block`` query block a request (verify and tree), a tile of ``WIDE_FUSED_ROWS`` rows or
    more with at most FUSED_MERGE_BYTES where the launch's ``programs`` (tiles x splits) are at
    least ``WIDE_FUSED_PER_SM`` an SM (``sms``: the device's SMs; None, the interpreter: taken as
    met)."""
    if num_kv_splits <= 1 or (workspace is not None and len(workspace) <= 2):
        return False
    nbytes = rows * num_kv_splits * head_dim_v * 4
    if nbytes <= FUSED_MERGE_BYTES * share and rows * head_dim_v <= merge_values(num_warps):
        return True
    return (one_block and rows >= WIDE_FUSED_ROWS and nbytes <= FUSED_MERGE_BYTES
            and (sms is None or programs >= WIDE_FUSED_PER_SM * sms))


def merge_chunk(rows: int, block_dv: int, num_warps: int) -> int:
    """Output columns the fused merge (``merge_if_last``) sums at a time for a tile of ``rows``
    rows on ``num_warps`` warps (powers of two): a [rows, chunk] float32 sum of at most 16 values
    a thread (sm_90 registers with the merge, whole rows at once: GQA 32/8 verify tile 103 ->
    108-119, decode 64 -> 64-72; a GQA 64/8 verify tile 99 -> 142 on 4 warps, 186 -> 255 on 2),
    and at least 16. The GQA 64/8 tree tile (64 rows, 4 warps) takes 32 columns: 220 registers
    fused, 208 separate (``bench/probes/offline_sm90.py``)."""
    return min(block_dv, max(16, merge_values(num_warps) // rows))


def merge_values(num_warps: int) -> int:
    """The float32 sums a program of ``num_warps`` warps holds in the fused merge: 16 a thread."""
    return 16 * 32 * num_warps


def decode_workspace(num_rows, num_heads, head_dim_v, num_kv_splits, device, num_counters=None,
                     part_dtype=torch.float32):
    """Allocate the split-KV workspace once (e.g. at graph capture) for reuse:
    ``(part [rows, H, S, Dv] part_dtype, lse [rows, H, S] float32, counters [n] int32)``.
    ``part_dtype``: float32, or the output's 16-bit dtype where the wrapper takes that (the MLA
    kernels: ``mla.warpspec.partial_dtype``).
    The counters are the fused merge's tile counters: ``num_counters`` of them, by default as many
    as the tiles of a uniform batch of ``num_rows`` rows can have (rows x H); 0 leaves them out.
    They must be zeros before the first launch (every launch leaves them so; not checked, which
    would cost a host sync). A workspace of ``(part, lse)`` alone runs the separate merge pass."""
    part = torch.empty(num_rows, num_heads, num_kv_splits, head_dim_v, dtype=part_dtype, device=device)
    lse = torch.empty(num_rows, num_heads, num_kv_splits, dtype=torch.float32, device=device)
    n = num_rows * num_heads if num_counters is None else num_counters
    return (part, lse) + ((torch.zeros(n, dtype=torch.int32, device=device),) if n else ())


def split_targets(name, out, workspace, num_kv_splits, tiles=0, part_dtype=torch.float32,
                  out_dtype_partials=False):
    """Where pass 1 writes: straight into ``out [T, H, Dv]`` for one split (no merge
    pass), else into the workspace (allocated here when None, which a graph must avoid, with
    partials of ``part_dtype``). A given workspace's partials must be float32, or also of
    ``out``'s dtype with ``out_dtype_partials`` (kernels whose stores cast to the target).
    ``tiles`` > 0: the split pass merges its own partials, with one counter per tile (the
    workspace's third tensor; the wrapper asks for it only where the workspace has one).
    Returns (o, lse, counters, (stride_t, stride_h, stride_split), (lse stride_t, stride_h));
    counters is ``out`` (never read) without a fused merge."""
    T, H, Dv = out.shape
    if num_kv_splits == 1:
        return out, out, out, (out.stride(0), out.stride(1), 0), (0, 0)
    if workspace is None:                 # counters (a memset) only for a fused merge
        workspace = decode_workspace(T, H, Dv, num_kv_splits, out.device, num_counters=tiles,
                                     part_dtype=part_dtype)
    if len(workspace) not in (2, 3):
        raise ValueError(f"{name}: workspace must be (part, lse[, counters]) as decode_workspace "
                         f"returns, got {len(workspace)} tensors")
    o, lse = workspace[:2]
    kinds = dict.fromkeys((torch.float32, part_dtype) + ((out.dtype,) if out_dtype_partials else ()))
    if (o.shape[0] < T or tuple(o.shape[1:]) != (H, num_kv_splits, Dv)
            or lse.shape[0] < T or tuple(lse.shape[1:]) != (H, num_kv_splits)
            or o.dtype not in kinds or lse.dtype != torch.float32 or o.stride(-1) != 1 or lse.stride(-1) != 1):
        kinds = " or ".join(str(k).replace("torch.", "") for k in kinds)
        raise ValueError(f"{name}: workspace {tuple(o.shape)} {o.dtype} / {tuple(lse.shape)} "
                         f"{lse.dtype} does not fit rows={T}, H={H}, splits={num_kv_splits}, "
                         f"Dv={Dv} (partials {kinds}, lse float32, contiguous last dim)")
    counters = out
    if tiles:
        counters = workspace[2] if len(workspace) == 3 else None
        if (counters is None or counters.dtype != torch.int32 or counters.device != out.device
                or counters.dim() != 1 or counters.stride(0) != 1 or counters.numel() < tiles):
            got = None if counters is None else f"{tuple(counters.shape)} {counters.dtype} on {counters.device}"
            raise ValueError(f"{name}: the fused merge needs the workspace's counters (int32, "
                             f">= {tiles} contiguous on {out.device}, zeros: decode_workspace's "
                             f"third tensor), got {got}")
    o, lse = o[:T], lse[:T]
    return o, lse, counters, (o.stride(0), o.stride(1), o.stride(2)), (lse.stride(0), lse.stride(1))
