"""Choosing a backend from outside (issue #38 item 7): ``select(..., backend=NAME)`` and the
environment variable ``ATTN_BACKENDS_BACKEND``, like vLLM's ``VLLM_ATTENTION_BACKEND``.

The rule: the argument, when given, wins over the variable; ``"auto"`` (either) is select's own
choice. A forced backend that cannot serve the model, mode or device is an error giving its
reason, never a silent fallback; an unknown name lists the known ones."""
import sys
import textwrap

import pytest
import torch

from attn_backends import ForwardMode, ModelConfig, registry, select
from attn_backends.registry import ENV_BACKEND

MHA = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16)
MLA = ModelConfig(num_layers=1, num_q_heads=4, is_mla=True, kv_lora_rank=32, qk_rope_head_dim=8)
BF16 = ModelConfig(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16)
FAVOURITE = textwrap.dedent("""
    from dataclasses import replace
    from attn_backends.backends.torch_native import TorchNativeBackend

    class Favourite(TorchNativeBackend):      # select() takes it first wherever it serves
        name = "favourite"
        capabilities = replace(TorchNativeBackend.capabilities, preference=5)
""")


@pytest.fixture
def registry_with_favourite(builtin_registry, tmp_path, monkeypatch):
    """The built-ins and one plugin that select() ranks first; no override in the environment."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    (tmp_path / "favourite_mod.py").write_text(FAVOURITE)
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register("favourite", "favourite_mod:Favourite")
    yield "favourite"
    monkeypatch.delitem(sys.modules, "favourite_mod", raising=False)


def test_without_an_override_select_takes_its_own_choice(registry_with_favourite):
    sel = select(MHA, ForwardMode.DECODE, device="cpu")
    assert (sel.name, sel.forced) == ("favourite", "")


def test_the_argument_forces_a_backend(registry_with_favourite):
    sel = select(MHA, ForwardMode.DECODE, device="cpu", backend="torch_native")
    assert (sel.name, sel.forced) == ("torch_native", "backend='torch_native'")
    assert sel.refused["favourite"] == "serves this too; torch_native forced by backend='torch_native'"
    assert sel.refused["triton_mla"] == "MLA only, model is MHA/GQA"        # the others keep their reasons
    target = "attn_backends.backends.torch_native:TorchNativeBackend"        # a module:Class target too
    assert select(MHA, ForwardMode.DECODE, device="cpu", backend=target).name == target


def test_the_environment_variable_forces_a_backend(registry_with_favourite, monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "torch_native")
    sel = select(MLA, ForwardMode.TARGET_VERIFY, device="cpu")
    assert (sel.name, sel.forced) == ("torch_native", f"{ENV_BACKEND}=torch_native")
    monkeypatch.setenv(ENV_BACKEND, "")                                     # empty: unset
    assert select(MLA, ForwardMode.TARGET_VERIFY, device="cpu").name == "favourite"


def test_the_argument_wins_over_the_environment_variable(registry_with_favourite, monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "torch_native")
    assert select(MHA, ForwardMode.DECODE, device="cpu", backend="favourite").name == "favourite"
    monkeypatch.setenv(ENV_BACKEND, "favourite")
    sel = select(MHA, ForwardMode.DECODE, device="cpu", backend="torch_native")
    assert (sel.name, sel.forced) == ("torch_native", "backend='torch_native'")
    monkeypatch.setenv(ENV_BACKEND, "torch_native")
    sel = select(MHA, ForwardMode.DECODE, device="cpu", backend="auto")    # select's own choice
    assert (sel.name, sel.forced) == ("favourite", "")


@pytest.mark.parametrize("source", ["argument", "environment"])
def test_a_forced_backend_that_cannot_serve_is_an_error_with_its_reason(source, registry_with_favourite,
                                                                         monkeypatch):
    def forced(name, cfg, mode=ForwardMode.DECODE, **kw):
        if source == "environment":
            monkeypatch.setenv(ENV_BACKEND, name)
            return select(cfg, mode, device="cpu", **kw)
        return select(cfg, mode, device="cpu", backend=name, **kw)
    how = {"argument": "backend='{}'", "environment": ENV_BACKEND + "={}"}[source]
    cases = [   # (name, model, mode, select's other arguments, the reason)
        ("flashinfer_mla", MHA, ForwardMode.DECODE, {}, "MLA only, model is MHA/GQA"),
        ("favourite", MHA, ForwardMode.IDLE, {}, "mode IDLE not supported"),
        ("hybrid", BF16, ForwardMode.DECODE, {}, "device cpu not supported (needs cuda)"),
        ("torch_native", MHA, ForwardMode.DECODE, {"exclude": ("torch_native",)}, "excluded by the caller"),
    ]
    for name, cfg, mode, kw, reason in cases:
        with pytest.raises(ValueError) as e:
            forced(name, cfg, mode, **kw)
        assert str(e.value) == (f"backend {name!r} ({how.format(name)}) cannot serve this model in {mode.name} "
                                f"on cpu: {reason}"), str(e.value)


def test_a_forced_backend_refused_for_trees_names_the_topk(registry_with_favourite, monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "flashinfer_mla")
    mla = ModelConfig(num_layers=1, num_q_heads=16, is_mla=True, page_size=16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"^backend 'flashinfer_mla' \({ENV_BACKEND}=flashinfer_mla\) cannot serve "
                                         r"this model in TARGET_VERIFY with topk=4 on cpu: topk=4 > 1 not supported"):
        select(mla, ForwardMode.TARGET_VERIFY, device="cpu", topk=4)


@pytest.mark.parametrize("source", ["argument", "environment"])
def test_an_unknown_name_lists_the_known_ones(source, registry_with_favourite, monkeypatch):
    if source == "environment":
        monkeypatch.setenv(ENV_BACKEND, "flashinfr")
        call, how = (lambda: select(MHA, ForwardMode.DECODE, device="cpu")), f"{ENV_BACKEND}=flashinfr"
    else:
        call, how = (lambda: select(MHA, ForwardMode.DECODE, device="cpu", backend="flashinfr")), "backend='flashinfr'"
    known = ", ".join(registry._entries())
    assert known.startswith("flashinfer_mla, ") and known.endswith(", favourite")
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value) == f"unknown backend 'flashinfr' ({how}); known: {known}, or a 'module:Class' target"


def test_a_target_that_does_not_load_names_the_cause(registry_with_favourite):
    with pytest.raises(ValueError, match=r"^backend 'no_such_mod_xyz:B' \(backend='no_such_mod_xyz:B'\) cannot be "
                                         r"loaded: cannot load backend class .*ModuleNotFoundError"):
        select(MHA, ForwardMode.DECODE, device="cpu", backend="no_such_mod_xyz:B")


def test_a_per_mode_override(registry_with_favourite, monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "decode=torch_native, target_verify=torch_native")
    assert select(MHA, ForwardMode.DECODE, device="cpu").name == "torch_native"
    assert select(MHA, ForwardMode.TARGET_VERIFY, device="cpu").name == "torch_native"
    assert select(MHA, ForwardMode.EXTEND, device="cpu").name == "favourite"      # not named: select's choice
    sel = select(MHA, ForwardMode.EXTEND, device="cpu", backend="extend=torch_native")
    assert (sel.name, sel.forced) == ("torch_native", "backend='extend=torch_native'")
    monkeypatch.setenv(ENV_BACKEND, "verify=torch_native")
    with pytest.raises(ValueError, match=rf"^{ENV_BACKEND}=verify=torch_native: unknown mode 'verify' \(modes: "
                                         r"extend, decode, target_verify, draft_extend\)$"):
        select(MHA, ForwardMode.DECODE, device="cpu")


def test_compose_selected_follows_the_override(registry_with_favourite, monkeypatch):
    """compose_selected() calls select() per mode, so the override composes: one name everywhere,
    or per mode; a hybrid named there is refused (compose_selected composes its own)."""
    from attn_backends.backends.hybrid import compose_selected
    monkeypatch.setenv(ENV_BACKEND, "torch_native")
    _, picks = compose_selected(MHA, device="cpu")
    assert {s.name for s in picks.values()} == {"torch_native"}
    monkeypatch.setenv(ENV_BACKEND, "extend=torch_native")
    _, picks = compose_selected(MHA, device="cpu")
    assert picks[ForwardMode.EXTEND].name == "torch_native" and picks[ForwardMode.DECODE].name == "favourite"
    monkeypatch.setenv(ENV_BACKEND, "hybrid")
    with pytest.raises(ValueError, match=rf"^backend 'hybrid' \({ENV_BACKEND}=hybrid\) cannot serve this model in "
                                         r"EXTEND on cpu: excluded by the caller$"):
        compose_selected(MHA, device="cpu")


@pytest.mark.parametrize("value, line", [
    ("torch_native", f"{ENV_BACKEND}=torch_native: select() takes torch_native where it serves, else raises its "
                     "reason"),
    ("decode=torch_native,extend=flashinfr", f"{ENV_BACKEND}=decode=torch_native,extend=flashinfr: select() takes "
                                             "torch_native in DECODE, flashinfr in EXTEND; unknown: flashinfr "
                                             "(select() raises)"),
    ("verify=x", f"{ENV_BACKEND}=verify=x: unknown mode 'verify' (modes: extend, decode, target_verify, "
                 "draft_extend): select() raises this"),
])
def test_list_says_what_the_variable_forces(value, line, registry_with_favourite, monkeypatch, capsys):
    from attn_backends.check import cli
    monkeypatch.setenv(ENV_BACKEND, value)
    assert cli.main(["list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert max(map(len, out)) <= 100
    note = out[1] + (" " + out[2][2:] if out[2].startswith("  ") else "")     # wrapped at 100 columns
    assert note == line, out[:4]
    monkeypatch.delenv(ENV_BACKEND)
    assert cli.main(["list", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("backend ")   # unset: no such line
