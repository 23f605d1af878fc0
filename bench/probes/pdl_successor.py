"""Does a kernel captured after the dependent merge pass see the attention's output when the merge has nothing to
merge (every request one chunk) and its programs return without ``gdc_wait``? Plant that form by moving the merge
pass's wait into its branch (``kernels/chunk_kernels.py``), then run:

    python bench/probes/pdl_successor.py      # sm_90+ GPU

It prints, for each shape, how many of 200 graph replays and 200 eager steps let the next kernel (a copy of the
output) read rows the chunk pass had not yet written (NaN).
"""
import pathlib
import random
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "kernels"))
from kernel_refs import make_paged_batch  # noqa: E402
from test_merge_pdl import PAGE, _attend  # noqa: E402

from attn_backends_kernels.schedule import chunk_workspace  # noqa: E402

SHAPES = [(1, 64, 32, 8, 128), (1, 1024, 64, 8, 128), (1, 4096, 64, 8, 128), (4, 1024, 64, 8, 128),
          (4, 4096, 32, 8, 128)]      # (W, bs, H, Hkv, D)


def step_of(W, bs, H, Hkv, D):
    """A step that poisons the output, attends (chunk schedule, merge pass) and copies the output; its buffers."""
    rng = random.Random(W)
    lens = [rng.randint(W, 64 if W == 1 else 256) for _ in range(bs)]      # ragged, one chunk each
    page_table, seq_lens, num_pages = make_paged_batch(lens, PAGE, device="cuda", seed=W)
    k, v = (torch.randn(num_pages * PAGE, Hkv, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    q = torch.randn(bs * W, H, D, device="cuda").to(torch.bfloat16)
    out, seen = (torch.empty(bs * W, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ws = chunk_workspace(bs, 4, W, H, Hkv, D, "cuda")
    cu = torch.arange(0, bs * W + 1, W, dtype=torch.int32, device="cuda")

    def step():
        out.fill_(float("nan"))
        _attend(q, k, v, page_table, seq_lens, cu, W, 4, out, ws)
        seen.copy_(out)
    return step, out, seen, ws


def main():
    for shape in SHAPES:
        step, out, seen, ws = step_of(*shape)
        ws[1].fill_(float("nan"))
        step()
        torch.cuda.synchronize()
        one_chunk, want = bool(ws[1].isnan().all()), out.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        stale = {"graph": 0, "eager": 0}
        for _ in range(200):
            for way, run in (("graph", graph.replay), ("eager", step)):
                seen.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
                stale[way] += int(not torch.equal(seen, want))
        print(f"W {shape[0]} bs {shape[1]} {shape[2]}/{shape[3]} d{shape[4]}: every request one chunk {one_chunk}; "
              f"stale reads: graph {stale['graph']}/200, eager {stale['eager']}/200", flush=True)


if __name__ == "__main__":
    main()
