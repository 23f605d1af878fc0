"""Which memcpy node of which CUDA graph reads memory nothing wrote (a compute-sanitizer
initcheck finding): replays one case of tests/test_cuda_graphs.py with every CUDA graph captured
in debug mode, then prints each graph's memcpy nodes (from its DOT dump) beside the address
ranges of the tensors the case knows by name. Run under ``compute-sanitizer --tool initcheck``
and match the addresses it reports.

    compute-sanitizer --tool initcheck python bench/initcheck_probe.py [backend] [mode] [ps]
"""
import re
import sys
import tempfile

import torch

sys.path.insert(0, "tests")
GRAPHS = []
_Base = torch.cuda.CUDAGraph


class DebugGraph(_Base):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.enable_debug_mode()
        GRAPHS.append(self)


torch.cuda.CUDAGraph = DebugGraph
import test_cuda_graphs as T  # noqa: E402

backend, mode, ps = (sys.argv[1:] + ["triton", "decode", "1"][len(sys.argv) - 1:])[:3]
names = {}
orig = T.get_backend


def named_backend(*a, **k):
    be = orig(*a, **k)
    names[f"backend{len(names)}"] = be
    return be


T.get_backend = named_backend
T.test_replay_equals_eager_and_reference(backend, mode, int(ps))
print(f"{len(GRAPHS)} graphs captured")
for i, g in enumerate(GRAPHS):
    path = tempfile.mktemp(suffix=".dot")
    g.debug_dump(path)
    text = open(path).read()
    for node in re.findall(r'label="([^"]*MEMCPY[^"]*)"', text):
        print(f"graph {i}: {node.replace(chr(92) + 'n', ' | ')[:400]}")
for name, be in names.items():
    for bname, t in be.graph_buffers().items():
        print(f"{name}.{bname}: {t.data_ptr():#x} .. {t.data_ptr() + t.numel() * t.element_size():#x}")
    plan = getattr(be, "_own_plan", None)
    for bname, t in (plan.tensors() if plan is not None else {}).items():
        print(f"{name}.own_plan.{bname}: {t.data_ptr():#x} .. {t.data_ptr() + t.numel() * t.element_size():#x}")
