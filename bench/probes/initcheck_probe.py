"""Which memcpy node of which CUDA graph reads memory nothing wrote (a compute-sanitizer
initcheck finding): replays one case of tests/backends/test_cuda_graphs.py with every CUDA graph captured
in debug mode, then prints each graph's memcpy nodes (from its DOT dump) beside the address
ranges of the tensors the case knows by name. Run under ``compute-sanitizer --tool initcheck``
and match the addresses it reports.

    compute-sanitizer --tool initcheck python bench/probes/initcheck_probe.py [backend:mode:ps ...]
"""
import re
import sys
import tempfile
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[2] / "tests"
sys.path[:0] = [str(TESTS / "backends"), str(TESTS / "support")]   # test_cuda_graphs and its reference
GRAPHS = []
_Base = torch.cuda.CUDAGraph


class DebugGraph(_Base):
    def __new__(cls, keep_graph: bool = False):
        g = super().__new__(cls, keep_graph=True)      # the graph is kept after instantiation for the dump
        g.enable_debug_mode()
        GRAPHS.append(g)
        return g


torch.cuda.CUDAGraph = DebugGraph
import test_cuda_graphs as T  # noqa: E402

names = {}
orig = T.get_backend


def named_backend(*a, **k):
    be = orig(*a, **k)
    names[f"backend{len(names)}"] = be
    return be


def probe(backend: str, mode: str, ps: int) -> None:
    print(f"=== CASE {backend} {mode} {ps}", flush=True)
    GRAPHS.clear()
    names.clear()
    T.test_replay_equals_eager_and_reference(backend, mode, ps)
    torch.cuda.synchronize()
    for i, g in enumerate(GRAPHS):
        path = tempfile.mktemp(suffix=".dot")
        try:
            g.debug_dump(path)
            text = open(path).read()
        except (OSError, RuntimeError) as e:
            print(f"graph {i}: no dump ({e})")
            continue
        for node in re.findall(r'label="([^"]*MEMCPY[^"]*)"', text):
            print(f"graph {i}: {node.replace(chr(92) + 'n', ' | ')[:400]}")
    for name, be in names.items():
        for bname, t in be.graph_buffers().items():     # the steps' tensors too (their views list them)
            print(f"{name}.{bname}: {t.data_ptr():#x} .. {t.data_ptr() + t.numel() * t.element_size():#x}")
    print(flush=True)


T.get_backend = named_backend
cases = [tuple(a.split(":")) for a in sys.argv[1:]] or [(b, m, str(p)) for b, m, p in T.CASES]
for b, m, p in cases:
    probe(b, m, int(p))
