"""MLA's split against its chunk schedule at the kernel level, each launch's time apart: where the
chunk pass's time goes on uniform rows (issue #40), and what 16-bit chunk partials change.

    python bench/probes/mla_chunks.py [--rows 16x1:48,128x1:48,16x4:48,128x4:24/2] [--dists uniform,ragged,longtail]
    python bench/probes/mla_chunks.py --variants rule+z1,rule,rule+nopf [--rows ...] [--dists ...]

Per row (heads x query rows a request : batch[/split count, else the backend's]) and length
distribution (``bench/sweep``'s), bf16, page 64, shuffled pages: graph-replay time
(``triton.testing.do_bench``, median) of "split" (``mla_attention_fwd`` at the backend's split count
and partial dtype), "chunks f32" (``mla_chunk_fwd``, float32 partials: the schedule before 16-bit
chunk partials) and "chunks" (``warpspec.partial_dtype``'s partials, as the backend allocates them);
then each launch's device time from the profiler over 20 replays, with its registers, shared memory
and blocks an SM as the trace reports them. Outputs are compared with the split's.

``--variants``: the backend's chunk launch alone ("rule": its split count, partial dtype and wave fit) beside forms
of it, each timed and broken into launches the same way: "rule+z1" the merge pass's column blocks on the grid only
while programs are few, as for the other head dims (``chunk_kernels.MERGE_PASS_LATENT_PROGRAMS`` at
``MERGE_PASS_PROGRAMS``); "+fatN" the merge pass's fat tiles in decode up to N chunks a request
(``MERGE_PASS_FAT_DECODE``); "+nopub" the merge searching for the wave fit's chunk size itself
(``balanced.PUBLISH_FIT`` off; on a budget of waves the cap and the largest-first order go with it: the kernels take
both from ``CHUNK_CAP``, which is 0 unless published); "+lpN" ``MERGE_PASS_LATENT_PROGRAMS`` at N; "+wN" / "+sN" the
merge pass at N warps / N stages; "+nopdl" the merge pass in stream order, not a dependent launch; "+twopass"
requests whose chunks fit one load merged in two walks too (``MERGE_PASS_ONE_LOAD`` off); "+nopf" the sum's walk
without its next load in flight (``MERGE_PASS_PREFETCH`` off); "+onewave" no budget of several waves
(``schedule.MANY_WAVES`` 0: the count of one wave; nothing on a row given its count, ``/S``); "+nocap" that budget
without its cap and in request order (``MANY_WAVES_CAP`` 0: ``chunk_map``'s order rides on the cap), "+capN" with a
cap of N chunks a request; "+plan" the chunk size a launch before the chunk pass plans by a wave model
(``balanced.PLAN_WAVES``, ``mla.chunk_plan``), "+planonce" that plan launched by the eager call alone, not in the
graph (as a plan made once a step for every layer: the graph's chunk pass and merge read the eager call's size, the
same batch's); "#2" after a form: that form again, a second round.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import defaultdict
from unittest import mock

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sweep"))
from sweep_rows import lengths  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from ragged_decode import captured  # noqa: E402

from attn_backends.backends.triton_common import choose_num_kv_splits  # noqa: E402
from attn_backends_kernels import chunk_kernels, schedule  # noqa: E402
from attn_backends_kernels.attention_core import decode_workspace  # noqa: E402
from attn_backends_kernels.mla import balanced  # noqa: E402
from attn_backends_kernels.mla.attention import mla_attention_fwd, tile_shape  # noqa: E402
from attn_backends_kernels.mla.balanced import mla_chunk_fwd  # noqa: E402
from attn_backends_kernels.mla.warpspec import partial_dtype  # noqa: E402
from attn_backends_kernels.schedule import chunk_workspace, slots_per_request  # noqa: E402

PAGE = 64
SPLIT_TOKENS = 128           # triton_mla's verify split floor (two 64-token tiles)


def paged(lens: list, gen) -> tuple:
    counts = [-(-n // PAGE) for n in lens]
    perm = (torch.randperm(sum(counts), generator=gen) + 1).int()
    table = torch.zeros(len(lens), max(counts), dtype=torch.int32)
    at = 0
    for i, c in enumerate(counts):
        table[i, :c] = perm[at:at + c]
        at += c
    return table.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda"), 1 + sum(counts)


def launches(g, n: int = 20) -> dict:
    """``{kernel: (us a replay, registers, shared bytes, blocks an SM)}`` over ``n`` replays."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            g.replay()
        torch.cuda.synchronize()
    path = f"/tmp/mla_chunks_{os.getpid()}.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    total, info = defaultdict(float), {}
    for e in events:
        if e.get("cat") == "kernel":
            name = e["name"].split("(")[0][-40:]
            total[name] += e["dur"] / n
            a = e.get("args", {})
            info[name] = (a.get("registers per thread"), a.get("shared memory"), a.get("blocks per SM"))
    return {k: (round(v, 1), *info[k]) for k, v in total.items()}


def _data(H: int, W: int, bs: int, dist: str, exact_below: int) -> tuple:
    """A row's batch (lengths of ``dist``, shuffled pages, random latent cache and queries), its programs a split
    and split count (``choose_num_kv_splits`` at ``exact_below``) and the default tile's partial dtype."""
    gen = torch.Generator().manual_seed(bs + H + W)
    lens = [max(n, W) for n in lengths(dist, bs, kv=16384)]
    table, seq, slots = paged(lens, gen)
    kv = torch.randn(slots * PAGE, 1, 576, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(bs * W, H, 576, device="cuda", dtype=torch.bfloat16)
    bw, bh = tile_shape(W, H)
    programs = bs * -(-W // bw) * -(-H // bh)
    S = choose_num_kv_splits(programs, q.device, table.shape[1], 1, W, 1, None,
                             1 if W == 1 else SPLIT_TOKENS // PAGE, exact_below)
    return lens, table, seq, kv, q, programs, S, partial_dtype(kv.dtype, q.device, PAGE, bw * bh, 512, 64)


def row(H: int, W: int, bs: int, dist: str, splits=None) -> dict:
    lens, table, seq, kv, q, _, S, part16 = _data(H, W, bs, dist, 1)
    S = S if splits is None else splits
    res = {"row": f"mla{H} W{W} bs{bs} {dist}", "S": S, "part": str(part16)[6:], "tokens": sum(lens)}
    outs = {}

    def split():
        out = outs.setdefault("split", torch.empty(bs * W, H, 512, device="cuda", dtype=q.dtype))
        ws = decode_workspace(bs * W, H, 512, S, "cuda", 0, part16) if S > 1 else None
        return lambda: mla_attention_fwd(q, kv, table, seq, PAGE, 0.07, S, out, q_per_req=W, workspace=ws)

    def chunks(label, dtype):
        out = outs.setdefault(label, torch.empty(bs * W, H, 512, device="cuda", dtype=q.dtype))
        ws = chunk_workspace(bs, slots_per_request("chunks", S, table.shape[1] * PAGE), W, H, 1, 512, "cuda", dtype)
        return lambda: mla_chunk_fwd(q, kv, table, seq, PAGE, 0.07, S, out, q_per_req=W, workspace=ws)

    for label, make in (("split", split), ("chunks f32", lambda: chunks("chunks f32", torch.float32)),
                        ("chunks", lambda: chunks("chunks", part16))):
        g, us = captured(make())
        res[label] = round(us, 1)
        res[label + " launches"] = launches(g)
    ref = outs["split"].float()
    res["max diff"] = max(round((outs[k].float() - ref).abs().max().item(), 4) for k in outs)
    return res


@contextlib.contextmanager
def variant(name: str):
    """The knobs of ``--variants`` form ``name`` (module docstring)."""
    with contextlib.ExitStack() as stack:
        form, _, again = name.partition("#")               # "#N": the same form again (a second round)
        base, *mods = form.split("+")
        if base != "rule" or not (again == "" or again.isdigit()):
            raise ValueError(f"variant {name!r}: 'rule', then '+' modifiers (module docstring), then '#N'")
        for part in mods:
            if part == "z1":
                stack.enter_context(mock.patch.object(chunk_kernels, "MERGE_PASS_LATENT_PROGRAMS",
                                                      chunk_kernels.MERGE_PASS_PROGRAMS))
            elif part.startswith("lp") and part[2:].isdigit():
                stack.enter_context(mock.patch.object(chunk_kernels, "MERGE_PASS_LATENT_PROGRAMS", int(part[2:])))
            elif part == "twopass":
                stack.enter_context(mock.patch.object(chunk_kernels, "MERGE_PASS_ONE_LOAD", False))
            elif part == "nopf":
                stack.enter_context(mock.patch.object(chunk_kernels, "MERGE_PASS_PREFETCH", False))
            elif part == "onewave":
                stack.enter_context(mock.patch.object(schedule, "MANY_WAVES", 0))
            elif part == "nocap":
                stack.enter_context(mock.patch.object(balanced, "MANY_WAVES_CAP", 0))
            elif part.startswith("cap") and part[3:].isdigit():
                stack.enter_context(mock.patch.object(balanced, "MANY_WAVES_CAP", int(part[3:])))
            elif part == "plan":
                stack.enter_context(mock.patch.object(balanced, "PLAN_WAVES", True))
            elif part == "planonce":
                stack.enter_context(mock.patch.object(balanced, "PLAN_WAVES", True))
                stack.enter_context(mock.patch.object(balanced, "plan_chunks", _outside_graphs(balanced.plan_chunks)))
            elif part == "nopub":
                stack.enter_context(mock.patch.object(balanced, "PUBLISH_FIT", False))
            elif (part[:1] in ("w", "s") and part[1:].isdigit() and int(part[1:]) > 0
                  and (part[0] == "s" or int(part[1:]) & (int(part[1:]) - 1) == 0) or part == "nopdl"):
                stack.enter_context(mock.patch.object(schedule, "launch", _merge_launch(part, schedule.launch)))
            elif part.startswith("fat") and part[3:].isdigit():
                stack.enter_context(mock.patch.object(chunk_kernels, "MERGE_PASS_FAT_DECODE", int(part[3:])))
            else:
                raise ValueError(f"variant modifier {part!r} not in z1, fatN, nopub, lpN, wN, sN, nopdl, twopass, "
                                 "nopf, onewave, nocap, capN, plan, planonce")
        yield


def _outside_graphs(plan):
    """``plan`` launched where no stream is capturing (the eager call before ``captured``'s capture), else not."""
    def planned(*args, **kwargs):
        if not torch.cuda.is_current_stream_capturing():
            plan(*args, **kwargs)
    return planned


def _merge_launch(part: str, launch):
    """``schedule.launch`` with the merge pass launched at ``part``'s warps (wN) or stages (sN), or not as a
    dependent (nopdl: stream order, no ``gdc_wait``)."""
    def launched(kernel, grid, *args, **kwargs):
        if kernel is chunk_kernels._merge_chunk_pass_kernel:
            if part == "nopdl":
                kwargs.update(PDL=False, launch_pdl=False)
            else:
                kwargs["num_warps" if part[0] == "w" else "num_stages"] = int(part[1:])
        return launch(kernel, grid, *args, **kwargs)
    return launched


def _plan(H: int, W: int, programs: int, S: int, splits) -> tuple:
    """``(count, fit, many_waves)`` of ``triton_common._split_plan`` for a row (``splits``: that count, under the fit
    and as a budget of waves)."""
    if splits is not None:
        return splits, True, True
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    waves = (schedule.many_waves(programs, sms) if S == 1 and W == 1 and (H >= 64 or H == 16) and 2 * programs > sms
             else 1)
    if waves > 1:
        return waves, True, True
    return S, S == sms // programs and 8 * S * programs >= 7 * sms, False


def variants_row(H: int, W: int, bs: int, dist: str, names: list, splits=None) -> dict:
    """The backend's chunk launch of a row (``row``'s data: its count, partial dtype, wave fit and budget of waves,
    ``_plan``) under each form in ``names``; ``splits``: this count instead, as a budget of waves."""
    lens, table, seq, kv, q, programs, S1, part16 = _data(H, W, bs, dist, 65)     # the chunked launch's exact count
    res = {"row": f"mla{H} W{W} bs{bs} {dist}", "tokens": sum(lens)}
    ref = torch.empty(bs * W, H, 512, device="cuda", dtype=q.dtype)
    mla_attention_fwd(q, kv, table, seq, PAGE, 0.07, S1, ref, q_per_req=W,
                      workspace=decode_workspace(bs * W, H, 512, S1, "cuda", 0, part16) if S1 > 1 else None)
    for name in names:
        out = torch.empty_like(ref)
        with variant(name):
            S, fit, many = _plan(H, W, programs, S1, splits)
            res[name + " plan"] = (S, fit, many)
            ws = chunk_workspace(bs, S, W, H, 1, 512, "cuda", part16)
            g, us = captured(lambda: mla_chunk_fwd(q, kv, table, seq, PAGE, 0.07, S, out, q_per_req=W, workspace=ws,
                                                   fit=fit, many_waves=many))
            res[name] = round(us, 1)
            res[name + " launches"] = launches(g)
        res[name + " max diff"] = round((out.float() - ref.float()).abs().max().item(), 4)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16x1:48,128x1:48,16x4:48,128x4:24")
    ap.add_argument("--dists", default="uniform,ragged,longtail")
    ap.add_argument("--json", help="append each row as a JSON line to this file")
    ap.add_argument("--variants", help="the backend's chunk launch under these forms (module docstring)")
    args = ap.parse_args(argv)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    for spec in args.rows.split(","):
        hw, bs = spec.split(":")
        H, W = (int(x) for x in hw.split("x"))
        bs, _, splits = bs.partition("/")
        for dist in args.dists.split(","):
            if args.variants:
                names = args.variants.split(",")
                r = variants_row(H, W, int(bs), dist, names, int(splits) if splits else None)
                print(f"{r['row']} tokens={r['tokens']}: " + " / ".join(
                    f"{n} {r[n]} (S, fit, waves {r[n + ' plan']}; diff {r[n + ' max diff']})" for n in names) + " us")
                for n in names:
                    print(f"    {n}: {r[n + ' launches']}")
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(r) + "\n")
                continue
            r = row(H, W, int(bs), dist, int(splits) if splits else None)
            print(f"{r['row']} S={r['S']} part={r['part']}: split {r['split']} / chunks f32 {r['chunks f32']} / "
                  f"chunks {r['chunks']} us (max diff {r['max diff']})")
            for label in ("split", "chunks f32", "chunks"):
                print(f"    {label}: {r[label + ' launches']}")
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
