"""The Gluon MLA kernels as compiled for sm_90 on this machine (no GPU needed): the wrapper must
pick the right one, each must fit one program's shared memory, the wgmma kernel must not spill
and the warp-specialized ones spill at most a few values (bounds below). The GQA kernels
with their split merge fused: one launch, no spill, at most 16 registers a thread more than the
same kernel with the merge separate (a fused merge that holds a [rows, splits, Dv] tile takes
dozens more). A change that breaks one of these would otherwise show only on the device, as a
launch failure (shared memory) or a silent slowdown (spills). Its dot and copy counts are fixed by the Gluon source
(Gluon has no fallback): they guard against edits of the source, nothing more. The compile
runs in a subprocess: this suite's kernels are the interpreter's (``TRITON_INTERPRET=1``
without CUDA)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "probes"
sys.path.insert(0, str(BENCH))
import offline_sm90  # noqa: E402

WGMMA_CONFIGS = ["wgmma mla16 verify4", "wgmma mla128 decode", "wgmma mla128 verify4",
                 "wgmma mla16 draft4", "wgmma mla16 tree8 fp16 page 16", "wgmma mla16 draft4 page 1"]
SEESAW_CONFIGS = ["seesaw mla16 verify4", "seesaw mla128 decode", "seesaw mla128 verify4",
                  "seesaw mla16 draft4", "seesaw mla16 tree8 fp16 page 128"]
# Spill stack of the seesaw kernel (sm_90, triton 3.6: 48-64 bytes, 112 with the tree mask):
# ptxas spills a few values of the warp groups and the loader at their register counts (232,
# 232 and 40 a thread); the bound catches a change that spills the accumulator or the scores
# (hundreds of bytes).
SEESAW_MAX_STACK = 128
CHUNKED_CONFIGS = ["chunked mla16 verify4", "chunked mla128 decode", "chunked mla128 verify4",
                   "chunked mla16 draft4", "chunked mla16 tree8 fp16 page 128"]
# The chunked kernel's (8-24 bytes): its wgmma descriptors spilled (hundreds of bytes) reload
# past L1, which a program's shared memory leaves almost none of, and slow the kernel by a large
# share (bench/RESULTS.md, 'MLA kernels').
CHUNKED_MAX_STACK = 32
DBUF_CONFIGS = ["dbuf mla16 verify4", "dbuf mla128 decode", "dbuf mla128 verify4", "dbuf mla16 draft4",
                "dbuf mla16 tree8 fp16 page 128", "dbuf mla16 decode"]
# The double-buffered kernel spills nothing (triton 3.6; its q indexed by a run-time zero as the
# chunked kernel's): a spill is a change to look at before moving the bound.
DBUF_MAX_STACK = 0
WGMMA_MAX_BARRIERS = 12        # bar.sync in the wgmma kernel's PTX (sm_90, triton 3.6): 6 in its loop

pytestmark = pytest.mark.skipif(not offline_sm90.available(),
                                reason="this Triton bundles no ptxas / cuobjdump")


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(BENCH / "offline_sm90.py"), "--json"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in run.stdout.splitlines()]
    return {label: [r for r in rows if r["config"] == label] for label in {r["config"] for r in rows}}


@pytest.mark.parametrize("label", WGMMA_CONFIGS)
def test_wgmma_kernel_compiles_for_sm90(compiled, label):
    first, *rest = compiled[label]
    assert first["kernel"] == "_mla_wgmma_kernel"
    assert first["stack"] == 0, f"spills: {first}"
    assert first["smem"] <= offline_sm90.SM90_MAX_SHARED, f"shared memory: {first}"
    assert first["wgmma"] >= 3 and first["mma_sync"] == 0 and first["cp_async"] > 0, first
    # Every barrier costs this kernel (one program an SM, nothing else to switch to; figures:
    # bench/RESULTS.md, 'MLA kernels'). A layout conversion or a reduction across the warp groups added
    # to the loop shows here (a compiler that adds one fails it too: look, then move the bound).
    # None counted: the PTX spells them otherwise and the count would check nothing.
    assert 0 < first["barriers"] <= WGMMA_MAX_BARRIERS, f"barriers: {first}"
    assert all(r["kernel"] == "_merge_splits_kernel" for r in rest)


@pytest.mark.parametrize("label,kernel,max_stack",
                         [(c, "_mla_seesaw_kernel", SEESAW_MAX_STACK) for c in SEESAW_CONFIGS]
                         + [(c, "_mla_chunked_kernel", CHUNKED_MAX_STACK) for c in CHUNKED_CONFIGS]
                         + [(c, "_mla_dbuf_kernel", DBUF_MAX_STACK) for c in DBUF_CONFIGS])
def test_warp_specialized_kernel_compiles_for_sm90(compiled, label, kernel, max_stack):
    """The warp-specialized kernels: 12 warps (two groups and the loader's), one program's
    shared memory, wgmma dots and cp.async copies, at most a few spilled values, and their
    16-bit outputs (and split partials) stored 16 bytes a thread (``mla.warpspec.STORE_L256``: 32
    such stores, 8 columns each, cover a thread's share of the 64 x 512 tile; the accumulator's
    own layout stores 4 bytes a thread, where 16-bit partials lose to float32 ones)."""
    first, *rest = compiled[label]
    assert first["kernel"] == kernel and first["warps"] == 12, first
    assert first["stack"] <= max_stack, f"spills: {first}"
    assert first["smem"] <= offline_sm90.SM90_MAX_SHARED, f"shared memory: {first}"
    assert first["wgmma"] >= 6 and first["mma_sync"] == 0 and first["cp_async"] > 0, first
    assert first["v4_stores"] >= 32, f"16-byte stores: {first}"
    assert all(r["kernel"] == "_merge_splits_kernel" for r in rest)


def test_default_gluon_kernel(compiled):
    """kernel=None on sm_90, where pages hold whole 64-token tiles: the double-buffered kernel
    when one program reads each request's KV (split or not), else the chunked kernel; the
    seesaw kernel where they hold whole 32-token tiles, the wgmma kernel elsewhere."""
    assert compiled["default mla16 verify4"][0]["kernel"] == "_mla_dbuf_kernel"
    assert compiled["default mla16 verify4 one split"][0]["kernel"] == "_mla_dbuf_kernel"
    assert compiled["default mla128 decode"][0]["kernel"] == "_mla_chunked_kernel"
    assert compiled["default mla64 decode"][0]["kernel"] == "_mla_dbuf_kernel"   # 64 heads: one program
    assert compiled["default mla16 verify4 page 32"][0]["kernel"] == "_mla_seesaw_kernel"
    assert compiled["default mla16 verify4 page 16"][0]["kernel"] == "_mla_wgmma_kernel"


def test_sixteen_head_decode_takes_the_transposed_kernel(compiled):
    """A 16-row decode tile is the transposed kernel's where pages hold whole 64-token tiles (the
    wgmma kernel padded to 64 rows loses to the Triton kernel), the Triton kernel's elsewhere."""
    assert compiled["mla16 decode"][0]["kernel"] == "_mla_swap_kernel"
    assert compiled["mla16 decode page 16"][0]["kernel"] == "_mla_split_kernel"


@pytest.mark.parametrize("label", ["swap mla16 decode", "swap mla20 decode fp16 page 128"])
def test_transposed_kernel_compiles_for_sm90(compiled, label):
    """The transposed decode kernel: 8 warps (the consumer group and the loader's), one program's
    shared memory, no spill, wgmma dots and cp.async copies."""
    first, *rest = compiled[label]
    assert first["kernel"] == "_mla_swap_kernel" and first["warps"] == 8, first
    assert first["stack"] == 0, f"spills: {first}"
    assert first["smem"] <= offline_sm90.SM90_MAX_SHARED, f"shared memory: {first}"
    assert first["wgmma"] >= 2 and first["mma_sync"] == 0 and first["cp_async"] > 0, first
    assert all(r["kernel"] == "_merge_splits_kernel" for r in rest)


@pytest.mark.parametrize("label", ["gqa32 decode S64", "gqa64 decode S32", "gqa32 verify4 S8", "gqa32 verify4 S4",
                                   "gqa64 verify4 S4", "gqa32 tree8 S4", "gqa64 tree8 S4", "gqa64 tree8 S2"])
def test_the_fused_merge_costs_few_registers(compiled, label):
    fused, separate = compiled[f"{label} fused"], compiled[f"{label} separate"]
    assert len(fused) == 1 and [r["kernel"] for r in separate][1:] == ["_merge_splits_kernel"], (fused, separate)
    assert fused[0]["stack"] == 0, f"spills: {fused[0]}"
    assert fused[0]["regs"] <= separate[0]["regs"] + 16, (fused[0]["regs"], separate[0]["regs"])


@pytest.mark.parametrize("label", ["chunks 32/8 d128", "chunks 32/8 d128 bs16", "chunks 32/8 d64", "chunks 32/1 d128",
                                   "chunks 28/4 d128",
                                   "chunks 8/1 d128",
                                   "chunks 64/8 d128", "chunks 32/8 d128 features", "chunks 32/8 d128 fp8",
                                   "chunks 32/8 d256"])
def test_the_chunk_pass_register_bound_spills_nothing(compiled, label):
    """Decode's chunk pass at the backend's defaults (24 requests but where named): 64 registers (8
    programs an SM, as the split pass's) where ``chunk_maxnreg`` bounds it, and no spill anywhere (FP8,
    d256, a group of 32 and 16 requests keep the compiler's count because 64 would spill there)."""
    chunk = [r for r in compiled[label] if r["kernel"] == "_decode_chunk_kernel"]
    assert len(chunk) == 1, compiled[label]
    bounded = not label.endswith(("fp8", "d256", "bs16", "32/1 d128"))
    assert chunk[0]["stack"] == 0, f"spills: {chunk[0]}"
    assert (chunk[0]["regs"] <= 64) == bounded, chunk[0]


@pytest.mark.parametrize("label", ["chunks 8/1 d128", "chunks 28/4 d128", "chunks 32/8 d64", "chunks verify4 32/8 d128",
                                   "chunks verify4 8/1 d128", "balanced mla16 decode", "balanced mla16 verify4"])
def test_the_merge_pass_is_a_dependent_launch_that_waits(compiled, label):
    """On sm_90 the chunk schedule's merge pass launches as a programmatic dependent of the chunk pass
    (``pdl.MERGE_PASS_PDL``) and waits for it (``gdc_wait``) before reading the partials; the GQA chunk passes
    (decode, verify) let it launch from their start (``pdl.CHUNK_PDL_TRIGGER``; MLA's from their programs' exit).
    A dependent launch without the wait reads partials being written (tests/kernels/test_merge_pdl.py shows it on
    the GPU)."""
    merge = [r for r in compiled[label] if r["kernel"] == "_merge_chunk_pass_kernel"]
    assert len(merge) == 1 and merge[0]["pdl"] and merge[0]["gdc_wait"] >= 1, compiled[label]
    chunk = [r for r in compiled[label] if r["kernel"] in ("_decode_chunk_kernel", "_extend_chunk_kernel")]
    assert len(chunk) == (0 if label.startswith("balanced") else 1), compiled[label]
    assert all(r["gdc_trigger"] == 1 and not r["pdl"] for r in chunk), chunk


@pytest.mark.parametrize("label", ["deep 8/1 d128", "deep 8/1 d128 fp8", "gqa32 decode S64 separate"])
def test_the_split_merge_is_a_dependent_launch_that_waits(compiled, label):
    """``merge_splits`` after a split pass launches as a dependent (``pdl.SPLIT_MERGE_PDL``) and waits before its
    first load; the decode split pass lets it launch from its start."""
    split, merge = compiled[label][0], compiled[label][-1]
    assert merge["kernel"] == "_merge_splits_kernel" and merge["pdl"] and merge["gdc_wait"] == 1, compiled[label]
    assert split["kernel"] == "_decode_split_kernel" and split["gdc_trigger"] == 1 and not split["pdl"], split


@pytest.mark.parametrize("few", [0, 2, 4, 8])
@pytest.mark.parametrize("label", ["resident 32/8 d128", "resident 28/4 d128", "resident 12/4 d128",
                                   "resident 20/4 d128", "resident 24/4 d128", "resident 8/1 d128",
                                   "resident 64/8 d128", "resident 64/4 d128", "resident 32/8 d64",
                                   "resident 28/4 d64", "resident 32/32 d128", "resident 16/8 d128"])
def test_the_chunk_pass_holds_what_the_wave_fit_assumes(compiled, label, few):
    """``chunk_resident``: the programs an SM the chunk pass holds at the compiler's registers on sm_90 (65,536
    registers an SM, a warp's in units of 256, 4 warps), 6 where it says 6 and at least 7 where it says 7, compiled
    with FEW_LAST ``few`` (0: off; else merged by the last chunk program from pow2(S) = few chunks a request)."""
    from attn_backends_kernels.decode_attention import chunk_resident
    key = label + (f" few{few}" if few else "")
    chunk = [r for r in compiled[key] if r["kernel"] == "_decode_chunk_kernel"]
    assert len(chunk) == 1 and chunk[0]["stack"] == 0, compiled[key]
    heads, dim = label.split()[1:]
    H, Hkv = map(int, heads.split("/"))
    held = 65536 // (-(-chunk[0]["regs"] * 32 // 256) * 256 * 4)
    said = chunk_resident(int(dim[1:]), H // Hkv, few)
    assert held == said if said == 6 else held >= said, (chunk[0]["regs"], held, said)


@pytest.mark.parametrize("label,prefetch", [
    ("prefetch c16 8/1 d128", True), ("prefetch c64 8/1 d128", True), ("prefetch c64 32/8 d64", True),
    ("chunks 8/1 d128", False), ("chunks 28/4 d128", True), ("balanced mla16 decode", True),
    ("balanced mla128 decode", False), ("chunks verify4 8/1 d128", False), ("balanced mla16 verify4", False),
    ("balanced mla16 decode S10", True)])
def test_the_merge_pass_prefetches_on_decode_tiles_without_spills(compiled, label, prefetch):
    """The merge pass's sum walk with its next load in flight (``MERGE_PASS_PREFETCH``) on decode's tiles, GQA's at
    16 and 64 chunks a load and MLA-16's fat tiles of float32 partials (of 16 chunks at 10 a request too), and not on
    GQA's deep tiles (8/1 d128 at 32
    chunks a request), MLA-128's fat ones of bfloat16 nor in verify; it builds for sm_90 without a spill."""
    merges = [r for r in compiled[label] if r["kernel"] == "_merge_chunk_pass_kernel"]
    assert len(merges) == 1 and merges[0]["stack"] == 0 and merges[0]["prefetch"] is prefetch, compiled[label]


BALANCED_GLUON = [("balanced mla16 decode", "_mla_swap_kernel", 0),
                  ("balanced mla128 decode", "_mla_chunked_kernel", CHUNKED_MAX_STACK),
                  ("balanced mla16 verify4", "_mla_chunked_kernel", CHUNKED_MAX_STACK),
                  ("balanced mla16 tree8 page 64", "_mla_chunked_kernel", CHUNKED_MAX_STACK),
                  ("balanced mla16 draft4 page 64", "_mla_chunked_kernel", CHUNKED_MAX_STACK),
                  ("balanced mla16 verify4 page 32", "_mla_seesaw_kernel", SEESAW_MAX_STACK),
                  ("balanced mla16 verify4 page 16", "_mla_wgmma_kernel", 0),
                  ("balanced mla128 decode waves page 64", "_mla_chunked_kernel", CHUNKED_MAX_STACK),   # CHUNK_CAP
                  ("balanced mla128 decode waves page 32", "_mla_seesaw_kernel", SEESAW_MAX_STACK),
                  ("balanced mla128 decode waves page 16", "_mla_wgmma_kernel", 0),
                  ("balanced mla16 decode waves", "_mla_swap_kernel", 0),
                  ("balanced mla128 decode waves planned", "_mla_chunked_kernel", CHUNKED_MAX_STACK),   # PLANNED
                  ("balanced mla16 decode waves planned", "_mla_swap_kernel", 0)]


@pytest.mark.parametrize("label,kernel,max_stack", BALANCED_GLUON)
def test_chunk_schedule_runs_the_gluon_kernels(compiled, label, kernel, max_stack):
    """The MLA chunk pass on sm_90 (``mla.balanced``, kernel=None): the Gluon kernel that serves the
    launch's tile (the split launch's rule) on the chunk schedule, then the merge pass; within one
    program's shared memory and the split launch's spill bounds; ``kernel="triton"`` keeps the Triton tile. A budget
    of waves passes its cap down (``CHUNK_CAP``), no other launch does; planned (``PLAN_WAVES``), its chunk size
    planned first (``chunk_plan``) and the plan's flag with the cap."""
    from attn_backends_kernels.mla.balanced import MANY_WAVES_CAP
    from attn_backends_kernels.mla.chunk_map import PLANNED
    launches = compiled[label]
    if "planned" in label:
        assert launches[0]["kernel"] == "_mla_chunk_plan_kernel" and launches[0]["stack"] == 0, launches
        launches = launches[1:]
    assert [r["kernel"] for r in launches] == [kernel, "_merge_chunk_pass_kernel"], launches
    cap = (MANY_WAVES_CAP if "waves" in label else 0) + (PLANNED.value if "planned" in label else 0)
    assert launches[0]["cap"] == cap, launches[0]
    assert launches[0]["stack"] <= max_stack, f"spills: {launches[0]}"
    assert launches[0]["smem"] <= offline_sm90.SM90_MAX_SHARED, f"shared memory: {launches[0]}"
    if f"balanced triton {label[9:]}" in compiled:
        assert compiled[f"balanced triton {label[9:]}"][0]["kernel"] == "_mla_chunk_kernel"


@pytest.mark.parametrize("label", ["deep 8/1 d128", "deep 8/1 d128 fp8"])
def test_the_deep_decode_and_its_merge_spill_nothing(compiled, label):
    """A decode of few programs on 256 splits: the split pass and the separate merge of 256 float32 partials a
    row, whose 128 columns come in 32-column blocks (``MERGE_TILE_VALUES``; whole rows took 255 registers and
    spilled 88 bytes on sm_90)."""
    kernels = [r["kernel"] for r in compiled[label]]
    assert kernels == ["_decode_split_kernel", "_merge_splits_kernel"], compiled[label]
    assert all(r["stack"] == 0 for r in compiled[label]), compiled[label]
    assert compiled[label][1]["grid"] == [2, 8, 4], compiled[label][1]
