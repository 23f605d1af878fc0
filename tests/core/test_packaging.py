"""The installed import names cannot collide with other distributions (issue #7 item 4): the
folders kernels/ and runtime/ install as ``attn_backends_kernels`` and ``attn_backends_runtime``,
and nothing imports the bare names. Plus the size budget as a gate."""
import ast
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("attn_backends", "runtime", "kernels", "tests", "bench", "examples")
           for p in sorted((ROOT / d).rglob("*.py"))]


def _imports(path: pathlib.Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_module_imports_the_bare_folder_names():
    bad = [str(p.relative_to(ROOT)) for p in SOURCES if _imports(p) & {"kernels", "runtime"}]
    assert not bad, f"these import `kernels` / `runtime`, names other distributions use: {bad}"


def test_imports_beside_colliding_modules(tmp_path):
    """A foreign `kernels` package and `runtime` module first on sys.path: ours still load,
    run a step, and leave the foreign ones in place."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("FOREIGN = 'kernels'\n")
    (tmp_path / "runtime.py").write_text("FOREIGN = 'runtime'\n")
    script = textwrap.dedent("""
        import os, sys
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import kernels, runtime
        import torch
        import attn_backends_kernels.decode_attention as dk
        from attn_backends_runtime.models import TinyConfig, TinyModel
        from attn_backends_runtime.runner_base import run_eager
        from attn_backends import ForwardMode, get_backend
        from attn_backends.check.scenarios import Scenario, make_memory, materialize
        tc = TinyConfig()
        mem = make_memory(tc.attention(), num_pages=32, max_reqs=4, max_context_len=64)
        m = materialize(Scenario(ForwardMode.DECODE, 2, [3, 9]), mem, 1)
        m.batch.input_ids = torch.zeros(2, dtype=torch.int64)
        out = run_eager(TinyModel(tc), get_backend("torch_native", tc.attention(), mem), m.batch, 1)
        assert out.logits.shape == (2, tc.vocab_size)
        assert kernels.FOREIGN == "kernels" and runtime.FOREIGN == "runtime"
        assert sys.modules["kernels"] is kernels and sys.modules["runtime"] is runtime
        print(dk.__file__)
    """)
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert res.returncode == 0, res.stderr
    assert pathlib.Path(res.stdout.strip()).resolve() == ROOT / "kernels" / "decode_attention.py"


def _long_functions(path: pathlib.Path, limit: int) -> list:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > limit:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_size_budget():
    """The size budget: no module over 400 lines; no function over 60 lines outside the kernels."""
    big = [f"{p.relative_to(ROOT)} ({n} lines)" for p in SOURCES
           if (n := len(p.read_text().splitlines())) > 400]
    assert not big, f"modules over 400 lines: {big}"
    long = [f for p in SOURCES if "kernels" not in p.relative_to(ROOT).parts[:1] for f in _long_functions(p, 60)]
    assert not long, f"functions over 60 lines: {long}"
