"""The device code of the chunk schedule (``schedule.py`` holds the launches, workspaces and the rule):
the schedule each program recomputes from the device's lengths (``chunk_of``, the wave fit in
``_balanced_per``), and the two merges of a request's chunk partials, by its last chunk program
(``merge_chunks_if_last``) or by a second launch (``_merge_chunk_pass_kernel``, tiled by
``merge_pass_tiles``)."""
import triton
import triton.language as tl

from .kv_walk import window_lo
from .launch_record import cdiv, pow2

MERGE_LSE = tl.constexpr(32)      # chunks' log-sum-exps a load in the merge
MERGE_UNROLL = tl.constexpr(4)    # chunks' partials in flight a merge step
# The separate merge pass: chunks a load, and partial values a load ([heads, chunks, 128 columns] of
# one row); programs wanted before a program's columns are cut over the grid. A request's merge by its
# last chunk program reads its chunks serially; the pass spreads them over programs.
MERGE_PASS_CHUNKS = 16
# Decode budgets of at least MERGE_PASS_WIDE_FROM chunks a request, at Dv <= 256, load MERGE_PASS_WIDE_CHUNKS:
# a long request there has hundreds of chunks, and 64 a load merged it in a quarter of the rounds (GQA 8/1
# long tails 11-14 % faster; at 2-8 chunks a request 64 lanes cost up to 1.7 %; verify and MLA not measured:
# bench/RESULTS.md, 'Ragged batches').
MERGE_PASS_WIDE_CHUNKS = 64
MERGE_PASS_WIDE_FROM = 16
# From MERGE_PASS_DEEP_FROM chunks a request: MERGE_PASS_DEEP_CHUNKS a load over MERGE_PASS_DEEP_DV columns a
# program, the other columns on the grid: half the dependent loads of a long request's merge, the accumulator no
# larger (faster from 32 chunks a request, slower at 16: bench/RESULTS.md, 'Ragged batches').
MERGE_PASS_DEEP_FROM = 32
MERGE_PASS_DEEP_CHUNKS = 128
MERGE_PASS_DEEP_DV = 64
MERGE_PASS_VALUES = 4096
MERGE_PASS_PROGRAMS = 264
# MLA's latent, one query row a chunk (decode): column blocks on the grid, doubled while rows x head blocks x column
# blocks are under MERGE_PASS_LATENT_PROGRAMS, where a long request's merge programs each walked its chunks once a
# column block (MLA-128 decode bs 24 long tail 75.6 -> 64.9 us at 1,024; at 2,048 bs 67 / 96's long tails' merges
# 21.9 / 25.7 -> 14.4 / 17.6 us, MLA-128 bs 34-96's other merges within 1 us, MLA-64 not measured; verify, at four
# rows a chunk, lost 0.4-1.2 % with all four: bench/RESULTS.md, 'Ragged batches').
MERGE_PASS_LATENT_PROGRAMS = 2048
# MLA's latent: budgets of at most MERGE_PASS_FAT_DECODE chunks a request in decode (MERGE_PASS_FAT_VERIFY in
# verify) take the fat tiles (``merge_pass_tiles``): at 5 a request the one-head tiles walked the latent's four
# column blocks one after another, 39-42 us of MLA-128 bs 13's graph; at 10 (MLA-16 bs 13) they took 0.3-2 us more
# than fat tiles of 16 chunks (bench/RESULTS.md, 'Ragged batches').
MERGE_PASS_FAT_DECODE = 16
MERGE_PASS_FAT_VERIFY = 2
# The warps of MLA's fat decode tiles: as many as give a thread MERGE_PASS_THREAD_BYTES of partials a load, 2 at least
# (1 no faster on full tiles, smaller ones unmeasured). At 4 warps 16-bit partials took shared-memory layout
# conversions and unvectorized stores (MLA-128 bs 13's merge 13.5 us, 5.9 at 2). One-head tiles keep 4 (at 1-2, long
# tails' chains of loads up to 10 % slower) and verify (mixed at 2): bench/RESULTS.md, 'Ragged batches'.
MERGE_PASS_THREAD_BYTES = 128
# On the fat decode tiles, a request whose chunks fit one load merged in one round of loads (``_merge_one_load``:
# MLA-128 bs 13's merge 6.0 -> 4.9 us); one-head tiles keep the two walks (GQA within +-1.2 us either way) and verify
# (not measured): bench/RESULTS.md, 'Ragged batches'.
MERGE_PASS_ONE_LOAD = True
# The sum's walk of a request's chunks with its next load in flight (``_merge_two_pass``'s PREFETCH), where the walks
# were chains of single dependent loads (``merge_pass_prefetch``): decode's tiles but GQA's deep ones and MLA's fat
# ones of 16-bit partials, where the second load's registers cost more programs an SM than its overlap gave back;
# verify keeps the plain walk (a form with it measured slower there): bench/RESULTS.md, 'Ragged batches'.
MERGE_PASS_PREFETCH = True


@triton.jit
def _chunk_counts(seq_lens_ptr, bs, num_chunks, window, q_rows, draft_prefix_ptr, per_ptr, BLOCK_N: tl.constexpr,
                  MIN_TILES: tl.constexpr, FIXED_TILES: tl.constexpr, BLOCK_BS: tl.constexpr, MASK: tl.constexpr,
                  WINDOW: tl.constexpr, PUBLISHED: tl.constexpr):
    """The schedule of the batch: ``(offs, lens, lo, per, n, ends)``, each request's length and
    first KV entry (``WINDOW``: its window's, ``kv_walk.window_lo`` of ``q_rows`` rows of mask kind
    ``MASK``; else 0), the chunk in tiles, each request's chunk count and their running sum. A
    windowed request is cut from its window's start: the balance counts the KV read. ``PUBLISHED``: the
    chunk in tiles read at ``per_ptr`` (a float32 the chunk pass wrote: ``ChunkLaunch.published``)."""
    offs = tl.arange(0, BLOCK_BS)
    lens = tl.load(seq_lens_ptr + offs, mask=offs < bs, other=0)
    lo = lens * 0
    if WINDOW:
        dp = lens * 0
        if MASK == 2:
            dp = tl.load(draft_prefix_ptr + offs, mask=offs < bs, other=0)
        lo = tl.where(offs < bs, window_lo(lens, q_rows, dp, 0, window, MASK), 0)
    tiles = (lens - lo + BLOCK_N - 1) // BLOCK_N
    if FIXED_TILES > 0:
        per = tl.sum(tiles, 0) * 0 + FIXED_TILES
    elif PUBLISHED:
        per = tl.load(per_ptr).to(tl.int32)
    else:
        per = _balanced_per(tiles, offs < bs, bs, num_chunks, MIN_TILES)
    n = tl.where(offs < bs, tl.maximum((tiles + per - 1) // per, 1), 0)
    return offs, lens, lo, per, n, tl.cumsum(n, 0)


@triton.jit
def _balanced_per(tiles, valid, bs, num_chunks, MIN_TILES: tl.constexpr):
    """The balanced chunk in tiles: ``cdiv(tiles, |num_chunks|)``, at least ``MIN_TILES``. A negative
    ``num_chunks`` asks for the wave fit (``ChunkLaunch.budget``): where rounding each request up to whole
    chunks left more than the budget (programs past one wave for the few chunks past it), the smallest chunk
    that fits the budget, if it costs at most 4/3 of the balanced one (``MIN_TILES`` a chunk's fixed cost):
    SMs that finish short chunks early take the overrun, so it costs less than a wave (fits to up to twice
    the chunk lost 0.68-0.81x: bench/RESULTS.md, 'Ragged batches')."""
    budget = tl.maximum(num_chunks, -num_chunks)     # not abs: a launch arg of 1 is a constexpr
    total = tl.sum(tiles, 0)
    per = tl.maximum((total + budget - 1) // budget, MIN_TILES)
    if num_chunks < 0:          # the fit's reductions where asked alone: every chunk program runs this (and merge
                                # program, unless the chunk pass published it)
        over = tl.sum(tl.where(valid, tl.maximum((tiles + per - 1) // per, 1), 0), 0) > budget
        # a request of t tiles takes at most t / p + 1 chunks: p = cdiv(total, budget - bs) fits
        hi = tl.maximum(tl.max(tiles, 0), per)
        hi = tl.where(budget > bs, tl.minimum(hi, tl.maximum((total + budget - bs - 1) // tl.maximum(budget - bs, 1),
                                                             per)), hi)
        lo = per
        hi = tl.where(over & (budget >= bs), hi, per)
        while lo < hi:          # the smallest chunk whose count fits the budget (counts fall as chunks grow)
            mid = (lo + hi) // 2
            fits = tl.sum(tl.where(valid, tl.maximum((tiles + mid - 1) // mid, 1), 0), 0) <= budget
            hi = tl.where(fits, mid, hi)
            lo = tl.where(fits, lo, mid + 1)
        per = tl.where(3 * (hi + MIN_TILES) <= 4 * (per + MIN_TILES), hi, per)
    return per


@triton.jit
def chunk_of(seq_lens_ptr, j, bs, num_chunks, window, q_rows, draft_prefix_ptr, BLOCK_N: tl.constexpr,
             MIN_TILES: tl.constexpr, FIXED_TILES: tl.constexpr, BLOCK_BS: tl.constexpr, MASK: tl.constexpr,
             WINDOW: tl.constexpr):
    """Chunk ``j`` of the schedule: ``(b, first, count, start, end, total)``, its request (``b >=
    bs``: past the last chunk), the index of the request's first chunk, the request's chunk count,
    the chunk's KV token range ``[start, end)`` and the batch's chunk count. ``FIXED_TILES`` > 0:
    chunks of that many tiles whatever the batch (the batch-invariant schedule, whose grid covers
    as many chunks a request as the page table's width allows: ``slots_per_request``); a negative
    ``num_chunks``: the wave fit (``_balanced_per``). ``WINDOW``:
    chunks from each request's window start (``_chunk_counts``)."""
    offs, lens, lo, per, n, ends = _chunk_counts(seq_lens_ptr, bs, num_chunks, window, q_rows, draft_prefix_ptr,
                                                 seq_lens_ptr, BLOCK_N, MIN_TILES, FIXED_TILES, BLOCK_BS, MASK, WINDOW,
                                                 False)
    b = tl.sum((ends <= j).to(tl.int32), 0)
    mine = offs == b
    count = tl.sum(tl.where(mine, n, 0), 0)
    first = tl.sum(tl.where(mine, ends, 0), 0) - count
    start = tl.sum(tl.where(mine, lo, 0), 0) + (j - first) * per * BLOCK_N
    end = tl.minimum(start + per * BLOCK_N, tl.sum(tl.where(mine, lens, 0), 0))
    return b, first, count, start, end, tl.sum(n, 0)


@triton.jit
def merge_chunks_if_last(sem_ptr, count, part_rows, lse_rows, out_rows, rows_ok, stride_pc, stride_lc,
                         HEAD_DIM_V: tl.constexpr, ROWS: tl.constexpr, BLOCK_DV: tl.constexpr,
                         CHUNK_DV: tl.constexpr):
    """The merge of a request's ``count`` chunk partials by the chunk program that finishes last
    (the rule of ``attention_core.merge_if_last``, with a count read on the device): ``part_rows``
    / ``lse_rows`` / ``out_rows`` are [ROWS] pointers to the first chunk's partial and log2-sum-exp
    of each row and to its output; chunk ``i``'s are ``i * stride_pc`` / ``i * stride_lc`` on.
    ``sem_ptr``: the request's counter (0 before the launch, left 0). The log-sum-exps are read
    MERGE_LSE chunks a load and the partials MERGE_UNROLL chunks a step, so that loads are in
    flight together: one chunk a step left the merge bound by load latency."""
    tl.static_assert(BLOCK_DV % CHUNK_DV == 0)
    tl.debug_barrier()                  # every thread's partial stores precede the release below
    done = tl.atomic_add(sem_ptr, 1, sem="acq_rel", scope="gpu")
    if done == count - 1:
        tl.atomic_xchg(sem_ptr, 0, sem="relaxed", scope="gpu")
        offs_c = tl.arange(0, MERGE_LSE)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        for c0 in range(0, count, MERGE_LSE):
            ok = rows_ok[:, None] & (c0 + offs_c < count)[None, :]
            lse = tl.load(lse_rows[:, None] + (c0 + offs_c).to(tl.int64)[None, :] * stride_lc, mask=ok,
                          other=float("-inf"), cache_modifier=".cg")
            m = tl.maximum(m, tl.max(lse, 1))
        # Each reduced loop result is read once (Triton 3.6's thread-locality pass asserts it on
        # sm_90): a finite floor instead of a where, so a row no chunk saw anything of is zeros.
        m = tl.maximum(m, -1e30)
        w_sum = tl.zeros([ROWS], tl.float32)
        for c0 in range(0, count, MERGE_LSE):
            ok = rows_ok[:, None] & (c0 + offs_c < count)[None, :]
            lse = tl.load(lse_rows[:, None] + (c0 + offs_c).to(tl.int64)[None, :] * stride_lc, mask=ok,
                          other=float("-inf"), cache_modifier=".cg")
            w_sum += tl.sum(tl.exp2(lse - m[:, None]), 1)
        den = tl.maximum(w_sum, 1e-30)
        for c in tl.static_range(BLOCK_DV // CHUNK_DV):
            offs_dv = c * CHUNK_DV + tl.arange(0, CHUNK_DV)
            mask = rows_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
            acc = tl.zeros([ROWS, CHUNK_DV], tl.float32)
            for c0 in range(0, count, MERGE_UNROLL):
                for u in tl.static_range(MERGE_UNROLL):
                    i = c0 + u + tl.zeros([], tl.int64)   # int64: i * stride can pass 2**31 (thousands of wide chunks)
                    ok = i < count
                    w = tl.exp2(tl.load(lse_rows + i * stride_lc, mask=rows_ok & ok, other=float("-inf"),
                                        cache_modifier=".cg") - m)
                    part = tl.load(part_rows[:, None] + i * stride_pc + offs_dv[None, :], mask=mask & ok,
                                   other=0.0, cache_modifier=".cg")
                    acc += w[:, None] * part
            tl.store(out_rows[:, None] + offs_dv[None, :], acc / den[:, None], mask=mask)


@triton.jit
def _merge_chunk_pass_kernel(seq_lens_ptr, cu_q_ptr, part_ptr, lse_ptr, out_ptr, bs, num_chunks, rows_per_chunk,
                             window, draft_prefix_ptr, stride_pt, stride_ph, stride_lt, stride_lh, stride_ot, stride_oh,
                             NUM_HEADS: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_HM: tl.constexpr,
                             BLOCK_DV: tl.constexpr, DV_STEPS: tl.constexpr, BLOCK_C: tl.constexpr,
                             BLOCK_N: tl.constexpr, MIN_TILES: tl.constexpr, FIXED_TILES: tl.constexpr,
                             BLOCK_BS: tl.constexpr, HAS_CU: tl.constexpr, MASK: tl.constexpr, WINDOW: tl.constexpr,
                             SINGLE: tl.constexpr = False, PDL: tl.constexpr = False,
                             MERGED_UPTO: tl.constexpr = 1, PUBLISHED: tl.constexpr = False,
                             ONE_LOAD: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    """The separate merge (``merge="pass"``): program (query row j of request b, head block, column
    block) merges that row's chunk partials for BLOCK_HM heads and DV_STEPS x BLOCK_DV columns, BLOCK_C
    chunks a load, in chunk order, where the request has more than ``MERGED_UPTO`` chunks (one chunk wrote
    its output itself, up to ``MERGED_UPTO`` its last chunk program merged them; ``SINGLE``: one chunk wrote
    a partial, merged too). ``cu_q_ptr``: the rows of each request (HAS_CU;
    else ``rows_per_chunk`` rows a request). Tiles from ``merge_pass_tiles``: the schedule, the
    log-sum-exps and the partials are a chain of dependent loads, so MLA's programs take many heads
    (bench/RESULTS.md, 'Ragged batches'). ``PDL``: launched as a dependent of the chunk pass (``pdl.py``):
    the schedule found before ``gdc_wait``, the partials read after it; ``PUBLISHED``: the chunk size read from the
    first log-sum-exp row past the grid's slots, where the chunk pass wrote it, so the schedule after ``gdc_wait``.
    ``ONE_LOAD``: a request whose chunks fit one load merged by ``_merge_one_load``; ``PREFETCH``: as
    ``_merge_two_pass`` takes it."""
    r = tl.program_id(0)
    b = r // rows_per_chunk
    j = r % rows_per_chunk
    if PDL and PUBLISHED:
        tl.extra.cuda.gdc_wait()
    per_at = lse_ptr + (tl.maximum(num_chunks, -num_chunks) + bs).to(tl.int64) * rows_per_chunk * stride_lt
    offs, lens, lo, per, n, ends = _chunk_counts(seq_lens_ptr, bs, num_chunks, window, rows_per_chunk, draft_prefix_ptr,
                                                 per_at, BLOCK_N, MIN_TILES, FIXED_TILES, BLOCK_BS, MASK, WINDOW,
                                                 PUBLISHED)
    count = tl.sum(tl.where(offs == b, n, 0), 0)
    first = tl.sum(tl.where(offs == b, ends, 0), 0) - count
    q_start = b * rows_per_chunk       # uniform rows (decode: one a request)
    q_len = rows_per_chunk
    if HAS_CU:
        q_start = tl.load(cu_q_ptr + b)
        q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if PDL and not PUBLISHED:       # every program, as PTX asks of a dependent whose primary triggers early
        tl.extra.cuda.gdc_wait()
    if ((count > MERGED_UPTO) | SINGLE) & (j < q_len):
        offs_h = tl.program_id(1) * BLOCK_HM + tl.arange(0, BLOCK_HM)
        ok_h = offs_h < NUM_HEADS
        if ONE_LOAD:                # a constexpr branch of its own: the kernels without it hold the two walks alone
            if count <= BLOCK_C:
                _merge_one_load(part_ptr, lse_ptr, out_ptr, first, count, rows_per_chunk, j, q_start, offs_h, ok_h,
                                stride_pt, stride_ph, stride_lt, stride_lh, stride_ot, stride_oh, HEAD_DIM_V, BLOCK_HM,
                                BLOCK_DV, DV_STEPS, BLOCK_C)
            else:
                _merge_two_pass(part_ptr, lse_ptr, out_ptr, first, count, rows_per_chunk, j, q_start, offs_h, ok_h,
                                stride_pt, stride_ph, stride_lt, stride_lh, stride_ot, stride_oh, HEAD_DIM_V, BLOCK_HM,
                                BLOCK_DV, DV_STEPS, BLOCK_C, PREFETCH)
        else:
            _merge_two_pass(part_ptr, lse_ptr, out_ptr, first, count, rows_per_chunk, j, q_start, offs_h, ok_h,
                            stride_pt, stride_ph, stride_lt, stride_lh, stride_ot, stride_oh, HEAD_DIM_V, BLOCK_HM,
                            BLOCK_DV, DV_STEPS, BLOCK_C, PREFETCH)


@triton.jit
def _merge_block(part_ptr, lse_ptr, first, c0, count, rows_per_chunk, j, offs_h, ok_h, offs_dv, ok_dv, stride_pt,
                 stride_ph, stride_lt, stride_lh, BLOCK_C: tl.constexpr):
    """Chunks ``c0 .. c0 + BLOCK_C`` of a request's ``count``: their log-sum-exps and partials (-inf and zeros past
    ``count``, not read)."""
    offs_c = c0 + tl.arange(0, BLOCK_C)
    rows = (first + offs_c).to(tl.int64) * rows_per_chunk + j
    ok = ok_h[:, None] & (offs_c < count)[None, :]
    lse = tl.load(lse_ptr + rows[None, :] * stride_lt + offs_h[:, None] * stride_lh, mask=ok, other=float("-inf"))
    part = tl.load(part_ptr + rows[None, :, None] * stride_pt + offs_h[:, None, None] * stride_ph
                   + offs_dv[None, None, :], mask=ok[:, :, None] & ok_dv[None, None, :], other=0.0)
    return lse, part


@triton.jit
def _merge_two_pass(part_ptr, lse_ptr, out_ptr, first, count, rows_per_chunk, j, q_start, offs_h, ok_h, stride_pt,
                    stride_ph, stride_lt, stride_lh, stride_ot, stride_oh, HEAD_DIM_V: tl.constexpr,
                    BLOCK_HM: tl.constexpr, BLOCK_DV: tl.constexpr, DV_STEPS: tl.constexpr, BLOCK_C: tl.constexpr,
                    PREFETCH: tl.constexpr):
    """The merge pass's program over its column steps: the chunks' maximum log-sum-exp in one walk, the weighted
    sum in another, BLOCK_C chunks a load. ``PREFETCH``: the sum's next load issued before this one is used, its
    first before the maximum's walk, so that two loads are in flight, not a chain of single ones."""
    offs_c = tl.arange(0, BLOCK_C)
    if PREFETCH:
        dv0 = tl.program_id(2) * DV_STEPS * BLOCK_DV + tl.arange(0, BLOCK_DV)
        lse_n, part_n = _merge_block(part_ptr, lse_ptr, first, 0, count, rows_per_chunk, j, offs_h, ok_h, dv0,
                                     dv0 < HEAD_DIM_V, stride_pt, stride_ph, stride_lt, stride_lh, BLOCK_C)
    m = tl.full([BLOCK_HM, BLOCK_C], float("-inf"), tl.float32)
    for c0 in range(0, count, BLOCK_C):
        rows = (first + c0 + offs_c).to(tl.int64) * rows_per_chunk + j
        ok = ok_h[:, None] & (c0 + offs_c < count)[None, :]
        m = tl.maximum(m, tl.load(lse_ptr + rows[None, :] * stride_lt + offs_h[:, None] * stride_lh, mask=ok,
                                  other=float("-inf")))
    top = tl.maximum(tl.max(m, 1), -1e30)            # a row no chunk saw anything of: zeros
    w_sum = tl.zeros([BLOCK_HM, BLOCK_C], tl.float32)
    den = tl.full([BLOCK_HM], 1.0, tl.float32)
    for step in tl.static_range(DV_STEPS):
        offs_dv = (tl.program_id(2) * DV_STEPS + step) * BLOCK_DV + tl.arange(0, BLOCK_DV)
        ok_dv = offs_dv < HEAD_DIM_V
        acc = tl.zeros([BLOCK_HM, BLOCK_C, BLOCK_DV], tl.float32)
        if PREFETCH:
            if step > 0:
                lse_n, part_n = _merge_block(part_ptr, lse_ptr, first, 0, count, rows_per_chunk, j, offs_h, ok_h,
                                             offs_dv, ok_dv, stride_pt, stride_ph, stride_lt, stride_lh, BLOCK_C)
            for c0 in range(BLOCK_C, count + BLOCK_C, BLOCK_C):
                lse, part = lse_n, part_n
                lse_n, part_n = _merge_block(part_ptr, lse_ptr, first, c0, count, rows_per_chunk, j, offs_h, ok_h,
                                             offs_dv, ok_dv, stride_pt, stride_ph, stride_lt, stride_lh, BLOCK_C)
                w = tl.exp2(lse - top[:, None])
                if step == 0:
                    w_sum += w
                acc += w[:, :, None] * part.to(tl.float32)
        else:
            for c0 in range(0, count, BLOCK_C):
                rows = (first + c0 + offs_c).to(tl.int64) * rows_per_chunk + j
                ok = ok_h[:, None] & (c0 + offs_c < count)[None, :]
                w = tl.exp2(tl.load(lse_ptr + rows[None, :] * stride_lt + offs_h[:, None] * stride_lh, mask=ok,
                                    other=float("-inf")) - top[:, None])
                if step == 0:
                    w_sum += w                           # elementwise: the sums over chunks after the loop
                part = tl.load(part_ptr + rows[None, :, None] * stride_pt + offs_h[:, None, None] * stride_ph
                               + offs_dv[None, None, :], mask=ok[:, :, None] & ok_dv[None, None, :], other=0.0)
                acc += w[:, :, None] * part.to(tl.float32)
        if step == 0:
            den = tl.maximum(tl.sum(w_sum, 1), 1e-30)
        out = tl.sum(acc, 1) / den[:, None]
        tl.store(out_ptr + (q_start + j).to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh
                 + offs_dv[None, :], out, mask=ok_h[:, None] & ok_dv[None, :])


@triton.jit
def _merge_one_load(part_ptr, lse_ptr, out_ptr, first, count, rows_per_chunk, j, q_start, offs_h, ok_h, stride_pt,
                    stride_ph, stride_lt, stride_lh, stride_ot, stride_oh, HEAD_DIM_V: tl.constexpr,
                    BLOCK_HM: tl.constexpr, BLOCK_DV: tl.constexpr, DV_STEPS: tl.constexpr, BLOCK_C: tl.constexpr):
    """``_merge_two_pass`` where the request's ``count`` chunks fit one load: each column step's partials loaded
    before the log-sum-exps are used, so the two loads are in flight together, not a chain of three."""
    offs_c = tl.arange(0, BLOCK_C)
    rows = (first + offs_c).to(tl.int64) * rows_per_chunk + j
    ok = ok_h[:, None] & (offs_c < count)[None, :]
    lse = tl.load(lse_ptr + rows[None, :] * stride_lt + offs_h[:, None] * stride_lh, mask=ok, other=float("-inf"))
    w = tl.zeros([BLOCK_HM, BLOCK_C], tl.float32)
    den = tl.full([BLOCK_HM], 1.0, tl.float32)
    for step in tl.static_range(DV_STEPS):
        offs_dv = (tl.program_id(2) * DV_STEPS + step) * BLOCK_DV + tl.arange(0, BLOCK_DV)
        ok_dv = offs_dv < HEAD_DIM_V
        part = tl.load(part_ptr + rows[None, :, None] * stride_pt + offs_h[:, None, None] * stride_ph
                       + offs_dv[None, None, :], mask=ok[:, :, None] & ok_dv[None, None, :], other=0.0)
        if step == 0:
            w = tl.exp2(lse - tl.maximum(tl.max(lse, 1), -1e30)[:, None])    # a row no chunk saw anything of: zeros
            den = tl.maximum(tl.sum(w, 1), 1e-30)
        out = tl.sum(w[:, :, None] * part.to(tl.float32), 1) / den[:, None]
        tl.store(out_ptr + (q_start + j).to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_dv[None, :], out,
                 mask=ok_h[:, None] & ok_dv[None, :])


def merge_pass_warps(block_c: int, block_hm: int, block_dv: int, part_bytes: int, one_row: bool) -> int:
    """The merge pass's warps on tiles of ``merge_pass_tiles`` over partials of ``part_bytes`` a value: on decode's
    fat tiles (``one_row``, ``block_hm`` > 1) 2-4, a thread's share of a load MERGE_PASS_THREAD_BYTES; else 4."""
    if not one_row or block_hm == 1:
        return 4
    return max(2, min(4, block_c * block_hm * block_dv * part_bytes // (32 * MERGE_PASS_THREAD_BYTES)))


def merge_pass_prefetch(Dv: int, chunks: int, one_row: bool, part_bytes: int) -> bool:
    """The merge pass's PREFETCH (MERGE_PASS_PREFETCH) on the tiles of ``merge_pass_tiles`` (its ``Dv``, ``chunks``,
    ``one_row``) over partials of ``part_bytes`` a value: decode's, but the deep tiles and the fat ones of 16-bit
    partials."""
    fat, _, deep = _merge_pass_kind(Dv, chunks, one_row)
    return MERGE_PASS_PREFETCH and one_row and not deep and not (fat and part_bytes == 2)


def _merge_pass_kind(Dv: int, chunks: int, one_row: bool) -> tuple:
    """``(fat, wide, deep)``: the merge pass's tile kind (``merge_pass_tiles``)."""
    fat = Dv > 256 and 0 < chunks <= (MERGE_PASS_FAT_DECODE if one_row else MERGE_PASS_FAT_VERIFY)
    wide = one_row and Dv <= 256 and chunks >= MERGE_PASS_WIDE_FROM
    return fat, wide, wide and chunks >= MERGE_PASS_DEEP_FROM


def merge_pass_tiles(rows: int, H: int, Dv: int, chunks: int, one_row: bool = True) -> tuple:
    """``(BLOCK_C, BLOCK_HM, BLOCK_DV, DV_STEPS, column blocks)`` of the merge pass over ``rows`` query
    rows of requests of up to ``chunks`` chunks a request in the budget (0: the invariant schedule),
    ``one_row`` query row a chunk (decode).
    MLA's latent (``Dv`` > 256) at budgets of up to MERGE_PASS_FAT_DECODE chunks a request (decode;
    MERGE_PASS_FAT_VERIFY else): the budget's chunks (4 at least, a power of two) of as many heads as fill
    MERGE_PASS_VALUES partial values a load (heads first: a program a head and 128 columns made tens of
    thousands of latency-bound programs). Else MERGE_PASS_CHUNKS chunks of one head a load
    (MERGE_PASS_WIDE_CHUNKS on decode budgets of MERGE_PASS_WIDE_FROM or more at Dv <= 256: a long
    request's merge is a chain of loads, kept short, spread over heads; from MERGE_PASS_DEEP_FROM,
    MERGE_PASS_DEEP_CHUNKS over MERGE_PASS_DEEP_DV columns a program, every column block on the grid).
    Each program's columns are cut into grid blocks while rows x head blocks leave fewer than
    MERGE_PASS_PROGRAMS programs (MERGE_PASS_LATENT_PROGRAMS for MLA's decode: up to twice that many with them); the
    invariant schedule's always, so that its tiles and steps are a function of ``H`` and ``Dv`` alone and a row's
    sums do not depend on the batch."""
    fat, wide, deep = _merge_pass_kind(Dv, chunks, one_row)
    block_c = (max(4, pow2(chunks)) if fat else MERGE_PASS_DEEP_CHUNKS if deep else MERGE_PASS_WIDE_CHUNKS if wide
               else MERGE_PASS_CHUNKS)
    block_dv = min(pow2(Dv), MERGE_PASS_DEEP_DV if deep else 128)
    block_hm = min(pow2(H), max(1, MERGE_PASS_VALUES // (block_c * block_dv))) if fat else 1
    col_blocks, programs = cdiv(Dv, block_dv), rows * cdiv(H, block_hm)
    z = col_blocks if chunks == 0 or deep else 1
    enough = MERGE_PASS_LATENT_PROGRAMS if Dv > 256 and one_row else MERGE_PASS_PROGRAMS
    while z < col_blocks and programs * z < enough:
        z *= 2
    z = min(z, col_blocks)
    return block_c, block_hm, block_dv, cdiv(col_blocks, z), z
