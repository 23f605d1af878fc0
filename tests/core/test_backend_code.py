"""What the backends' code may not do, read from the code itself (AST), so that it stays true:
backends read the step's view (attribute reads) and never call into the step; no LayoutBackend
method has a second path for "the runner's step or a private one"; backends keep no mutable
module-level state (library state lives in the step's cache, the KV memory or the backend)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = sorted((ROOT / "attn_backends" / "backends").glob("*.py"))
STEP_NAMES = {"step", "plan", "view"}            # the step object, by any of its names in backends
MUTABLE_CALLS = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque"}


def _root_name(node):
    """The attribute chain ``a.b.c`` as ``["a", "b", "c"]`` (None where it is not one)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id] + parts[::-1] if isinstance(node, ast.Name) else None


def step_method_calls(tree) -> list:
    """Calls ``<step>.method(...)``: the callee's object is the step or the view itself (``view``,
    ``x.step``, ``x.plan``); reading an attribute and calling a method of what it holds
    (``view.cache.get``: the cache dict) is not a call into the step."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            chain = _root_name(node.func.value)
            if chain and chain[-1] in STEP_NAMES:
                out.append(f"line {node.lineno}: {'.'.join(chain)}.{node.func.attr}()")
    return out


def module_mutable_state(tree) -> list:
    out = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            v = node.value
            mutable = isinstance(v, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
                isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in MUTABLE_CALLS)
            if mutable:
                out.append(f"line {node.lineno}: {ast.unparse(node)[:60]}")
    return out


def step_branches(cls: ast.ClassDef) -> list:
    """``if``/``x if c else y``/``and``/``or`` in a method whose test reads ``.step``/``.plan`` of
    the inputs or batch (a second path for a caller without a runner)."""
    out = []
    for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(fn):
            test = node.test if isinstance(node, (ast.If, ast.IfExp)) else node if isinstance(node, ast.BoolOp) \
                else None
            if test is None:
                continue
            for sub in ast.walk(test):
                if isinstance(sub, ast.Attribute) and sub.attr in ("step", "plan", "_own_plan"):
                    out.append(f"{fn.name} line {node.lineno}: {ast.unparse(test)[:60]}")
    return out


@pytest.mark.parametrize("path", BACKENDS, ids=lambda p: p.name)
def test_backends_never_call_into_the_step_and_keep_no_module_state(path):
    tree = ast.parse(path.read_text())
    assert step_method_calls(tree) == []
    assert module_mutable_state(tree) == []
    assert [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and "step" in n.module
            and any(a.name in ("Step", "StandaloneStep", "StepGroup") for a in n.names)] == []


def test_layout_backend_methods_have_one_path():
    tree = ast.parse((ROOT / "attn_backends" / "base.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LayoutBackend")
    assert step_branches(cls) == []
    for path in BACKENDS:
        for c in (n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)):
            assert step_branches(c) == [], (path.name, c.name)


@pytest.mark.parametrize("code,finder,found", [
    ("def f(view):\n    return view._replace(raw_bs=1)\n", step_method_calls, 1),
    ("def f(meta):\n    meta.view.cache.get(1)\n    return meta.batch.plan.first_in_step(2)\n", step_method_calls, 1),
    ("_EAGER: dict = {}\nKEPT = OrderedDict()\nLIMIT = 16\nNAMES = ('a',)\n", module_mutable_state, 2),
    ("class B:\n    def replay(self, inputs):\n        plan = inputs.plan if inputs.plan is not None else self._own\n",
     lambda t: step_branches(t.body[0]), 1),
])
def test_the_checks_find_what_they_are_for(code, finder, found):
    """Each check on planted code: the old shapes (a call into the plan, a module-level LRU, a
    branch on the runner's plan) are found."""
    assert len(finder(ast.parse(code))) == found
