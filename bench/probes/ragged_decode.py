"""GQA decode on ragged batches at the kernel level: equal splits against the chunk schedule
(``kernels/schedule.py``) at several chunk budgets, beside FlashInfer's decode (CUDA cores and
tensor cores) on the same pages, and beside a uniform batch of the same total KV tokens (issue
#40's balance line). A tuning probe: the sweep (bench/sweep/) holds the reported figures.

    python bench/probes/ragged_decode.py [--rows 28/4x128:24,32/8x64:24] [--dists ragged,longtail,uniform]
    python bench/probes/ragged_decode.py --kv-dtypes bf16,fp8 --mults 1 --merges pass   # FP8 KV against bf16

Every time is a CUDA-graph replay (``triton.testing.do_bench``: L2 cleared before each run), bf16,
page 16, shuffled pages. ``S``: the split count the ``triton`` backend takes for the row's
(bs, W) at the cap of 64 (``WIDE_MAX_KV_SPLITS``; its decode of at most 8 programs goes to 256,
``DEEP_MAX_KV_SPLITS``: ``--split-mults 2,4``); chunk budgets are ``bs * S * m`` for ``m`` in
``--mults``; ``--merges``: a request's chunks merged by its last chunk program ("last") or by a
second launch ("pass", shown as such). ``x`` = FlashInfer's best / ours.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import random
from unittest import mock

import torch
import triton

import attn_backends_kernels.attention_core as core
import attn_backends_kernels.chunk_kernels as chunk_kernels
import attn_backends_kernels.decode_attention as decode
import attn_backends_kernels.pdl as dependent
from attn_backends.backends.triton_common import choose_num_kv_splits
from attn_backends.check.suite import fp8_scales
from attn_backends.kv_cache import to_cache
from attn_backends_kernels.attention_core import decode_workspace
from attn_backends_kernels.decode_attention import decode_attention_fwd
from attn_backends_kernels.schedule import chunk_workspace, slots_per_request

PAGE = 16
ORDER = {True: "heads", False: "batch"}       # --orders: the grid's fastest axis


def lengths(dist: str, bs: int, seed: int = 0, kv: int = 16384) -> list:
    rng = random.Random(seed)
    if dist == "uniform":
        return [kv] * bs
    if dist == "ragged":
        return [rng.randint(256, 16384) for _ in range(bs)]
    if dist == "longtail":
        lens = [rng.randint(256, 2048) for _ in range(bs)]
        for i in rng.sample(range(bs), 2 if bs >= 32 else 1):
            lens[i] = 32768
        return lens
    if dist == "bimodal":
        lens = [rng.randint(256, 1024) for _ in range(bs // 2)]
        lens += [rng.randint(8192, 16384) for _ in range(bs - bs // 2)]
        rng.shuffle(lens)
        return lens
    raise ValueError(f"--dists: {dist!r} not in uniform, ragged, longtail, bimodal")


def paged(lens: list, Hkv: int, D: int, gen):
    counts = [-(-n // PAGE) for n in lens]
    num_pages = 1 + sum(counts)
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).int()
    table = torch.zeros(len(lens), max(counts), dtype=torch.int32)
    indptr = [0]
    for i, c in enumerate(counts):
        table[i, :c] = perm[indptr[-1]:indptr[-1] + c]
        indptr.append(indptr[-1] + c)
    last = [n - (c - 1) * PAGE for n, c in zip(lens, counts)]
    dev = dict(device="cuda", dtype=torch.int32)
    return dict(table=table.cuda(), lens=torch.tensor(lens, **dev), indptr=torch.tensor(indptr, **dev),
                indices=perm.cuda(), last=torch.tensor(last, **dev), num_pages=num_pages)


def captured(fn) -> tuple:
    """``fn`` captured in a CUDA graph (after one eager call) and its replay's median time, us."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g, triton.testing.do_bench(g.replay, warmup=20, rep=200, return_mode="median") * 1e3


@contextlib.contextmanager
def knobs(min_tokens=None, pass_form=None, pdl=None):
    """Decode chunks' floor (``DECODE_MIN_CHUNK_TOKENS``) and the merge pass's form (``chunk_kernels.MERGE_PASS_*``)
    for the launches inside (read at each launch; None: as they are): "fN" requests of at most N chunks merged by
    their last chunk program (``DECODE_FEW_LAST``), "C" chunks a load over 128 columns at every
    budget (the deep tiles off), "nopf" the sum's walk without its next load in flight (``MERGE_PASS_PREFETCH``
    off), or "wCdD" every wide budget (``MERGE_PASS_WIDE_FROM`` on) C chunks over D columns a program
    (``MERGE_PASS_DEEP_*``); ``pdl``: the merge pass a dependent launch
    ("off"; "exit": allowed as the chunk programs exit; "start": from their start; ``pdl.py``)."""
    dv, cv, pv = {}, {}, {}         # decode_attention's, chunk_kernels' and pdl's values inside
    if min_tokens is not None:
        dv["DECODE_MIN_CHUNK_TOKENS"] = min_tokens
    if pass_form == "nopf":
        cv["MERGE_PASS_PREFETCH"] = False
    elif pass_form is not None and pass_form.startswith("f"):     # "f8": DECODE_FEW_LAST 8
        dv["DECODE_FEW_LAST"] = int(pass_form[1:])
    elif pass_form is not None and pass_form.startswith("w"):
        c, d = pass_form[1:].split("d")
        cv.update(MERGE_PASS_DEEP_FROM=chunk_kernels.MERGE_PASS_WIDE_FROM, MERGE_PASS_DEEP_CHUNKS=int(c),
                  MERGE_PASS_DEEP_DV=int(d))
    elif pass_form is not None:
        c = int(pass_form)
        cv.update(MERGE_PASS_CHUNKS=c, MERGE_PASS_WIDE_CHUNKS=c, MERGE_PASS_DEEP_FROM=1 << 30)
    if pdl is not None:
        pv["MERGE_PASS_PDL"], pv["CHUNK_PDL_TRIGGER"] = {"off": (False, False), "exit": (True, False),
                                                       "start": (True, True)}[pdl]
    with contextlib.ExitStack() as stack:
        for module, values in ((decode, dv), (chunk_kernels, cv), (dependent, pv)):
            if values:
                stack.enter_context(mock.patch.multiple(module, **values))
        yield


def graph_us(fn) -> float:
    return captured(fn)[1]


def ours(pg, q, kb, vb, S: int, schedule: str, block_n=None, merge: str = "last", scales=(1.0, 1.0),
         heads_first=None, maxnreg=None, launch=None, fit=False):
    bs, H, D = q.shape
    stages, warps = (2, 4) if launch is None else map(int, launch[1:].split("w"))   # "s3w8": stages 3, warps 8
    out = torch.empty_like(q)
    per_request = slots_per_request(schedule, S, pg["table"].shape[1] * PAGE)
    ws = (chunk_workspace(bs, per_request, 1, H, kb.shape[1], D, "cuda") if schedule != "split"
          else decode_workspace(bs, H, D, S, "cuda") if S > 1 else None)
    return out, lambda: decode_attention_fwd(q, kb, vb, pg["table"], pg["lens"], PAGE, D ** -0.5, S, out, ws,
                                             schedule=schedule, block_n=block_n,
                                             merge=merge if schedule != "split" else "last",
                                             k_scale=scales[0], v_scale=scales[1], heads_first=heads_first,
                                             num_stages=stages, num_warps=warps,
                                             **({} if schedule == "split" else dict(maxnreg=maxnreg, fit=fit)))


def flashinfer_calls(pg, q, kb, vb, fi, ws, scales=(1.0, 1.0)):
    bs, H, D = q.shape
    Hkv = kb.shape[1]
    calls = {}
    for tc in (False, True):
        if not tc and (H // Hkv) not in (1, 2, 3, 4, 8):      # FlashInfer's CUDA-core decode groups
            continue
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
                                                  paged_kv_indptr_buffer=pg["indptr"].clone(),
                                                  paged_kv_indices_buffer=pg["indices"].clone(),
                                                  paged_kv_last_page_len_buffer=pg["last"].clone())
        w.plan(pg["indptr"], pg["indices"], pg["last"], H, Hkv, D, PAGE, data_type=kb.dtype, q_data_type=q.dtype)
        out = torch.empty_like(q)
        cache = (kb.view(-1, PAGE, Hkv, D), vb.view(-1, PAGE, Hkv, D))
        calls["fi_tc" if tc else "fi"] = (out, lambda w=w, out=out, cache=cache: w.run(
            q, cache, out=out, k_scale=scales[0], v_scale=scales[1]))
    return calls


def kv_pair(num_slots: int, Hkv: int, D: int, kv_dtype):
    """Random K and V as a cache of ``kv_dtype`` holds them, with the scales they were stored with."""
    kb, vb = (torch.randn(num_slots, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if kv_dtype == torch.bfloat16:
        return kb, vb, (1.0, 1.0)
    scales = fp8_scales(mla=False)
    return to_cache(kb, kv_dtype, scales[0]), to_cache(vb, kv_dtype, scales[1]), scales


def row(H: int, Hkv: int, D: int, bs: int, dist: str, mults, fi, fi_ws, block_ns=(None,), merges=("last",),
        kv_dtype=torch.bfloat16, orders=(None,), maxnregs=(None,), kv: int = 16384, min_tokens=(None,),
        pass_forms=(None,), split_mults=(1,), merge_tiles=(None,), launches=(None,), fits=(0,), pdls=(None,)) -> dict:
    gen = torch.Generator().manual_seed(bs)
    lens = lengths(dist, bs, kv=kv)
    pg = paged(lens, Hkv, D, gen)
    kb, vb, sc = kv_pair(pg["num_pages"] * PAGE, Hkv, D, kv_dtype)
    q = torch.randn(bs, H, D, device="cuda", dtype=torch.bfloat16)
    S = choose_num_kv_splits(bs * Hkv, torch.device("cuda"), max(lens) // PAGE + 1, 6, 1, 2, None, 1, 8)
    res = {"row": f"{H}/{Hkv} d{D} bs{bs} {dist} {str(kv_dtype)[6:]}", "S": S, "tokens": sum(lens),
           "bytes": sum(lens) * Hkv * D * 2 * kb.element_size()}
    out0, split = ours(pg, q, kb, vb, S, "split", scales=sc)
    res["split"] = graph_us(split)
    for sm, mt in ((m, t) for m in split_mults for t in merge_tiles if (m, t) != (1, None)):
        # more splits than the rule's (its cap: WIDE_MAX_KV_SPLITS), merged at a tile bound (MERGE_TILE_VALUES)
        out, fn = ours(pg, q, kb, vb, S * sm, "split", scales=sc)
        saved, core.MERGE_TILE_VALUES = core.MERGE_TILE_VALUES, core.MERGE_TILE_VALUES if mt is None else (mt or None)
        try:
            res[f"split x{sm}" + ("" if mt is None else f" t{mt}")] = graph_us(fn)
        finally:
            core.MERGE_TILE_VALUES = saved
        assert (out.float() - out0.float()).abs().max() < 2e-2, f"split x{sm} differs from split"
    for hf in (o for o in orders if o is not None):
        out, fn = ours(pg, q, kb, vb, S, "split", scales=sc, heads_first=hf)
        res[f"split {ORDER[hf]}"] = graph_us(fn)
    for bn in (b for b in block_ns if b is not None):     # the split's tile (None: the kernel's own, above)
        out, fn = ours(pg, q, kb, vb, S, "split", bn, scales=sc)
        res[f"split n{bn}"] = graph_us(fn)
        assert (out.float() - out0.float()).abs().max() < 2e-2, f"split n{bn} differs from split"
    best = None
    grid = itertools.product(mults, block_ns, merges, orders, maxnregs, min_tokens, pass_forms, launches, fits, pdls)
    for m, bn, mg, hf, nr, mt, pf, la, ft, pd in grid:
        out, fn = ours(pg, q, kb, vb, max(1, round(S * m)), "chunks", bn, mg, sc, hf, nr, la, bool(ft))
        name = (f"chunks x{m}" + ("" if bn is None else f" n{bn}") + ("" if mg == "last" else " pass")
                + ("" if hf is None else f" {ORDER[hf]}") + ("" if nr is None else f" r{nr}")
                + ("" if mt is None else f" min{mt}") + ("" if pf is None else f" c{pf}") + (f" {la}" if la else "")
                + (" fit" if ft else "") + ("" if pd is None else f" pdl-{pd}"))
        with knobs(mt, pf, pd):
            res[name] = t = graph_us(fn)
        assert (out.float() - out0.float()).abs().max() < 2e-2, f"{name} differs from split"
        cand = (t, m, bn, mg, hf, nr, mt, pf, la, bool(ft), pd)
        best = min(best or cand, cand, key=lambda b: b[0])
    out, fn = ours(pg, q, kb, vb, S, "invariant", scales=sc)
    res["invariant"] = graph_us(fn)
    if fi is not None:
        for name, (out, fn) in flashinfer_calls(pg, q, kb, vb, fi, fi_ws, sc).items():
            res[name] = graph_us(fn)
            assert (out.float() - out0.float()).abs().max() < 2e-2, f"{name} differs from ours"
    mean = -(-sum(lens) // bs)
    upg = paged([mean] * bs, Hkv, D, gen)
    ukb, uvb, _ = kv_pair(upg["num_pages"] * PAGE, Hkv, D, kv_dtype)
    # the best chunk configuration of the row on a uniform batch of its tokens: the balance, like for like
    with knobs(best[6], best[7], best[10]):
        res["uniform same tokens"] = graph_us(ours(upg, q, ukb, uvb, max(1, round(S * best[1])), "chunks", best[2],
                                                   best[3], sc, best[4], best[5], best[8], best[9])[1])
    return res


def copy_tb_s() -> float:
    """The card's device-to-device copy rate (read + write bytes a second), for the % of copy bandwidth."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    return 2 * src.numel() / ms / 1e9


def opts(text: str, cast=int) -> list:
    """A comma-separated option's values, "none" as None."""
    return [None if t == "none" else cast(t) for t in text.split(",")]


def load_flashinfer(skip: bool) -> tuple:
    """(flashinfer, its 256 MiB workspace), or (None, None) where skipped or not importable: ours alone."""
    try:
        if skip:
            raise ImportError("--no-flashinfer")
        import flashinfer as fi
        return fi, torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    except Exception as e:
        print(f"flashinfer not importable: {e}")
        return None, None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="28/4x128:24,32/8x64:24,8/1x128:48,32/8x128:8,32/8x128:64")
    p.add_argument("--dists", default="ragged,longtail,bimodal,uniform")
    p.add_argument("--mults", default="1,2,4")
    p.add_argument("--block-ns", default="none",
                   help="KV tile sizes to try: none (the kernel's own: 64 on FP8, 32 or 64 by head dim), 32, 64")
    p.add_argument("--merges", default="last,pass", help="the chunk merges to try (last, pass)")
    p.add_argument("--kv-dtypes", default="bf16", help="KV cache dtypes (bf16, fp8: float8_e4m3fn)")
    p.add_argument("--orders", default="auto", help="grid orders to try: auto (the kernel's rule), heads, batch")
    p.add_argument("--maxnregs", default="none", help="the chunk pass's register bounds to try: none, 64, ...")
    p.add_argument("--kv", type=int, default=16384, help="the uniform rows' KV length")
    p.add_argument("--min-chunk-tokens", default="none",
                   help="decode chunks' floors to try (DECODE_MIN_CHUNK_TOKENS): none (as it is), 64, ...")
    p.add_argument("--pass-forms", default="none",
                   help="merge pass forms to try: none (as it is), C (C chunks a load), nopf (the sum's walk "
                        "without prefetch), wCdD (every wide budget: C chunks, D columns a program), fN "
                        "(DECODE_FEW_LAST N), e.g. 16,nopf,w128d64,f8")
    p.add_argument("--split-mults", default="1", help="the split schedule's counts to try, times the rule's: 1,2,4")
    p.add_argument("--merge-tiles", default="none",
                   help="the split merge's MERGE_TILE_VALUES: none (as it is), 0 (no column cut), 8192, ...")
    p.add_argument("--launches", default="none",
                   help="the chunk pass's stages and warps to try: none (2 and 4), s3w4, s2w8, ...")
    p.add_argument("--pdls", default="none",
                   help="the merge pass as a dependent launch: none (as it is), off, exit, start")
    p.add_argument("--fits", default="0", help="the chunk budget's wave fit (chunk_kernels._balanced_per) to try: 0, 1")
    p.add_argument("--slot64", default="auto",
                   help="slot arithmetic: auto (decode_attention.slot64's: the split pass int32 on these pools; "
                        "the chunk pass int64 always), or 1: int64 (as past 2^31)")
    p.add_argument("--no-flashinfer", action="store_true", help="ours alone")
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    fi, fi_ws = load_flashinfer(args.no_flashinfer)
    mults = [float(m) if "." in m else int(m) for m in args.mults.split(",")]
    kv_dtypes = [{"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[d] for d in args.kv_dtypes.split(",")]
    copy = copy_tb_s()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          "flashinfer", getattr(fi, "__version__", None), f"copy {copy:.2f} TB/s")
    if args.slot64 == "1":
        decode.slot64 = lambda *buffers: True
        print("slot arithmetic: int64 (--slot64 1)")
    for spec in args.rows.split(","):
        heads, rest = spec.split("x")
        H, Hkv = map(int, heads.split("/"))
        D, bs = map(int, rest.split(":"))
        for dist in args.dists.split(","):
            firsts = []
            for kv_dtype in kv_dtypes:
                r = row(H, Hkv, D, bs, dist, mults, fi, fi_ws, opts(args.block_ns), args.merges.split(","), kv_dtype,
                        [{"auto": None, "heads": True, "batch": False}[o] for o in args.orders.split(",")],
                        opts(args.maxnregs), args.kv, opts(args.min_chunk_tokens), opts(args.pass_forms, str),
                        opts(args.split_mults), opts(args.merge_tiles), opts(args.launches, str),
                        opts(args.fits), opts(args.pdls, str))
                best_fi = min((v for k, v in r.items() if k.startswith("fi")), default=None)
                best = min(v for k, v in r.items() if k.startswith(("split", "chunks")))
                firsts.append((best, best_fi))
                times = " ".join(f"{k} {v:.1f}" for k, v in r.items() if isinstance(v, float))
                x = f"x split {best_fi / r['split']:.2f} x best {best_fi / best:.2f}" if best_fi else ""
                vs = (f"  {kv_dtypes[0]} / this: ours {firsts[0][0] / best:.2f}"
                      + (f" fi {firsts[0][1] / best_fi:.2f}" if best_fi else "")) if len(firsts) > 1 else ""
                chunks = min(v for k, v in r.items() if k.startswith("chunks"))      # balance: like for like
                print(f"{r['row']:<28} S={r['S']:<3} {times}  {x}  balance {chunks / r['uniform same tokens']:.2f}"
                      f"  {r['bytes'] / best / 1e6:.2f} TB/s ({r['bytes'] / best / 1e6 / copy:.0%} of copy){vs}",
                      flush=True)


if __name__ == "__main__":
    main()
