import pytest
import torch
from kernel_refs import CAUSAL, DRAFT, TREE, assert_close, make_paged_batch, ref_paged_attention

from attn_backends_kernels.attention_core import decode_workspace
from attn_backends_kernels.launch_record import Recorded, recording
from attn_backends_kernels.mla import wgmma as mla_wgmma
from attn_backends_kernels.mla.attention import _mla_split_kernel, mla_attention_fwd, mla_decode_fwd, tile_shape
from attn_backends_kernels.mla.prologue import (
    _mla_chunked_kernel,
    _mla_dbuf_kernel,
    _mla_seesaw_kernel,
    _mla_swap_kernel,
    _mla_wgmma_kernel,
)
from attn_backends_kernels.mla.warpspec import partial_dtype

LATENT, ROPE = 512, 64
# The Gluon kernels' GPU cases (64-row tiles): heads, rows per request, mask, tuning knobs.
GLUON_CASES = [
    (16, 4, CAUSAL, {}), (16, 8, TREE, {}), (16, 4, DRAFT, {}),
    (128, 1, CAUSAL, {}), (128, 4, TREE, {}),
    (16, 1, CAUSAL, {"block_h": 64}),      # 16 heads in a 64-row tile, 48 rows masked
    (80, 1, CAUSAL, {}),                   # 64-head tiles, the second one partly past H
    (16, 3, CAUSAL, {}),                   # 3 rows in a 4-row block
    (16, 6, TREE, {}),                     # a second row block partly past W
    (20, 4, DRAFT, {}),                    # 16-head blocks, the second one partly past H
]


def run_mla(seq_lens, W, page_size, H, dtype, device, mask=CAUSAL, splits=1, pad_rows=1,
            seed=0, poison_unused=False, part_dtype=None, **tuning):
    """(out, float64 reference); with splits, a NaN-filled workspace whose partials are
    ``part_dtype`` (None: the backend's, ``mla.warpspec.partial_dtype``)."""
    torch.manual_seed(seed)
    page_table, lens, num_pages = make_paged_batch(seq_lens, page_size, pad_rows=pad_rows,
                                                   pad_len=W, device=device, seed=seed)
    bs = lens.shape[0]
    kv = torch.randn(num_pages * page_size, 1, LATENT + ROPE, device=device).to(dtype)
    q = torch.randn(bs * W, H, LATENT + ROPE, device=device).to(dtype)
    if poison_unused:  # slots no request's positions reach (page tails) hold NaN
        used = torch.zeros(kv.shape[0], dtype=torch.bool, device=device)
        for i in range(bs):
            pos = torch.arange(int(lens[i]), device=device)
            used[page_table[i, pos // page_size].long() * page_size + pos % page_size] = True
        kv[~used] = float("nan")
    custom_mask = draft = None
    if mask == TREE:
        custom_mask = torch.rand(bs * W * W, device=device) < 0.5
        custom_mask.view(bs, W, W).diagonal(dim1=1, dim2=2).fill_(True)
    if mask == DRAFT:  # a draft prefix somewhere in each request, its branches interleaved after
        draft = (lens - W * torch.randint(1, 4, (bs,), device=lens.device)).clamp_min(0).to(torch.int32)
    out = torch.full((bs * W, H, LATENT), float("nan"), device=device, dtype=dtype)
    ws = None
    if splits > 1:
        block_w, block_h = tile_shape(W, H, tuning.get("block_w"), tuning.get("block_h"))
        ws = decode_workspace(bs * W, H, LATENT, splits, device,
                              part_dtype=part_dtype or partial_dtype(dtype, kv.device, page_size, block_w * block_h,
                                                                     LATENT, ROPE))
        ws[0].fill_(float("nan"))
        ws[1].fill_(float("nan"))
    scale = 0.1
    if W == 1 and mask == CAUSAL:
        mla_decode_fwd(q, kv, page_table, lens, page_size, scale, splits, out, workspace=ws,
                       **tuning)
    else:
        mla_attention_fwd(q, kv, page_table, lens, page_size, scale, splits, out, q_per_req=W,
                          mask=mask, custom_mask=custom_mask, workspace=ws,
                          draft_prefix_lens=draft, **tuning)
    cu = torch.arange(0, bs * W + 1, W, dtype=torch.int32)
    ref = ref_paged_attention(q, kv, kv[:, :, :LATENT], page_table, lens, cu, page_size, scale,
                              mask, custom_mask, draft)
    return out, ref


@pytest.mark.parametrize("page_size,seq_lens,H,splits", [
    (1, [9, 1], 16, 3),
    (16, [40, 17], 4, 1),
    (64, [130, 2], 16, 2),
    (16, [70, 3], 80, 2),       # >= 64 heads: 64-head tiles, the second one partly past H
])
def test_mla_decode_cpu(page_size, seq_lens, H, splits):
    out, ref = run_mla(seq_lens, 1, page_size, H, torch.float32, "cpu", splits=splits)
    assert_close(out, ref, 1e-5)


@pytest.mark.parametrize("mask", [CAUSAL, TREE])
@pytest.mark.parametrize("page_size,W,splits,block_w", [(1, 3, 2, 2), (16, 4, 1, 4)])
def test_mla_verify_cpu(mask, page_size, W, splits, block_w):
    out, ref = run_mla([W + 20, W], W, page_size, 16, torch.float32, "cpu", mask=mask,
                       splits=splits, pad_rows=1, block_w=block_w)
    assert_close(out, ref, 1e-5)


@pytest.mark.parametrize("part_dtype", [torch.float16, torch.float32])
def test_mla_partials_cpu(part_dtype):
    """float16 q and cache: the split partials in float16 (the wrapper's) or float32 (taken too)
    merge to the float64 reference within float16's tolerance; a workspace of another dtype is
    refused."""
    out, ref = run_mla([90, 4, 41], 4, 16, 16, torch.float16, "cpu", mask=TREE, splits=3,
                       part_dtype=part_dtype)
    assert_close(out, ref, 2e-3)
    with pytest.raises(ValueError, match="partials float32 or float16"):
        run_mla([9, 4], 4, 16, 16, torch.float16, "cpu", splits=2, part_dtype=torch.bfloat16)


def _own_workspace_launches(dtype, device, W, page_size, H=16):
    """The launches of a split wrapper call given no workspace: (kernel, grid, args, kwargs)."""
    page_table, lens, num_pages = make_paged_batch([40, W], page_size, device=device)
    kv = torch.randn(num_pages * page_size, 1, LATENT + ROPE, device=device).to(dtype)
    q = torch.randn(2 * W, H, LATENT + ROPE, device=device).to(dtype)
    out = torch.empty(2 * W, H, LATENT, dtype=dtype, device=device)
    with recording() as launches:
        mla_attention_fwd(q, kv, page_table, lens, page_size, 0.1, 2, out, q_per_req=W)
    return [(k, grid, args, kw) for k, _, grid, args, kw in launches]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_mla_own_workspace_partials_cpu(dtype):
    """Without a workspace the wrapper allocates float32 partials off sm_90 (where no
    warp-specialized kernel runs: ``mla.warpspec.partial_dtype``), and the merge reads them."""
    launches = _own_workspace_launches(dtype, "cpu", 4, 16)
    assert [k for k, *_ in launches] == [_mla_split_kernel, merge_kernel()]
    assert launches[1][2][0].dtype == torch.float32 and launches[1][2][0].shape == (8, 16, 2, LATENT)


@pytest.mark.cuda
@pytest.mark.parametrize("W,page_size,expect", [(4, 64, _mla_dbuf_kernel), (8, 64, _mla_chunked_kernel),
                                                (4, 32, _mla_seesaw_kernel), (4, 16, _mla_wgmma_kernel),
                                                (1, 64, _mla_swap_kernel)])
def test_mla_own_workspace_partials_gpu(W, page_size, expect):
    """On Hopper the wrapper's own partials are bfloat16 for the warp-specialized kernels (16-byte
    stores) and float32 for the others, as ``mla.warpspec.partial_dtype`` tells the backend."""
    _need_hopper()
    launches = _own_workspace_launches(torch.bfloat16, "cuda", W, page_size)
    assert launches[0][0] is expect and launches[1][0] is merge_kernel()
    part = launches[1][2][0]
    want = torch.bfloat16 if expect in (_mla_dbuf_kernel, _mla_chunked_kernel, _mla_seesaw_kernel) else torch.float32
    assert part.dtype == want
    block_w, block_h = tile_shape(W, 16)
    assert partial_dtype(torch.bfloat16, part.device, page_size, block_w * block_h, LATENT, ROPE) == want


@pytest.mark.cuda
@pytest.mark.parametrize("kernel,W,page_size", [("dbuf", 4, 64), ("chunked", 8, 64), ("seesaw", 4, 32),
                                                ("wgmma", 4, 64), ("swap", 1, 64), ("triton", 4, 64)])
def test_mla_float32_partials_gpu(kernel, W, page_size):
    """A bfloat16 launch given a float32 workspace (the backend gives the warp-specialized
    kernels bfloat16 partials, which the other GPU tests use): every kernel takes both."""
    _need_hopper()
    out, ref = run_mla([W, 33, 1000, 4166, 32768], W, page_size, 16, torch.bfloat16, "cuda", splits=8,
                       pad_rows=2, poison_unused=True, kernel=kernel, part_dtype=torch.float32)
    assert_close(out, ref, 1e-2)


@pytest.mark.cuda
# fp16 runs at page size 64 only (compile budget): the pairs are listed, not skipped
@pytest.mark.parametrize("dtype,page_size", [(torch.bfloat16, 1), (torch.bfloat16, 16), (torch.bfloat16, 64),
                                             (torch.float16, 64)])
@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("mask,W,block_w", [(CAUSAL, 1, None), (CAUSAL, 4, 2), (TREE, 8, None)])
def test_mla_gpu(dtype, H, page_size, mask, W, block_w):
    seq_lens = [W, 33, 1000, 4096, 32768]
    out, ref = run_mla(seq_lens, W, page_size, H, dtype, "cuda", mask=mask, splits=8,
                       pad_rows=2, block_w=block_w)
    assert_close(out, ref, 1e-2)


@pytest.mark.parametrize("mask,W,splits", [(CAUSAL, 1, 3), (TREE, 4, 2), (CAUSAL, 3, 1)])
def test_mla_in_page_tiles_cpu(mask, W, splits):
    # page 64 = 4 tiles of 16: in-page tiles (one page lookup each), a partial last tile and an
    # empty split; unused slots poisoned
    out, ref = run_mla([W + 70, W, 64 + W], W, 64, 16, torch.float32, "cpu", mask=mask,
                       splits=splits, pad_rows=1, block_n=16, poison_unused=True)
    assert_close(out, ref, 1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("mask,W,block_n,warps", [(CAUSAL, 1, 32, 4), (TREE, 4, 16, 4),
                                                  (CAUSAL, 4, 32, 8)])
def test_mla_in_page_tiles_gpu(mask, W, block_n, warps):
    out, ref = run_mla([W, 33, 1000, 4096, 32768], W, 64, 16, torch.bfloat16, "cuda", mask=mask,
                       splits=8, pad_rows=2, block_n=block_n, num_warps=warps, poison_unused=True)
    assert_close(out, ref, 1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,page_size", [(torch.bfloat16, 64), (torch.bfloat16, 1), (torch.float16, 16)])
@pytest.mark.parametrize("H,W,mask,tuning", GLUON_CASES)
@pytest.mark.parametrize("splits", [1, 8])
def test_mla_wgmma_gpu(dtype, page_size, H, W, mask, tuning, splits):
    """The Gluon wgmma kernel against the float64 reference: shuffled pages, ragged lengths (a
    request of W tokens, partial last tiles, empty splits), padded rows, unused slots poisoned
    with NaN, every mask, with and without the merge."""
    _need_hopper()
    out, ref = run_mla([W, 33, 1000, 4096, 32768], W, page_size, H, dtype, "cuda", mask=mask,
                       splits=splits, pad_rows=2, poison_unused=True, kernel="wgmma", **tuning)
    assert_close(out, ref, 1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel,dtype,page_size", [
    ("seesaw", torch.bfloat16, 64), ("seesaw", torch.float16, 128),
    ("seesaw", torch.bfloat16, 32),                                  # a tile per page
    ("chunked", torch.bfloat16, 64), ("chunked", torch.float16, 128),
    ("dbuf", torch.bfloat16, 64), ("dbuf", torch.float16, 128)])
@pytest.mark.parametrize("H,W,mask,tuning", GLUON_CASES)
@pytest.mark.parametrize("splits", [1, 8])
def test_mla_warp_specialized_gpu(kernel, dtype, page_size, H, W, mask, tuning, splits):
    """The warp-specialized Gluon kernels against the float64 reference, as the wgmma kernel's
    test: odd and even tile counts per split (the seesaw kernels: tile B absent on the last pass;
    the double-buffered one: each stage's barriers through several phases), empty splits,
    partial last tiles whose tails hold NaN, every mask, with and without the merge."""
    _need_hopper()
    out, ref = run_mla([W, 33, 1000, 4166, 32768], W, page_size, H, dtype, "cuda", mask=mask,
                       splits=splits, pad_rows=2, poison_unused=True, kernel=kernel, **tuning)
    assert_close(out, ref, 1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,page_size", [(torch.bfloat16, 64), (torch.float16, 128)])
@pytest.mark.parametrize("H", [16, 8, 20, 32])   # a block; 8 heads in it; a second one partly past H; two
@pytest.mark.parametrize("splits", [1, 8])
def test_mla_swap_gpu(dtype, page_size, H, splits):
    """The transposed decode kernel against the float64 reference: 16-head blocks (heads past H
    masked), shuffled pages, ragged lengths (a one-token request, partial last tiles whose tails
    hold NaN, empty splits), padded rows, with and without the merge."""
    _need_hopper()
    out, ref = run_mla([1, 33, 1000, 4166, 32768], 1, page_size, H, dtype, "cuda", splits=splits,
                       pad_rows=2, poison_unused=True, kernel="swap")
    assert_close(out, ref, 1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("H,W,page_size,splits,expect", [
    (16, 4, 64, 2, _mla_dbuf_kernel), (16, 4, 64, 1, _mla_dbuf_kernel), (16, 8, 64, 1, _mla_chunked_kernel),
    (128, 1, 128, 2, _mla_chunked_kernel), (64, 1, 64, 2, _mla_dbuf_kernel),
    (16, 4, 32, 2, _mla_seesaw_kernel), (128, 1, 96, 2, _mla_seesaw_kernel),
    (16, 4, 16, 2, _mla_wgmma_kernel), (128, 1, 16, 2, _mla_wgmma_kernel),
    (16, 1, 64, 2, _mla_swap_kernel), (32, 1, 128, 1, _mla_swap_kernel),
    (16, 1, 16, 2, _mla_split_kernel), (16, 2, 64, 2, _mla_split_kernel)])
def test_mla_default_kernel_gpu(H, W, page_size, splits, expect):
    """On Hopper the wrapper's default launches a Gluon kernel for 64-row tiles: where pages hold
    whole 64-token tiles the double-buffered kernel when one program reads each request's KV
    (split or not), the chunked kernel otherwise (W = 8: two row blocks); the seesaw kernel where they hold whole
    32-token tiles, the wgmma kernel elsewhere; and the transposed kernel for 16-head decode
    tiles where pages hold whole 64-token tiles (the Triton kernel at page 16, and for W = 2)."""
    _need_hopper()
    with recording() as launches:
        run_mla([W, 300], W, page_size, H, torch.bfloat16, "cuda", splits=splits)
    assert launches[0][0] is expect


def _need_hopper():
    if torch.cuda.get_device_capability()[0] != 9 or torch.version.hip is not None:
        pytest.skip("the wgmma kernel is Hopper's (sm_90)")


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["wgmma", "seesaw", "chunked", "dbuf", "swap"])
def test_mla_gluon_recorded_replay_gpu(kernel):
    """The eager path's recorded launches (launch_record) replay each Gluon kernel and its merge
    with another call's q, KV buffer and output: bitwise what the wrapper gives for that call
    (the swap kernel's on decode)."""
    _need_hopper()
    W, H, splits = (1 if kernel == "swap" else 4), 16, 8
    page_table, lens, num_pages = make_paged_batch([W, 700, 3000], 64, pad_rows=1, pad_len=W,
                                                   device="cuda")
    bs = lens.shape[0]
    kv = [torch.randn(num_pages * 64, 1, 576, device="cuda").bfloat16() for _ in range(2)]
    q = [torch.randn(bs * W, H, 576, device="cuda").bfloat16() for _ in range(2)]
    out = [torch.empty(bs * W, H, LATENT, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    ws = decode_workspace(bs * W, H, LATENT, splits, "cuda")
    call = lambda i, o: mla_attention_fwd(q[i], kv[i], page_table, lens, 64, 0.1, splits, o,  # noqa: E731
                                          q_per_req=W, workspace=ws, kernel=kernel)
    with recording() as launches:
        call(0, out[0])
    gluon = {"wgmma": _mla_wgmma_kernel, "seesaw": _mla_seesaw_kernel,
             "chunked": _mla_chunked_kernel, "dbuf": _mla_dbuf_kernel, "swap": _mla_swap_kernel}[kernel]
    assert [k for k, *_ in launches] == [gluon, merge_kernel()]
    rec = Recorded(launches, (q[0], kv[0], out[0]))
    assert rec.usable and rec.replay((q[1], kv[1], out[1]))
    call(1, out[2])
    assert torch.equal(out[1], out[2]) and not torch.equal(out[0], out[1])


def merge_kernel():
    from attn_backends_kernels.attention_core import _merge_splits_kernel
    return _merge_splits_kernel


def test_mla_kernel_choice_errors():
    """Asking for the wgmma kernel where it cannot run, or for an unknown kernel (even with no
    rows), is an error."""
    with pytest.raises(ValueError, match="wgmma kernel needs float16/bfloat16"):
        run_mla([8, 4], 4, 16, 16, torch.float32, "cpu", kernel="wgmma")
    with pytest.raises(ValueError, match="wgmma kernel needs an sm_90"):
        run_mla([8, 4], 4, 16, 16, torch.float16, "cpu", kernel="wgmma")
    with pytest.raises(ValueError, match="seesaw kernel needs an sm_90"):
        run_mla([8, 4], 4, 64, 16, torch.bfloat16, "cpu", kernel="seesaw")
    with pytest.raises(ValueError, match="chunked kernel needs an sm_90"):
        run_mla([8, 4], 4, 64, 16, torch.bfloat16, "cpu", kernel="chunked")
    with pytest.raises(ValueError, match="dbuf kernel needs an sm_90"):
        run_mla([8, 4], 4, 64, 16, torch.bfloat16, "cpu", kernel="dbuf")
    with pytest.raises(ValueError, match="swap kernel needs an sm_90"):
        run_mla([8, 4], 1, 64, 16, torch.bfloat16, "cpu", kernel="swap")
    with pytest.raises(ValueError, match="kernel="):
        run_mla([8, 4], 4, 16, 16, torch.float32, "cpu", kernel="cutlass")
    empty = torch.zeros(0, 16, 576)
    with pytest.raises(ValueError, match="kernel="):
        mla_attention_fwd(empty, torch.zeros(64, 1, 576), torch.zeros(0, 1, dtype=torch.int32),
                          torch.zeros(0, dtype=torch.int32), 64, 0.1, 1, torch.zeros(0, 16, 512),
                          q_per_req=4, kernel="cutlass")


def test_warp_specialized_kernel_choice(monkeypatch):
    """On a stand-in sm_90 device each warp-specialized kernel is refused, with its reason, for
    pages that do not hold whole tiles (32 tokens: seesaw, 64: chunked and dbuf) and for launch
    knobs (its launch is its own); ``kernel=None`` takes the first of ``HOPPER_DEFAULTS`` that
    serves (of ``STREAMING_DEFAULTS`` for a streaming launch: one program a request's KV), and
    the wgmma kernel with the wgmma kernel's knobs."""
    from attn_backends_kernels.mla import attention as mla
    monkeypatch.setattr(mla_wgmma, "on_hopper", lambda t: True)
    q, kv = torch.zeros(8, 16, 576, dtype=torch.bfloat16), torch.zeros(64, 1, 576, dtype=torch.bfloat16)
    verify4 = dict(width=4, mask="causal", block_w=4)
    pick = lambda kernel, page, knobs=(None, None, None): mla._pick_kernel(  # noqa: E731
        "f", kernel, q, kv, 512, 64, 64, *knobs, False, page, **verify4)
    with pytest.raises(ValueError, match="seesaw kernel needs pages of a multiple of 32"):
        pick("seesaw", 16)
    with pytest.raises(ValueError, match="seesaw kernel runs 32-token tiles in 4 stages"):
        pick("seesaw", 64, (64, None, None))
    assert pick("seesaw", 128) == "seesaw" and pick("wgmma", 16) == "wgmma"
    with pytest.raises(ValueError, match="chunked kernel needs pages of a multiple of 64"):
        pick("chunked", 32)
    for knobs in ((None, 8, None), (32, None, None)):   # (32, ...): refused by the wgmma kernel too
        with pytest.raises(ValueError, match="chunked kernel runs 64-token tiles in 2 stages"):
            pick("chunked", 64, knobs)
    assert pick("chunked", 128) == "chunked"
    with pytest.raises(ValueError, match="dbuf kernel needs pages of a multiple of 64"):
        pick("dbuf", 32)
    with pytest.raises(ValueError, match="dbuf kernel runs 64-token tiles in 2 stages"):
        pick("dbuf", 64, (None, 8, None))
    assert pick("dbuf", 128) == "dbuf"
    swap = lambda page, rows=16, width=1, mask="causal", knobs=(None, None, None), block_w=1: (  # noqa: E731
        mla._pick_kernel("f", "swap", q, kv, 512, 64, rows, *knobs, False, page, width=width, mask=mask,
                         block_w=block_w))
    assert swap(64) == "swap" and swap(128) == "swap"
    default16 = lambda page, width=1, block_w=1: mla._pick_kernel(  # noqa: E731
        "f", None, q, kv, 512, 64, 16, None, None, None, False, page, width=width, mask="causal", block_w=block_w)
    assert default16(64) == "swap" and default16(16) == "triton" and default16(64, 2) == "triton"
    assert default16(64, 2, 2) == "triton"     # 16 rows as 2 query rows x 8 heads: not a 16-head tile
    for args, reason in [((32,), "pages of a multiple of 64"), ((64, 64, 1, "causal", (None,) * 3, 4), "16-head tiles"),
                         ((64, 16, 1, "causal", (None,) * 3, 2), "16-head tiles"),
                         ((64, 16, 4), "decode only"), ((64, 16, 1, "tree"), "decode only"),
                         ((64, 16, 1, "causal", (None, 8, None)), "no knobs")]:
        with pytest.raises(ValueError, match=f"swap kernel .*{reason}"):
            swap(*args)
    assert pick(None, 64) == "chunked" and pick(None, 96) == "seesaw" and pick(None, 16) == "wgmma"
    streaming = lambda page: mla._pick_kernel("f", None, q, kv, 512, 64, 64, None, None, None,  # noqa: E731
                                              False, page, streaming=True, **verify4)
    assert streaming(64) == "dbuf" and streaming(96) == "seesaw" and streaming(16) == "wgmma"
    for default in ("seesaw", "chunked", "dbuf"):
        monkeypatch.setattr(mla, "HOPPER_DEFAULTS", (default,))
        monkeypatch.setattr(mla, "STREAMING_DEFAULTS", (default,))
        assert pick(None, 64) == default and pick(None, 16) == "wgmma"
        assert streaming(64) == default and streaming(16) == "wgmma"
        assert pick(None, 64, (64, 8, 2)) == "wgmma"   # the wgmma kernel's knobs pick it
    assert mla._pick_kernel("f", None, q.float(), kv.float(), 512, 64, 64, None, None, None,
                            False, 64, **verify4) == "triton"


@pytest.mark.parametrize("change,reason", [
    ({}, None),
    ({"dtype": torch.float32}, "float16/bfloat16"),
    ({"latent": 256}, "512 + 64"),
    ({"rows": 32}, "64-row tiles"),
    ({"block_n": 32}, "64-token tiles"),
    ({"num_warps": 4}, "64-token tiles"),
    ({"num_stages": 3}, "64-token tiles"),
    ({"ragged": True}, "uniform rows"),
    ({"q_stride": 580}, "strides in multiples of 16"),
    ({"kv_stride": 577}, "strides in multiples of 16"),
    ({"q_offset": 1}, "16-byte aligned"),
])
def test_wgmma_refusal_names_each_condition(monkeypatch, change, reason):
    """Each condition of the wgmma kernel alone refuses it, with its reason; a launch that meets
    all of them (on a stand-in sm_90 device) is taken."""
    monkeypatch.setattr(mla_wgmma, "on_hopper", lambda t: True)
    dt = change.get("dtype", torch.bfloat16)
    qs = change.get("q_stride", 576)
    q = torch.zeros(8 * 16 * qs + 8, dtype=dt)[change.get("q_offset", 0):][:8 * 16 * qs]
    q = q.view(8, 16, qs)[..., :576]
    kvs = change.get("kv_stride", 576)
    kv = torch.zeros(64 * kvs, dtype=dt).view(64, 1, kvs)[..., :576]
    got = mla_wgmma.wgmma_refusal(q, kv, change.get("latent", 512), 64, change.get("rows", 64),
                                  change.get("block_n"), change.get("num_warps"),
                                  change.get("num_stages"), change.get("ragged", False))
    assert (got is None) if reason is None else (reason in got), got
