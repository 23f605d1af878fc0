"""The merge pass fused into the split pass (``merge_if_last``): the GQA decode and extend kernels
merge a tile's split partials in the split program that finishes last, where they are small
(``fuse_merge``), and launch ``merge_splits`` otherwise. Both paths against the float64
reference; the tile counters left at zero by every launch (a second call over other data still
right), stale counters caught, a workspace without counters refused; on the GPU, hundreds of
graph replays bitwise equal (the counter's release / acquire order). The reference and replay
tests run in both grid orders (``heads_first``: a tile's counter index is its request, query
block and KV head whichever axis is fastest); the rule that picks the order, and its bound on the
grid's y and z extents."""
import pytest
import torch
from kernel_refs import CAUSAL, TREE, assert_close, make_paged_batch, ref_paged_attention

from attn_backends_kernels import attention_core, decode_attention, extend_attention
from attn_backends_kernels.attention_core import decode_workspace, fuse_merge, heads_first_grid, merge_chunk
from attn_backends_kernels.decode_attention import decode_attention_fwd
from attn_backends_kernels.extend_attention import extend_attention_fwd
from attn_backends_kernels.launch_record import recording


class Case:
    """A decode (W = 1) or verify batch over shuffled pages, NaN in the output and partials."""

    def __init__(self, W, splits, device, dtype=torch.float32, H=8, Hkv=2, D=16, page_size=16,
                 seq_lens=(70, 3, 129), mask=CAUSAL, seed=0, fuse=None):
        g = torch.Generator().manual_seed(seed)
        self.W, self.splits, self.mask, self.page_size, self.fuse = W, splits, mask, page_size, fuse
        self.pt, self.lens, pages = make_paged_batch([max(s, W) for s in seq_lens], page_size, pad_rows=1,
                                                     pad_len=W, device=device, seed=seed)
        bs = self.lens.shape[0]
        self.T = bs * W
        rnd = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
        self.k, self.v = rnd(pages * page_size, Hkv, D), rnd(pages * page_size, Hkv, D)
        self.qs = [rnd(self.T, H, D) for _ in range(2)]
        self.cu = torch.arange(0, self.T + 1, W, dtype=torch.int32, device=device)
        self.custom = None
        if mask == TREE:
            self.custom = torch.rand(bs * W * W, generator=g).to(device) < 0.5
            self.custom.view(bs, W, W).diagonal(dim1=1, dim2=2).fill_(True)
        self.ws = decode_workspace(self.T, H, D, splits, device)
        self.ws[0].fill_(float("nan"))
        self.ws[1].fill_(float("nan"))

    def run(self, q, ws="own"):
        ws = self.ws if ws == "own" else ws
        out = torch.full_like(q, float("nan"))
        scale = q.shape[-1] ** -0.5
        if self.W == 1:
            decode_attention_fwd(q, self.k, self.v, self.pt, self.lens, self.page_size, scale, self.splits,
                                 out, ws)
        else:
            extend_attention_fwd(q, self.k, self.v, self.pt, self.lens, self.cu, self.page_size, scale, self.W,
                                 out, mask=self.mask, custom_mask=self.custom, num_kv_splits=self.splits,
                                 workspace=ws, fuse=self.fuse)
        return out

    def ref(self, q):
        return ref_paged_attention(q, self.k, self.v, self.pt, self.lens, self.cu, self.page_size,
                                   q.shape[-1] ** -0.5, self.mask, self.custom)


def _grid_order(monkeypatch, order: str) -> None:
    """Batch or KV heads on the fastest grid axis, whatever the batch and query blocks (the rule's
    bound on the grid kept)."""
    for mod in (decode_attention, extend_attention):
        monkeypatch.setattr(mod, "heads_first_grid",
                            lambda name, _, *a: heads_first_grid(name, order == "heads", *a))


def _run_in_order(c, q, order):
    """``c.run(q)``, asserting the split pass ran on the grid ``order`` asks for."""
    with recording() as launches:
        out = c.run(q)
    _, _, grid, _, consts = launches[0]
    heads = order == "heads"
    axes = (0, 1) if c.W == 1 else ((0, 2) if heads else (1, 2))     # where the KV heads and requests are
    want = (c.k.shape[1], c.lens.shape[0]) if heads else (c.lens.shape[0], c.k.shape[1])   # (Hkv, bs)
    assert consts["HEADS_FIRST"] == heads and tuple(grid[i] for i in axes) == want, (grid, order)
    if c.W == 40:                                   # three 16-row query blocks x the splits
        assert grid[1 if heads else 0] == 3 * c.splits, grid
    return out


def _separate_merges(monkeypatch) -> list:
    """Count the separate merge launches of the decode and extend wrappers."""
    seen = []
    for mod in (decode_attention, extend_attention):
        real = mod.merge_splits
        monkeypatch.setattr(mod, "merge_splits", lambda *a, real=real: (seen.append(1), real(*a))[1])
    return seen


@pytest.mark.parametrize("order", ["batch", "heads"])
@pytest.mark.parametrize("path", ["fused", "separate"])
@pytest.mark.parametrize("W,mask,splits,H,D", [(1, CAUSAL, 3, 8, 16), (1, CAUSAL, 8, 8, 16), (4, CAUSAL, 4, 8, 16),
                                               (3, TREE, 2, 8, 16),
                                               (1, CAUSAL, 4, 2, 16), (4, CAUSAL, 2, 4, 16),   # GQA groups 4, 1, 2
                                               (40, CAUSAL, 2, 8, 16),    # three 16-row query blocks
                                               (8, TREE, 2, 16, 64),      # 64 rows: two 32-column chunks
                                               (4, CAUSAL, 3, 32, 48),    # 64 rows, Dv 48: 32 + 16 of 32
                                               (1, CAUSAL, 4, 128, 16)])  # decode of 64-head groups
def test_both_merge_paths_match_the_reference_and_leave_the_counters_zero(monkeypatch, order, path, W, mask,
                                                                         splits, H, D):
    _grid_order(monkeypatch, order)
    if path == "separate":
        monkeypatch.setattr(attention_core, "FUSED_MERGE_BYTES", 0)
    seen = _separate_merges(monkeypatch)
    c = Case(W, splits, "cpu", mask=mask, H=H, D=D)
    for q in c.qs:                          # the second call reads counters the first left behind
        assert_close(_run_in_order(c, q, order), c.ref(q), 1e-5)
    assert len(seen) == (0 if path == "fused" else 2), seen
    assert not c.ws[2].any(), "a launch left a tile counter nonzero"


def test_a_stale_counter_is_caught():
    """Counters not back at zero (a launch that did not reset them) make the merge fire early or
    never: the output is wrong, and this is what the test above would see."""
    c = Case(1, 4, "cpu")
    c.ws[2][1] = 1
    out = c.run(c.qs[0])
    assert not torch.allclose(out.nan_to_num(1e9).double(), c.ref(c.qs[0]), atol=1e-3)


def test_the_fused_merge_takes_the_workspace_counters(monkeypatch):
    """A workspace of (part, lse) alone runs the separate merge; counters fewer than the tiles
    are refused; without a workspace the wrapper allocates counters and fuses."""
    seen = _separate_merges(monkeypatch)
    c = Case(4, 4, "cpu")
    ref = c.ref(c.qs[0])
    assert_close(c.run(c.qs[0], ws=c.ws[:2]), ref, 1e-5)
    assert len(seen) == 1, "a (part, lse) workspace did not take the separate merge"
    with pytest.raises(ValueError, match="counters"):
        c.run(c.qs[0], ws=(*c.ws[:2], c.ws[2][:3]))     # fewer than the tiles (bs * Hkv = 8)
    assert_close(c.run(c.qs[0], ws=None), ref, 1e-5)     # allocated by the wrapper
    assert len(seen) == 1


def test_the_grid_order_rule_and_its_bound():
    """Heads first from 64 requests on for one query block a request (faster there: bench/RESULTS.md,
    'Grid order'), where CUDA's 65535 on grid axes y and z allows; an order asked for, or the only one
    left, past it is a ValueError. Grids: (x, y, z) of the heads-first grid, then of the batch-first
    one."""
    def rule(heads_first, bs, blocks, heads_grid, batch_grid=(1, 8, 1)):
        order, grid = heads_first_grid("k", heads_first, bs, blocks, heads_grid, batch_grid)
        assert grid == (heads_grid if order else batch_grid)
        return order

    assert rule(None, 64, 1, (8, 64, 2)) and not rule(None, 63, 1, (8, 63, 2))
    assert not rule(None, 64, 3, (8, 6, 64))                      # prefill: query blocks
    assert rule(None, 65535, 1, (8, 65535, 2)) and not rule(None, 65536, 1, (8, 65536, 2))   # the bound
    assert not rule(None, 64, 1, (8, 2, 65536))                   # z past it
    assert rule(None, 64, 1, (1 << 20, 64, 2))                    # x is not bounded there
    assert rule(True, 2, 4, (8, 8, 2)) and not rule(False, 128, 1, (8, 128, 1))
    with pytest.raises(ValueError, match="65535"):
        rule(True, 64, 4096, (1, 4096 * 32, 64))                  # 128K rows / 32 a block x 32 splits
    with pytest.raises(ValueError, match="batch-first"):
        rule(None, 1 << 16, 1, (8, 1, 1 << 16), (1, 1 << 16, 8))  # neither order fits


def test_the_rule_bounds_what_one_program_reads_and_holds():
    assert fuse_merge(4, 64, 128, 4) and not fuse_merge(4, 1, 128, 4)          # decode bs 1; no splits
    assert not fuse_merge(16, 64, 128, 4) and fuse_merge(16, 16, 128, 4)       # 512 KiB, 128 KiB of partials
    assert not fuse_merge(16, 16, 128, 4, share=0.5) and fuse_merge(16, 8, 128, 4, share=0.5)   # extend
    assert not fuse_merge(16, 2, 128, 2) and fuse_merge(64, 2, 16, 4)          # the first bound: 16 values a thread
    # Past it: 32-row tiles never (slower fused: bench/RESULTS.md, 'Fused merge'); 64-row tiles of one query
    # block a request up to 128 KiB with >= 8 programs an SM
    assert not fuse_merge(32, 2, 128, 4, share=0.5, one_block=True, programs=1 << 20, sms=132)
    assert fuse_merge(64, 4, 128, 4, share=0.5, one_block=True, programs=2048, sms=132)     # tree8 bs 64
    assert not fuse_merge(64, 4, 128, 4, share=0.5, one_block=True, programs=512, sms=132)  # bs 16: 3.9 an SM
    assert not fuse_merge(64, 4, 128, 4, share=0.5, programs=2048, sms=132)    # prefill, decode: the first bound
    assert not fuse_merge(64, 8, 128, 4, one_block=True, programs=1 << 20, sms=132)         # 256 KiB
    assert fuse_merge(64, 2, 128, 4, one_block=True)                           # no SMs (the interpreter): met
    ws = decode_workspace(4, 4, 128, 64, "cpu")
    assert fuse_merge(4, 64, 128, 4, ws) and not fuse_merge(4, 64, 128, 4, ws[:2])  # (part, lse): separate
    assert len(decode_workspace(4, 4, 128, 64, "cpu", num_counters=0)) == 2
    # Columns a step: at most 16 float32 sums a thread, at least 16 columns, at most the tile's.
    assert merge_chunk(4, 128, 4) == 128 and merge_chunk(16, 128, 4) == 128 and merge_chunk(32, 128, 4) == 64
    assert merge_chunk(64, 128, 4) == 32 and merge_chunk(32, 128, 2) == 32 and merge_chunk(64, 64, 1) == 16
    assert merge_chunk(8, 32, 4) == 32


@pytest.mark.parametrize("H", [16, 8])      # 64-row tiles (two 32-column chunks), 32-row (one of 64)
def test_the_extend_fuse_knob(monkeypatch, H):
    """``fuse`` forces either merge: False the separate one where the rule fuses (the 64-row
    tile; no SMs on the CPU), True the fused one where the rule does not (the 32-row tile, and
    both with FUSED_MERGE_BYTES at 0); True with a (part, lse) workspace is refused (no counters)."""
    seen = _separate_merges(monkeypatch)
    c = Case(8, 2, "cpu", mask=TREE, H=H, D=64)
    ref = c.ref(c.qs[0])

    def run(ws="own", **kw):
        out = torch.full_like(c.qs[0], float("nan"))
        extend_attention_fwd(c.qs[0], c.k, c.v, c.pt, c.lens, c.cu, c.page_size, 0.125, c.W, out, mask=TREE,
                             custom_mask=c.custom, num_kv_splits=c.splits,
                             workspace=c.ws if ws == "own" else ws, **kw)
        return out
    assert_close(run(fuse=False), ref, 1e-5)
    assert len(seen) == 1, "fuse=False did not take the separate merge"
    monkeypatch.setattr(attention_core, "FUSED_MERGE_BYTES", 0)
    assert_close(run(fuse=True), ref, 1e-5)
    assert len(seen) == 1 and not c.ws[2].any(), "fuse=True did not merge in the split pass"
    with pytest.raises(ValueError, match="counters"):
        run(ws=c.ws[:2], fuse=True)


@pytest.mark.parametrize("sms,fused", [(1, True), (2, False)])
def test_the_extend_wrapper_counts_programs_an_sm(monkeypatch, sms, fused):
    """The 64-row tile of one query block a request fuses from 8 programs an SM: 4 requests x 1
    KV head x 2 splits = 8 programs, met on 1 SM and not on 2 (the device's SMs patched in)."""
    monkeypatch.setattr(extend_attention, "device_sms", lambda device: sms)
    seen = _separate_merges(monkeypatch)
    c = Case(8, 2, "cpu", mask=TREE, H=8, Hkv=1, D=64)      # group 8 x 8 rows
    assert c.lens.shape[0] == 4
    with recording() as launches:
        out = c.run(c.qs[0])
    assert launches[0][4]["FUSED"] == fused and len(seen) == (0 if fused else 1), (launches[0][4]["FUSED"], seen)
    assert_close(out, c.ref(c.qs[0]), 1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("order", ["batch", "heads"])
@pytest.mark.parametrize("W,splits,group", [(1, 64, 4), (1, 8, 8), (1, 32, 8), (1, 16, 1), (1, 6, 4), (1, 3, 8),
                                             (4, 8, 4), (4, 4, 2),
                                             (4, 4, 8), (8, 4, 4), (8, 2, 8)])   # 32- and 64-row tiles, in chunks
def test_graph_replays_are_bitwise_stable(monkeypatch, order, W, splits, group):
    """Hundreds of replays of one captured launch, q alternating between two tensors and the
    partials set to NaN inside the graph before the kernel: a partial read before its writer's
    release (or a counter reset lost) would show as a replay that differs from the eager call.
    Tiles of more than 16 rows are fused by the ``fuse`` knob (the rule fuses them on larger grids
    only)."""
    _grid_order(monkeypatch, order)
    seen = _separate_merges(monkeypatch)
    c = Case(W, splits, "cuda", dtype=torch.bfloat16, H=8 * group, Hkv=8, D=128,
             seq_lens=(4096, 33, 8000, 700), fuse=True if W * group > 16 else None)
    eager = [_run_in_order(c, q, order) for q in c.qs]
    assert not seen, "the fused path was not taken"
    for q, e in zip(c.qs, eager):
        assert_close(e, c.ref(q), 1e-2)
    q_static, out = c.qs[0].clone(), torch.empty_like(eager[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c.ws[0].fill_(float("nan"))
        c.ws[1].fill_(float("nan"))
        out.copy_(c.run(q_static))
    same = []
    for i in range(300):
        q_static.copy_(c.qs[i % 2])
        graph.replay()
        same.append(torch.equal(out, eager[i % 2]))
    torch.cuda.synchronize()
    assert all(same), f"{same.count(False)} of 300 replays differ from the eager call"
    assert not c.ws[2].any()
