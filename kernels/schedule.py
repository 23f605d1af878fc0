"""KV work balanced over a fixed grid from the device's lengths: the chunk schedule (issue #40).

A chunk-scheduled split pass launches ``num_chunks + bs`` programs a KV head (the invariant schedule:
as many as the page table's width allows, ``slots_per_request``), host ints fixed by the GraphKey, and
every program finds its work on the device from ``seq_lens_k``: the batch's KV
tiles (``BLOCK_N`` tokens) are cut into chunks of ``per = max(cdiv(tiles, num_chunks), MIN_TILES)``
tiles, a request of ``t`` tiles taking ``cdiv(t, per)`` of them (at least one), numbered request
after request. ``sum(cdiv(t_b, per)) <= tiles / per + bs <= num_chunks + bs``, so the grid covers
every chunk; programs past the last do nothing. Where whole chunks a request overrun the budget
and the budget is one wave of programs (or several: ``many_waves``), the wave fit (a negative budget:
``_balanced_per``) takes the smallest chunk that fits it, so the few chunks past it do not run as a
wave more. A long
request is cut into many chunks and short ones stay whole, so programs read about the same KV
whatever the lengths, and one captured graph serves any lengths its buffers allow: no host plan,
no host sync, no schedule buffer (each program recomputes it from ``bs`` lengths, cheaper than a
launch that would write one; under the wave fit, whose search costs more, MLA's Gluon chunk pass publishes its
chunk size for the merge: ``ChunkLaunch.published``).

A request of one chunk writes its output directly. A request of several writes a partial per chunk
(normalised output, log2-sum-exp) to the chunk's workspace slot, merged in chunk order by a second
launch (``merge="pass"``: ``ChunkLaunch.merge_pass``) or by the chunk program that finishes last
(``merge="last"``: ``merge_chunks_if_last``; a counter per request and KV head), so the result is a
function of the lengths and ``num_chunks`` alone: replay equals eager.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from . import chunk_kernels
from . import pdl as _pdl
from .attention_core import heads_first_grid
from .chunk_kernels import _merge_chunk_pass_kernel, merge_pass_prefetch, merge_pass_tiles, merge_pass_warps
from .launch_record import cdiv, launch, pow2

# The fewest KV tokens a chunk spans but in decode (``decode_attention.DECODE_MIN_CHUNK_TOKENS``): shorter
# ones re-read the query rows and write a partial for little KV (bench/RESULTS.md, 'Split counts').
MIN_CHUNK_TOKENS = 256
MERGES = ("last", "pass")


# The batch-invariant schedule's chunk: a request's output is the same bits whatever else is in
# the batch and whatever bucket it is padded to (a chunk's work and the merge order depend on its
# own length alone).
INVARIANT_CHUNK_TOKENS = 1024
SCHEDULES = ("split", "chunks", "invariant")


def min_tiles(block_n: int, tokens=None) -> int:
    return max(1, (MIN_CHUNK_TOKENS if tokens is None else tokens) // block_n)


def fixed_tiles(schedule: str, block_n: int) -> int:
    """``FIXED_TILES`` of ``chunk_of`` for a schedule: the invariant chunk in tiles, else 0."""
    return max(1, INVARIANT_CHUNK_TOKENS // block_n) if schedule == "invariant" else 0


def slots_per_request(schedule: str, num_kv_splits: int, max_tokens: int) -> int:
    """``chunks_per_request`` of a chunk workspace: the balanced schedule's chunks a request
    (``num_kv_splits``), or the invariant one's for the longest request (``max_tokens``: what
    the page table's width holds)."""
    return -(-max_tokens // INVARIANT_CHUNK_TOKENS) if schedule == "invariant" else num_kv_splits



def check_schedule(name: str, schedule: str, merge: str) -> None:
    """A wrapper's ``schedule`` and ``merge`` arguments, refused in one line before any launch."""
    if schedule not in SCHEDULES:
        raise ValueError(f"{name}: schedule={schedule!r} not in {SCHEDULES}")
    if merge not in MERGES or (merge != "last" and schedule == "split"):
        raise ValueError(f"{name}: merge={merge!r} not in {MERGES} (the split schedule: 'last')")


@dataclass(frozen=True)
class ChunkLaunch:
    """What a chunk pass launches with (``chunk_launch``): the workspace, the chunk budget, the
    grid, the schedule's constexprs (``consts``: ``MIN_TILES``, ``FIXED_TILES``, ``BLOCK_BS``,
    ``HEADS_FIRST``), and what the separate merge (``merge_pass``) needs of the schedule (with a
    window, its width, the launch's mask kind and draft prefixes: ``_chunk_counts``); ``merged_upto``: requests
    of at most that many chunks are merged by their last chunk program, not by the separate pass; ``pdl``: the
    merge pass a dependent launch (``pdl.merge_pass``, decided once a wrapper call)."""

    part: torch.Tensor
    lse: torch.Tensor
    counters: torch.Tensor
    num_chunks: int
    grid: tuple
    consts: dict
    bs: int
    rows_per_chunk: int
    block_n: int
    schedule: str
    window: int = 0
    mask: int = -1
    draft_prefix_lens: Optional[torch.Tensor] = None
    fit: bool = False
    merged_upto: int = 1
    pdl: bool = False
    published: bool = False

    @property
    def budget(self) -> int:
        """The kernels' ``num_chunks`` argument: the chunk budget, negative for the wave fit
        (``_balanced_per``)."""
        return -self.num_chunks if self.fit else self.num_chunks

    @property
    def trigger(self) -> bool:
        """The chunk pass's ``PDL_TRIGGER``: it lets its dependent merge pass launch from its start."""
        return self.pdl and _pdl.CHUNK_PDL_TRIGGER

    def merge_pass(self, seq_lens_k: torch.Tensor, cu_seqlens_q, out: torch.Tensor, single: bool = False) -> None:
        """The separate merge (``merge="pass"``) of this launch's partials into ``out [T, H, Dv]``:
        one program a (query row, head block, column block: ``merge_pass_tiles``); ``cu_seqlens_q``
        None: ``rows_per_chunk`` rows a request; ``single``: requests of one chunk too (their pass wrote a partial).
        Its warps ``merge_pass_warps`` of the partials' dtype; ``ONE_LOAD`` on decode's fat tiles alone; ``PREFETCH``
        by ``merge_pass_prefetch``."""
        H, Dv = out.shape[1], out.shape[2]
        rows = self.bs * self.rows_per_chunk
        budget = 0 if self.schedule == "invariant" else self.num_chunks // self.bs
        one_row = self.rows_per_chunk == 1
        block_c, block_hm, block_dv, steps, col_grid = merge_pass_tiles(rows, H, Dv, budget, one_row)
        fat = block_hm > 1 and one_row         # decode's fat tiles (MLA's latent)
        part, lse = self.part, self.lse
        pdl = self.pdl
        launch(_merge_chunk_pass_kernel, (rows, cdiv(H, block_hm), col_grid),
               seq_lens_k, cu_seqlens_q if cu_seqlens_q is not None else seq_lens_k, part, lse, out, self.bs,
               self.budget, self.rows_per_chunk, self.window,
               seq_lens_k if self.draft_prefix_lens is None else self.draft_prefix_lens,
               part.stride(0), part.stride(1), lse.stride(0), lse.stride(1),
               out.stride(0), out.stride(1), NUM_HEADS=H, HEAD_DIM_V=Dv, BLOCK_HM=block_hm, BLOCK_DV=block_dv,
               DV_STEPS=steps, BLOCK_C=block_c, BLOCK_N=self.block_n, MIN_TILES=self.consts["MIN_TILES"],
               FIXED_TILES=self.consts["FIXED_TILES"], BLOCK_BS=self.consts["BLOCK_BS"],
               HAS_CU=cu_seqlens_q is not None, MASK=self.mask, WINDOW=self.window > 0, SINGLE=single,
               PDL=pdl, MERGED_UPTO=self.merged_upto, PUBLISHED=self.published,
               ONE_LOAD=chunk_kernels.MERGE_PASS_ONE_LOAD and fat,
               PREFETCH=merge_pass_prefetch(Dv, budget, one_row, part.element_size()),
               launch_pdl=pdl, num_warps=merge_pass_warps(block_c, block_hm, block_dv, part.element_size(), one_row))


def chunk_launch(name: str, out: torch.Tensor, workspace, bs: int, num_kv_splits: int, rows_per_chunk: int,
                 num_kv_heads: int, page_table: torch.Tensor, page_size: int, schedule: str, block_n: int,
                 heads_first, window: int = 0, mask: int = -1, draft_prefix_lens=None,
                 part_dtype: torch.dtype = torch.float32, fit: bool = False, min_tokens=None,
                 merged_upto: int = 1, published: bool = False) -> ChunkLaunch:
    """The shared setup of a chunk pass of ``schedule`` over ``bs`` requests of ``rows_per_chunk``
    query rows: its workspace (``chunk_targets``: as many chunks a request as
    ``slots_per_request`` allows for the page table's width), budget ``bs * num_kv_splits`` and
    grid (``(Hkv, slots)`` or ``(slots, Hkv)``, ``attention_core.heads_first_grid``); ``window``
    (0: none), the launch's mask kind (``kv_walk.MASK_KINDS``, -1: decode) and draft prefixes
    for the merge pass's schedule; ``part_dtype``: the partials' dtype where the workspace is
    allocated here (a given one may hold float32 or ``part_dtype``); ``fit``: the wave fit
    (``_balanced_per``; the balanced schedule only); ``min_tokens``: a chunk's floor (None: MIN_CHUNK_TOKENS);
    ``merged_upto``: requests of at most that many chunks merged by their last chunk program, ``published``: the chunk
    pass publishes its chunk size for the merge (both ``ChunkLaunch``)."""
    if fit and schedule != "chunks":
        raise ValueError(f"{name}: the wave fit is the 'chunks' schedule's, not {schedule!r}'s")
    per_request = slots_per_request(schedule, num_kv_splits, page_table.shape[1] * page_size)
    part, lse, counters = chunk_targets(name, out, workspace, bs, per_request, rows_per_chunk, num_kv_heads,
                                        part_dtype)
    slots = chunk_slots(bs, per_request)
    heads_first, grid = heads_first_grid(name, heads_first, bs, 1, (num_kv_heads, slots), (slots, num_kv_heads))
    consts = dict(MIN_TILES=min_tiles(block_n, min_tokens), FIXED_TILES=fixed_tiles(schedule, block_n),
                  BLOCK_BS=pow2(bs), HEADS_FIRST=heads_first)
    return ChunkLaunch(part, lse, counters, bs * num_kv_splits, grid, consts, bs, rows_per_chunk, block_n, schedule,
                       window or 0, mask, draft_prefix_lens, fit, merged_upto, _pdl.merge_pass(out.device),
                       published)


# A one-chunk-a-request decode budget whose programs leave SMs idle: the count of at most MANY_WAVES waves whose
# last wave is fullest, where it fills at least 1/16 of the SMs more (MLA-128 decode bs 34-80, MLA-16 and -64 bs
# 67-96: 1.1-1.4x on uniform, ragged and bimodal lengths; long tails, with the cap by the longest request and the
# largest chunks first, 0.89-0.92x (MLA-128 bs 48-96) and 0.97x (MLA-16 bs 67) of one chunk a request; bs 56,
# whose every count of at most 3 waves fills 85 %, lost at 4: bench/RESULTS.md, 'Ragged batches').
MANY_WAVES = 3


def many_waves(programs: int, sms: int) -> int:
    """The chunks a request of a budget of several waves for a launch of ``programs`` programs a chunk a request
    (one an SM) on ``sms`` SMs, or 1 where none fills its last wave 1/16 fuller than one chunk a request."""
    def fill(c: int) -> float:
        return c * programs / (sms * -(-c * programs // sms))
    best = max(range(1, MANY_WAVES * sms // programs + 1), key=lambda c: (fill(c), -c), default=1)
    return best if fill(best) >= fill(1) + 1 / 16 else 1


def chunk_slots(bs: int, chunks_per_request: int) -> int:
    """Chunk slots of a chunk schedule of ``bs`` requests (its grid's): ``num_chunks + bs``."""
    return bs * chunks_per_request + bs


# Log-sum-exp rows past the grid's slots' (the partials have none): the first holds the chunk size a chunk pass
# publishes for its merge (``ChunkLaunch.published``).
SCHEDULE_ROWS = 1


def chunk_workspace(bs: int, chunks_per_request: int, rows_per_chunk: int, num_heads: int,
                    num_kv_heads: int, head_dim_v: int, device, part_dtype: torch.dtype = torch.float32) -> tuple:
    """The workspace of a chunk schedule, allocated once (at graph capture): ``(part [slots *
    rows_per_chunk, H, Dv] part_dtype, lse [slots * rows_per_chunk + SCHEDULE_ROWS, H] float32, counters [bs * Hkv]
    int32 zeros)``, slots from :func:`chunk_slots`; ``rows_per_chunk``: the query rows of a
    request (1 for decode). ``part_dtype``: float32, or the output's 16-bit dtype where a kernel
    stores 16-bit partials faster (MLA's warp-specialized kernels: ``warpspec.partial_dtype``); the
    merge sums in float32 either way."""
    rows = chunk_slots(bs, chunks_per_request) * rows_per_chunk
    return (torch.empty(rows, num_heads, head_dim_v, dtype=part_dtype, device=device),
            torch.empty(rows + SCHEDULE_ROWS, num_heads, dtype=torch.float32, device=device),
            torch.zeros(bs * num_kv_heads, dtype=torch.int32, device=device))


def chunk_targets(name: str, out: torch.Tensor, workspace, bs: int, chunks_per_request: int,
                  rows_per_chunk: int, num_kv_heads: int, part_dtype: torch.dtype = torch.float32) -> tuple:
    """The workspace a chunk-scheduled pass writes, checked (allocated where None, which a graph
    must avoid, with ``part_dtype`` partials): ``(part, lse, counters)``; a given one's partials
    float32 or ``part_dtype``."""
    H, Dv = out.shape[1], out.shape[2]
    if workspace is None:
        return chunk_workspace(bs, chunks_per_request, rows_per_chunk, H, num_kv_heads, Dv, out.device, part_dtype)
    rows = chunk_slots(bs, chunks_per_request) * rows_per_chunk
    if len(workspace) != 3:
        raise ValueError(f"{name}: a chunk workspace is (part, lse, counters) as chunk_workspace returns, "
                         f"got {len(workspace)} tensors")
    part, lse, counters = workspace
    allowed = "float32" if part_dtype == torch.float32 else f"float32 or {str(part_dtype)[6:]}"
    if (part.shape[0] < rows or tuple(part.shape[1:]) != (H, Dv) or part.dtype not in (torch.float32, part_dtype)
            or lse.shape[0] < rows + SCHEDULE_ROWS or tuple(lse.shape[1:]) != (H,) or lse.dtype != torch.float32
            or part.stride(-1) != 1 or lse.stride(-1) != 1 or counters.dtype != torch.int32
            or counters.numel() < bs * num_kv_heads or counters.stride(0) != 1
            or any(t.device != out.device for t in workspace)):
        raise ValueError(f"{name}: chunk workspace {tuple(part.shape)} {part.dtype} / {tuple(lse.shape)} / "
                         f"counters {tuple(counters.shape)} does not fit {rows} rows (+{SCHEDULE_ROWS} of lse), H={H}, "
                         f"Dv={Dv}, {bs * num_kv_heads} counters ({allowed}, float32, int32 zeros on {out.device})")
    return workspace
