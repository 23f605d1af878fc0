"""The sweep's command line, its FlashInfer import and its run's header (``sweep.py`` uses them)."""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
from pathlib import Path

import torch
import triton
from sweep_flashinfer import NOT_SWEPT
from sweep_matrix import GRIDS
from sweep_rows import DISTS
from sweep_timing import HOST_TIMING, ROUNDS_TIMING


def _list(kind):
    """An argparse type: a comma-separated list of ``kind``; an empty item is an error."""
    def parse(text: str) -> list:
        items = text.split(",")
        if not all(items):
            raise argparse.ArgumentTypeError(f"{text!r}: an empty item")
        try:
            return [kind(x) for x in items]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Ours against every FlashInfer configuration (bench/sweep/sweep.py)")
    p.add_argument("--out", help="folder for sweep.jsonl, SWEEP.md, sweep.png and prewarm/ logs "
                                 "(default: bench/sweep/; --smoke: /tmp/attn-sweep-smoke)")
    p.add_argument("--grid", choices=tuple(GRIDS), default="issue40",
                   help="issue40 (default): every distribution, GQA 8/1 28/4 32/8 64/8 at d64/d128, MLA 16/128, "
                        "bs 1..128; issue10: issue #10's uniform grid as it was")
    p.add_argument("--quick", action="store_true",
                   help="the grid's quick points only (issue10: bs 1, 16, 128 x kv 8192; issue40: bs 3, 24, 100, "
                        "uniform kv 16384)")
    p.add_argument("--only", choices=("gqa", "mla"), help="one family only")
    p.add_argument("--dist", type=_list(str), help=f"distributions, comma-separated, of {', '.join(DISTS)}")
    p.add_argument("--workloads", type=_list(str),
                   help="workload names or patterns, comma-separated (e.g. gqa28_4_d128_decode,mla16_*)")
    p.add_argument("--bs", type=_list(int), help="batch sizes, comma-separated (e.g. 8,24,48)")
    p.add_argument("--kv", type=_list(int), help="the uniform rows' kv, comma-separated (e.g. 16384)")
    p.add_argument("--seed", type=int, default=0, help="the lengths' seed (default 0)")
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check (tiny shapes, ours only)")
    p.add_argument("--no-flashinfer", action="store_true", help="ours only")
    p.add_argument("--no-invariant", action="store_true",
                   help="skip our batch-invariant mode (ours_invariant, measured on GQA rows by default)")
    p.add_argument("--trace", type=int, default=0, metavar="N",
                   help="profile N replays of each graph: its kernels, span and the gaps between them (sweep_trace)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no new group after this many seconds (default 420; "
                        "the groups left are recorded as skipped)")
    p.add_argument("--prewarm-timeout-s", type=float, default=300.0)
    p.add_argument("--prewarm", help=argparse.SUPPRESS)     # internal: one prewarm job
    p.add_argument("--prewarm-bs", help=argparse.SUPPRESS)  # internal: batches of a prewarm job
    return p.parse_args(argv)


def import_flashinfer():
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", f"{major}.{minor}" + ("a" if major >= 9 else ""))
    try:
        import flashinfer
        return flashinfer, None
    except Exception as e:  # recorded in the header; the sweep runs ours alone
        return None, f"{type(e).__name__}: {e}"[:300]


def environment(args, device: str, fi, fi_error) -> dict:
    env = dict(type="header", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
               flashinfer=getattr(fi, "__version__", None), flashinfer_error=fi_error,
               flashinfer_cuda_arch_list=os.environ.get("FLASHINFER_CUDA_ARCH_LIST"),
               args=vars(args), smoke=bool(args.smoke), not_swept=NOT_SWEPT)
    try:   # SWEEP_COMMIT names the commit where the tree was copied without its git metadata
        env["git"] = os.environ.get("SWEEP_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except Exception:
        env["git"] = None
    if device == "cuda":
        prop = torch.cuda.get_device_properties(0)
        env.update(device=prop.name, sm=prop.major * 10 + prop.minor, num_sms=prop.multi_processor_count,
                   memory_gb=round(prop.total_memory / 2 ** 30, 1), host_timing=HOST_TIMING, timing=ROUNDS_TIMING)
    else:
        env.update(device="cpu (Triton interpreter)", sm=0)
    return env
