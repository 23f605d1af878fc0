"""Absorbed MLA under the chunk schedule (``kernels/schedule.py``): the batch's KV cut into about
``bs x num_kv_splits`` equal chunks on the device, a long request into many, short ones whole, on
a grid fixed by host ints (any lengths its workspace holds replay in one graph).

Program (row block x head block, chunk) runs the plain-Triton MLA tile (``walk``) over its chunk's
KV: a request of one chunk writes its output, the chunks of a longer one write partials (the
workspace's dtype: float32, or 16-bit where ``warpspec.partial_dtype`` says so for the default tile)
and log2-sum-exps that the separate merge (``ChunkLaunch.merge_pass``) combines in chunk order.
Uniform rows only (decode, verify chain and tree, draft extend and draft decode masks); ragged
prefill keeps the split pass (``attention.mla_attention_fwd``). On sm_90 the Gluon kernels take the
"chunks" schedule where they serve the launch's tile (``wgmma._program`` with ``CHUNK_BS``), every
chunk then writing a partial; the Triton tile runs elsewhere and for the invariant schedule.
"""

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..attention_core import LOG2E, MAX_GRID_YZ, fit_block_n
from ..chunk_kernels import chunk_of
from ..device_facts import device_sms
from ..extend_attention import MASK_KINDS
from ..launch_record import cdiv, launch
from ..schedule import ChunkLaunch, check_schedule, chunk_launch, chunk_slots, slots_per_request
from .attention import GLUON_LAUNCH, _check_inputs, _pick_kernel, _tile_config, tile_shape
from .chunk_map import PLANNED
from .chunk_plan import plan_chunks
from .walk import _mla_rows, _mla_store, _mla_walk
from .warpspec import partial_dtype


@triton.jit
def _mla_chunk_kernel(
    q_ptr, kv_ptr, page_table_ptr, seq_lens_ptr, mask_ptr, draft_prefix_ptr, out_ptr, part_ptr, lse_ptr,
    scale_log2, stride_qt, stride_qh, stride_kvs, stride_pb, stride_ot, stride_oh, stride_pt, stride_ph,
    stride_lt, stride_lh, W, bs, num_chunks,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, LATENT: tl.constexpr,
    ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, MIN_TILES: tl.constexpr, FIXED_TILES: tl.constexpr, BLOCK_BS: tl.constexpr,
    v_scale=1.0,
):
    NUM_HB: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    pid = tl.program_id(0)
    hb = pid % NUM_HB  # head blocks of one row block adjacent: the fastest axis
    wb = pid // NUM_HB
    c = tl.program_id(1)
    b, first, count, start, end, total = chunk_of(seq_lens_ptr, c, bs, num_chunks, 0, W, draft_prefix_ptr, BLOCK_N,
                                                  MIN_TILES, FIXED_TILES, BLOCK_BS, MASK, False)
    if c >= total:
        return  # a slot past the batch's last chunk
    seq_len = tl.load(seq_lens_ptr + b)
    row0, q_len, j, heads, row_ok, q_a, q_b, q_pe = _mla_rows(
        q_ptr, q_ptr, b, wb, hb, stride_qt, stride_qh, W, NUM_HEADS, BLOCK_H, BLOCK_W, LATENT, ROPE, False)
    prefix = seq_len - q_len
    draft_prefix = 0
    if MASK == 2:
        draft_prefix = tl.load(draft_prefix_ptr + b)
    if MASK == 0:  # causal: nothing past the block's last row is visible
        end = tl.minimum(end, prefix + wb * BLOCK_W + BLOCK_W)
    m_i, l_i, acc_a, acc_b = _mla_walk(
        q_a, q_b, q_pe, kv_ptr, page_table_ptr + b.to(tl.int64) * stride_pb, start, end, j, q_len, seq_len, prefix,
        draft_prefix, mask_ptr, b.to(tl.int64) * W * W, scale_log2, stride_kvs, BLOCK_W * BLOCK_H, LATENT, ROPE,
        PAGE_SIZE, BLOCK_N, MASK, INPUT_PRECISION)
    if count == 1:
        rows = row0 + j
        _mla_store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh, lse_ptr, m_i, l_i, acc_a,
                   acc_b, row_ok, v_scale, LATENT, False)
    else:  # chunk c's partial rows: c * W + j (the merge pass reads them so)
        rows = c.to(tl.int64) * W + j
        _mla_store(part_ptr + rows[:, None] * stride_pt + heads[:, None] * stride_ph,
                   lse_ptr + rows * stride_lt + heads * stride_lh, m_i, l_i, acc_a, acc_b, row_ok, v_scale, LATENT,
                   True)


def mla_chunk_fwd(q, kv_buffer, page_table, seq_lens_k, page_size, sm_scale, num_kv_splits, out, q_per_req=1,
                  mask="causal", custom_mask=None, workspace=None, draft_prefix_lens=None, schedule="chunks",
                  merge="pass", block_h=None, block_w=None, block_n=None, num_warps=None, num_stages=None,
                  kv_scale=1.0, kernel=None, fit=False, many_waves=False, planned=False):
    """``mla_attention_fwd``'s uniform modes under the chunk schedule ``schedule`` ("chunks" or
    "invariant"): the same arguments but ragged EXTEND and the kernel choice; ``merge``: "pass" only. ``workspace``: a
    ``schedule.chunk_workspace(bs, slots_per_request(schedule, num_kv_splits, page_table.shape[1] *
    page_size), W, H, 1, 512, device, part_dtype)`` with float32 partials or ``warpspec.partial_dtype``'s for
    the default tile (allocated here when None, with the latter, which a graph must avoid). ``kernel``:
    None: a Gluon kernel where one serves the "chunks" schedule's tile (``mla_attention_fwd``'s rule, knobs
    None), else the Triton tile; "triton": the Triton tile. ``fit``: the wave fit (``chunk_kernels._balanced_per``:
    chunks past the budget would run as a second wave). ``many_waves``: the count is ``schedule.many_waves``' budget
    of several waves (under the fit), whose Gluon chunk pass cuts no request into more than MANY_WAVES_CAP chunks
    (``chunk_map.gluon_chunk_of``: the size it publishes; the Triton tile runs the budget as it is), at the size a
    launch before it plans where PLAN_WAVES (``chunk_plan``). ``planned``: that size was planned into ``workspace``
    by ``mla_chunk_plan`` with these arguments (once a step for every layer): read there, not planned or searched
    again; a launch without a planned size (``mla_chunk_plan`` False: the Triton tile) reads none."""
    name = "mla_chunk_fwd"
    if planned and (workspace is None or not many_waves):
        raise ValueError(f"{name}: planned=True reads a budget of several waves' size from a given workspace "
                         f"(workspace {'None' if workspace is None else 'given'}, many_waves={many_waves})")
    s = _setup(name, q, kv_buffer, page_table, seq_lens_k, page_size, num_kv_splits, out, q_per_req, mask,
               custom_mask, workspace, draft_prefix_lens, schedule, merge, kv_scale, kernel, fit, many_waves,
               (block_w, block_h, block_n, num_warps, num_stages))
    if s is None:
        return out
    cl, cap, H, D, Dv, W = s.cl, s.cap, q.shape[1], q.shape[2], out.shape[-1], s.W
    if s.gluon is not None:
        if cap and (PLAN_WAVES or planned):     # the size planned where the merge reads it (the chunk pass then too)
            if not planned:
                _plan(s, seq_lens_k, out.device)
            cap += PLANNED.value
        _launch_gluon(s.gluon, s.grid, cl, q, kv_buffer, page_table, seq_lens_k, s.mask_arg, s.draft_arg,
                      sm_scale * LOG2E * kv_scale, W, H, Dv, D - Dv, page_size, s.block_w, s.block_h, MASK_KINDS[mask],
                      cap)
        cl.merge_pass(seq_lens_k, None, out, single=True)
        return out
    launch(_mla_chunk_kernel, s.grid, q, kv_buffer, page_table, seq_lens_k, s.mask_arg, s.draft_arg, out, cl.part,
           cl.lse, sm_scale * LOG2E * kv_scale, q.stride(0), q.stride(1), kv_buffer.stride(0), page_table.stride(0),
           out.stride(0), out.stride(1), cl.part.stride(0), cl.part.stride(1), cl.lse.stride(0), cl.lse.stride(1), W,
           s.bs, cl.budget, NUM_HEADS=H, BLOCK_H=s.block_h, BLOCK_W=s.block_w, LATENT=Dv, ROPE=D - Dv,
           PAGE_SIZE=page_size, BLOCK_N=s.block_n, MASK=MASK_KINDS[mask],
           INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", MIN_TILES=cl.consts["MIN_TILES"],
           FIXED_TILES=cl.consts["FIXED_TILES"], BLOCK_BS=cl.consts["BLOCK_BS"], num_warps=s.num_warps,
           num_stages=s.num_stages, v_scale=kv_scale)
    cl.merge_pass(seq_lens_k, None, out)
    return out


def mla_chunk_plan(q, kv_buffer, page_table, seq_lens_k, page_size, num_kv_splits, out, workspace, q_per_req=1,
                   mask="causal", custom_mask=None, draft_prefix_lens=None, kv_scale=1.0, fit=False,
                   many_waves=False) -> bool:
    """Plan the chunk size that ``mla_chunk_fwd`` with these arguments and ``planned=True`` reads, into
    ``workspace`` (``chunk_plan``: one program, from the device's ``seq_lens_k``): True where the launch has one (the
    Gluon chunk pass runs a budget of several waves), else False with nothing launched. ``q`` and ``out`` are read
    for their facts alone (shape, dtype, strides, alignment and device decide the kernel), so views of one row expanded
    to the batch's serve; their data is never read. Such a view's facts are the most permissive (stride 0, an aligned
    base): a call whose q the Gluon kernels refuse then runs the Triton tile, which neither reads nor writes the
    planned size, so a True for it costs a launch and changes nothing; a False is never followed by a Gluon call."""
    if workspace is None:
        raise ValueError("mla_chunk_plan: the plan is written into a given workspace (None)")
    s = _setup("mla_chunk_plan", q, kv_buffer, page_table, seq_lens_k, page_size, num_kv_splits, out, q_per_req, mask,
               custom_mask, workspace, draft_prefix_lens, "chunks", "pass", kv_scale, None, fit, many_waves,
               (None,) * 5)
    if s is None or s.gluon is None or not s.cap:
        return False
    _plan(s, seq_lens_k, out.device)
    return True


class _Setup(NamedTuple):
    """What a chunk launch's checked arguments decide (``_setup``)."""
    W: int
    bs: int
    mask_arg: torch.Tensor
    draft_arg: torch.Tensor
    gluon: Optional[str]
    block_w: int
    block_h: int
    block_n: int
    num_warps: Optional[int]
    num_stages: Optional[int]
    cl: ChunkLaunch
    cap: int
    grid: tuple


def _setup(name, q, kv_buffer, page_table, seq_lens_k, page_size, num_kv_splits, out, q_per_req, mask, custom_mask,
           workspace, draft_prefix_lens, schedule, merge, kv_scale, kernel, fit, many_waves, knobs):
    """The checks and the launch's facts, shared by the chunk pass and its plan (None for an empty batch)."""
    if schedule == "split":
        raise ValueError(f"{name}: schedule='split' is mla_attention_fwd's")
    if merge != "pass":
        raise ValueError(f"{name}: merge={merge!r}: the MLA chunk pass merges by a second launch ('pass') only")
    check_schedule(name, schedule, merge)
    if many_waves and not fit:
        raise ValueError(f"{name}: many_waves=True is a budget of the wave fit (fit=False)")
    W, bs, mask_arg, draft_arg = _check_inputs(name, q, kv_buffer, page_table, seq_lens_k, page_size,
                                               num_kv_splits, out, q_per_req, mask, custom_mask, None, None,
                                               draft_prefix_lens, kv_scale)
    T, H, D = q.shape
    Dv = out.shape[-1]
    if kernel not in (None, "triton"):
        raise ValueError(f"{name}: kernel={kernel!r} not in (None, 'triton')")
    gluon, tile = _gluon_kernel(q, kv_buffer, W, H, Dv, page_size, mask, schedule, kernel, knobs)
    if gluon is not None:
        (block_w, block_h), block_n, num_warps, num_stages = tile, GLUON_TOKENS[gluon], None, None
    else:
        block_w, block_h, block_n, num_warps, num_stages = _tile_config(q, W, H, D, *chunk_tile(q, W, H, D, *knobs))
    if bs == 0:
        return None
    rows = tile_shape(W, H)         # the default tile's: the backend sizes its graph workspace alike
    cl = chunk_launch(name, out, workspace, bs, num_kv_splits, W, 1, page_table, page_size, schedule, block_n,
                      heads_first=False, part_dtype=partial_dtype(kv_buffer.dtype, out.device, page_size,
                                                                  rows[0] * rows[1], Dv, D - Dv), fit=fit,
                      published=fit and gluon is not None and PUBLISH_FIT)   # the Gluon pass writes it
    cap = MANY_WAVES_CAP if many_waves and cl.published else 0     # the merge reads the capped size published
    if not 0 <= cap < PLANNED.value:        # CHUNK_CAP's values from PLANNED on say "planned"
        raise ValueError(f"{name}: MANY_WAVES_CAP {cap} not in [0, {PLANNED.value})")
    slots = chunk_slots(bs, slots_per_request(schedule, num_kv_splits, page_table.shape[1] * page_size))
    if slots > MAX_GRID_YZ:       # the tiles of one chunk stay adjacent on x (their KV reads hit L2)
        raise ValueError(f"{name}: {slots} chunk slots (bs={bs}, schedule={schedule!r}) past CUDA's grid y "
                         f"bound {MAX_GRID_YZ}")
    grid = (cdiv(W, block_w) * cdiv(H, block_h), slots)
    return _Setup(W, bs, mask_arg, draft_arg, gluon, block_w, block_h, block_n, num_warps, num_stages, cl, cap, grid)


def _plan(s: _Setup, seq_lens_k, device) -> None:
    """The plan's launch (``chunk_plan.plan_chunks``) into the log-sum-exp row the chunk pass publishes at."""
    cl = s.cl
    plan_chunks(seq_lens_k, cl.lse[s.grid[1] * s.W], s.bs, cl.budget, s.grid[0], device_sms(device), s.block_n, s.cap,
                cl.consts["MIN_TILES"], max(32, cl.consts["BLOCK_BS"]), launch)


# The chunk pass's tiles hold at most this many rows (query rows x heads): compiled for sm_90, the
# Triton tile of 64 rows spills 248-312 bytes (the split schedule runs the Gluon kernels there),
# 32 rows with 64-token KV tiles and 8 warps none (bench/RESULTS.md, 'MLA kernels').
CHUNK_TILE_ROWS = 32


def chunk_tile(q, W, H, D, block_w, block_h, block_n, num_warps, num_stages) -> tuple:
    """The chunk pass's (block_w, block_h, block_n, num_warps, num_stages) before ``_tile_config``
    fills the rest: the caller's, else tiles of at most CHUNK_TILE_ROWS rows, cut in heads first
    (a 128-head decode tile: 32 heads) and then in query rows, on 64-token KV tiles where the
    card's shared memory stages them, 8 warps, 3 stages."""
    if block_w is not None or block_h is not None or block_n is not None or num_warps is not None:
        return block_w, block_h, block_n, num_warps, num_stages
    block_w, block_h = tile_shape(W, H)
    if block_w * block_h <= CHUNK_TILE_ROWS:
        return None, None, None, None, num_stages       # _tile_config's own (16-row decode tiles)
    block_h = min(block_h, CHUNK_TILE_ROWS)
    block_w = max(1, CHUNK_TILE_ROWS // block_h)
    return block_w, block_h, fit_block_n(q, 64, D * q.element_size()), 8, num_stages or 3


# A budget of several waves (``schedule.many_waves``) cuts no request into more than this many chunks (its chunk at
# least the longest request's / MANY_WAVES_CAP: ``chunk_map.gluon_chunk_of``): at 4 chunks a request (MLA-128 bs 48) a
# long tail's long requests took 52, and their merge 11 -> 31 us. The size of one chunk a request there instead left SMs
# idle (MLA-128 bs 34's long tail 123.6 us, 96.1 at 16; 32 and 64 a request slower: bench/RESULTS.md, 'Ragged batches').
MANY_WAVES_CAP = 16

# Under that cap the chunk size planned by a wave model of the grid (``chunk_plan``) in every call, by a launch before
# the chunk pass: fewer, larger chunks where the capped fit's last wave is nearly empty. Off: its launch, one program,
# costs 9-14 us a call, more than the larger chunks give back on 20 of 32 rows measured; ``triton_mla`` plans once a
# step instead (``mla_chunk_plan``, ``planned=True``; bench/RESULTS.md, 'Ragged batches').
PLAN_WAVES = False

# Under the wave fit the Gluon chunk pass publishes its chunk size and the merge reads it (``ChunkLaunch.published``)
# instead of repeating the fit's search in each of its programs.
PUBLISH_FIT = True

# KV tokens of each Gluon kernel's tile: the chunk schedule's tile when it runs the launch
GLUON_TOKENS = {"wgmma": 64, "seesaw": 32, "chunked": 64, "dbuf": 64, "swap": 64}


def _gluon_kernel(q, kv_buffer, W, H, Dv, page_size, mask, schedule, kernel, knobs):
    """``(kernel, (block_w, block_h))``: the Gluon kernel that runs a chunk launch and its tile, or ``(None,
    None)`` for the Triton tile: ``mla_attention_fwd``'s choice for the default tile (not a streaming launch: a
    program reads a chunk), for the "chunks" schedule and no tile knobs."""
    if kernel == "triton" or schedule != "chunks" or any(k is not None for k in knobs):
        return None, None
    block_w, block_h = tile_shape(W, H)
    use = _pick_kernel("mla_chunk_fwd", None, q, kv_buffer, Dv, q.shape[2] - Dv, block_w * block_h, None, None,
                       None, False, page_size, streaming=False, width=W, mask=mask, block_w=block_w)
    return (None, None) if use == "triton" else (use, (block_w, block_h))


def _launch_gluon(use, grid, cl, q, kv_buffer, page_table, seq_lens_k, mask_arg, draft_arg, scale_log2, W, H, Dv,
                  rope, page_size, block_w, block_h, mask_kind, cap=0):
    """A Gluon kernel on the chunk schedule (``wgmma._program``): chunk budget in ``NUM_SPLITS``, every
    chunk's partial at row ``k * W + j`` of the contiguous workspace, ``k`` its index in request order (the offset the
    kernel adds per chunk is a head stride times ``(k - b) * W * H``, hence the checks)."""
    part, lse = cl.part, cl.lse
    if part.stride(0) != H * part.stride(1) or lse.stride(0) != H or lse.stride(1) != 1:
        raise ValueError(f"mla_chunk_fwd: the Gluon chunk pass needs a contiguous workspace (part strides "
                         f"{part.stride()}, lse strides {lse.stride()}; chunk_workspace's are)")
    gluon_kernel, warps = GLUON_LAUNCH[use]
    launch(gluon_kernel, grid, q, kv_buffer, page_table, seq_lens_k, mask_arg, draft_arg, part, lse, scale_log2,
           q.stride(0), q.stride(1), kv_buffer.stride(0), page_table.stride(0), part.stride(0), part.stride(1),
           part.stride(1), lse.stride(0), lse.stride(1), W, cl.budget, NUM_HEADS=H, BLOCK_H=block_h,
           BLOCK_W=block_w, LATENT=Dv, ROPE=rope, PAGE_SIZE=page_size, WRITE_LSE=True, MASK=mask_kind,
           CHUNK_BS=max(32, cl.consts["BLOCK_BS"]), CHUNK_CAP=cap, **warps)
