"""The registry: lazy entries, availability with reasons, select, third-party backends."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attn_backends import ForwardMode, ModelConfig, get_backend, list_backends, register, registry, select
from attn_backends.backends.torch_native import TorchNativeBackend
from attn_backends.check.scenarios import make_memory

ROOT = Path(__file__).resolve().parents[2]
BACKEND_SOURCE = textwrap.dedent("""
    from attn_backends.backends.torch_native import TorchNativeBackend

    class ThirdPartyBackend(TorchNativeBackend):
        name = "{name}"
""")
# A plugin that declares a preference (and, with mla=False, serves MHA/GQA models only).
RANKED_SOURCE = textwrap.dedent("""
    from dataclasses import replace
    from attn_backends.backends.torch_native import TorchNativeBackend

    def ranked(pref, mla=True):
        caps = replace(TorchNativeBackend.capabilities, preference=pref, mla=mla)
        return type(f"Pref{pref}", (TorchNativeBackend,), {"capabilities": caps, "name": f"pref{pref}"})

    Pref5, Pref0, PrefMinus1, MhaOnly9 = ranked(5), ranked(0), ranked(-1), ranked(9, mla=False)
""")


def mha_config(page_size=1):
    return ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=page_size)


def mla_config():
    return ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=1, is_mla=True,
                       kv_lora_rank=32, qk_rope_head_dim=8)


@pytest.fixture
def isolated_registry(monkeypatch):
    """Runtime registrations made by a test vanish after it."""
    monkeypatch.setattr(registry, "_extra", {})


@pytest.fixture
def third_party_dist(tmp_path, monkeypatch):
    assert registry.ENTRY_POINT_GROUP == "attn_backends.backends"
    """An installed-looking distribution (a dist-info with entry_points.txt) on sys.path."""
    pkg = tmp_path / "thirdparty_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "backend.py").write_text(BACKEND_SOURCE.format(name="thirdparty"))
    info = tmp_path / "thirdparty_attn-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-attn\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{registry.ENTRY_POINT_GROUP}]\nthirdparty = thirdparty_attn.backend:ThirdPartyBackend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "thirdparty"
    for mod in [m for m in sys.modules if m.startswith("thirdparty_attn")]:
        del sys.modules[mod]


def test_list_backends_names_every_builtin_with_a_reason_when_unavailable():
    infos = {i.name: i for i in list_backends("cpu")}
    assert {"torch_native", "triton", "triton_mla"} <= set(infos)
    assert infos["torch_native"].available and infos["torch_native"].reason is None
    for info in infos.values():
        assert info.available == (info.reason is None), info
        if not info.available:
            assert isinstance(info.reason, str) and info.reason.strip(), info


def test_get_backend_builds_the_reference_for_mha_and_mla():
    for cfg in (mha_config(), mla_config()):
        mem = make_memory(cfg, num_pages=8, max_reqs=2, max_context_len=16, fill=False)
        backend = get_backend("torch_native", cfg, mem)
        assert isinstance(backend, TorchNativeBackend) and backend.config is cfg


def test_get_backend_accepts_module_class_targets():
    cfg = mha_config()
    mem = make_memory(cfg, num_pages=8, max_reqs=2, max_context_len=16, fill=False)
    backend = get_backend("attn_backends.backends.torch_native:TorchNativeBackend", cfg, mem)
    assert isinstance(backend, TorchNativeBackend)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND])
@pytest.mark.parametrize("cfg", [mha_config(), mla_config()], ids=["mha", "mla"])
def test_select_returns_a_choice_and_a_reason_for_every_other_backend(cfg, mode):
    sel = select(cfg, mode=mode, device="cpu")
    names = {i.name for i in list_backends("cpu")}
    assert sel.name in names
    assert set(sel.refused) == names - {sel.name}
    assert all(isinstance(r, str) and r for r in sel.refused.values()), sel.refused
    chosen = {i.name: i for i in list_backends("cpu")}[sel.name]
    assert chosen.available and chosen.capabilities.refusal(cfg, mode, "cpu") is None
    if "triton" in names and sel.name != "triton":
        expected = "MHA/GQA only" if cfg.is_mla else ""
        assert expected in sel.refused["triton"]


def test_select_explains_when_nothing_fits(builtin_registry):
    with pytest.raises(ValueError, match=r"no backend can serve this model in IDLE on cpu"):
        select(mha_config(), mode=ForwardMode.IDLE, device="cpu")


def test_register_module_class_is_lazy_and_usable(isolated_registry, tmp_path, monkeypatch):
    (tmp_path / "late_backend_mod.py").write_text(BACKEND_SOURCE.format(name="late"))
    monkeypatch.syspath_prepend(str(tmp_path))
    register("late", "late_backend_mod:ThirdPartyBackend")
    assert "late_backend_mod" not in sys.modules            # nothing imported at register time
    info = {i.name: i for i in list_backends("cpu")}["late"]
    assert info.available and info.target == "late_backend_mod:ThirdPartyBackend"
    cfg = mha_config()
    mem = make_memory(cfg, num_pages=8, max_reqs=2, max_context_len=16, fill=False)
    assert type(get_backend("late", cfg, mem)).__name__ == "ThirdPartyBackend"
    monkeypatch.delitem(sys.modules, "late_backend_mod")


def test_register_rejects_a_target_without_class(isolated_registry):
    with pytest.raises(ValueError, match=r"must look like 'package.module:Class'"):
        register("x", "just_a_module")


def test_register_names_the_cause_when_the_class_cannot_load(isolated_registry):
    register("broken", "no_such_module_xyz:Backend")
    info = {i.name: i for i in list_backends("cpu")}["broken"]
    assert not info.available and "no_such_module_xyz" in info.reason


def test_third_party_backend_through_the_entry_point_group(third_party_dist):
    infos = {i.name: i for i in list_backends("cpu")}
    assert third_party_dist in infos, sorted(infos)
    assert infos[third_party_dist].available
    assert infos[third_party_dist].target == "thirdparty_attn.backend:ThirdPartyBackend"
    cfg = mla_config()
    mem = make_memory(cfg, num_pages=8, max_reqs=2, max_context_len=16, fill=False)
    assert type(get_backend(third_party_dist, cfg, mem)).__name__ == "ThirdPartyBackend"
    sel = select(cfg, mode=ForwardMode.DECODE, device="cpu")
    assert sel.name != "torch_native", sel          # the reference never wins over a plugin that serves
    assert sel.name == third_party_dist or third_party_dist in sel.refused


def test_third_party_backend_runs_through_the_suite(third_party_dist):
    suite = pytest.importorskip("attn_backends.check.suite",
                                reason="attn_backends.check.suite is not written yet")
    report = suite.run_suite(third_party_dist, device="cpu", cases=1, seed=3)
    assert report.ok, "\n".join(map(str, report.failures))


def test_importing_the_package_imports_no_backend_and_no_optional_dependency():
    code = textwrap.dedent("""
        import sys
        import attn_backends, attn_backends.check.cli
        bad = sorted(m for m in sys.modules
                     if m.startswith(("attn_backends.backends.", "flashinfer", "kernels", "triton")))
        print(",".join(bad))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "", f"importing attn_backends imported {out}"


# --------------------------------------------------------------------------- select's ranking

@pytest.fixture
def ranked_plugins(builtin_registry, tmp_path, monkeypatch):
    """Run-time registrations of torch_native copies that declare preferences 5, 0, -1 and 9 (MHA only)."""
    (tmp_path / "ranked_mod.py").write_text(RANKED_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield lambda name, cls: register(name, f"ranked_mod:{cls}")
    monkeypatch.delitem(sys.modules, "ranked_mod", raising=False)


def _serving(cfg, mode=ForwardMode.DECODE):
    return [i.name for i in list_backends("cpu") if i.available and i.capabilities.refusal(cfg, mode, "cpu") is None]


def test_select_takes_the_reference_last_and_fastest_builtin_first(builtin_registry):
    for cfg, fast in ((mha_config(), "triton"), (mla_config(), "triton_mla")):
        sel = select(cfg, mode=ForwardMode.DECODE, device="cpu")
        if fast in _serving(cfg):   # Triton serves on the CPU under TRITON_INTERPRET=1
            assert sel.name == fast
            assert "the reference" in sel.refused["torch_native"], sel.refused
        else:
            assert sel.name == "torch_native"


def test_select_prefers_any_plugin_that_serves_over_the_reference(ranked_plugins, monkeypatch):
    monkeypatch.setattr(registry, "_BUILTIN", {"torch_native": registry._BUILTIN["torch_native"]})
    ranked_plugins("minus1", "PrefMinus1")        # registered after torch_native, lowest preference
    sel = select(mla_config(), mode=ForwardMode.DECODE, device="cpu")
    assert sel.name == "minus1", sel
    assert sel.refused["torch_native"] == ("serves this too; ranked below minus1 "
                                           "(the reference, chosen only when no other backend serves)")


def test_select_ranks_by_declared_preference_then_registry_order(ranked_plugins):
    ranked_plugins("zero", "Pref0")
    ranked_plugins("five", "Pref5")
    ranked_plugins("mha9", "MhaOnly9")
    mha = select(mha_config(), mode=ForwardMode.DECODE, device="cpu")
    assert mha.name == "mha9"                                       # the highest preference that serves
    assert mha.refused["five"] == "serves this too; ranked below mha9 (preference 5 < 9)"
    mla = select(mla_config(), mode=ForwardMode.DECODE, device="cpu")
    assert mla.name == "five"                                       # mha9 does not serve MLA
    assert mla.refused["mha9"] == "MHA/GQA only, model is MLA"
    assert mla.refused["zero"] == "serves this too; ranked below five (preference 0 < 5)"


def test_select_breaks_a_preference_tie_by_registry_order(ranked_plugins):
    ranked_plugins("zero_a", "Pref0")
    ranked_plugins("zero_b", "Pref0")
    sel = select(mla_config(), mode=ForwardMode.DECODE, device="cpu")
    first = "triton_mla" if "triton_mla" in _serving(mla_config()) else "zero_a"   # built-ins come first
    assert sel.name == first
    assert sel.refused["zero_b"] == (f"serves this too; ranked below {first} "
                                     "(same preference 0, later in registry order)")


def test_a_plugin_does_not_win_a_mode_it_does_not_declare(ranked_plugins):
    ranked_plugins("five", "Pref5")
    assert select(mha_config(), mode=ForwardMode.DRAFT_EXTEND, device="cpu").name == "five"
    with pytest.raises(ValueError, match="no backend can serve this model in IDLE"):
        select(mha_config(), mode=ForwardMode.IDLE, device="cpu")


# --------------------------------------------------------------------------- loading a class

@pytest.mark.parametrize("target, message", [
    ("os:path", r"'os:path' is a module, not a subclass of attn_backends.AttentionBackend"),
    ("attn_backends.base:Capabilities", r"is a class Capabilities, not a subclass of attn_backends.AttentionBackend"),
    ("attn_backends.base:AttentionBackend", r"declares no `capabilities = Capabilities\(...\)`"),
    ("attn_backends.base:NoSuchName", r"cannot load backend class .*AttributeError: .*NoSuchName"),
    ("./no_such_file_xyz.py:Backend", r"cannot load .*FileNotFoundError: no file './no_such_file_xyz.py'"),
    ("nothing_like_a_target", r"neither a registered name nor 'module:Class'"),
])
def test_load_class_names_what_is_wrong(target, message):
    with pytest.raises(ValueError, match=message):
        registry.get_backend_class(target)


def test_load_class_from_a_file_path(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "my_attn.py").write_text(BACKEND_SOURCE.format(name="from_file"))
    monkeypatch.chdir(tmp_path)
    cls = registry.get_backend_class("sub/my_attn.py:ThirdPartyBackend")
    assert cls.name == "from_file" and issubclass(cls, TorchNativeBackend)
    assert registry.get_backend_class(f"{tmp_path}/sub/my_attn.py:ThirdPartyBackend") is cls   # loaded once
    for key in [k for k in sys.modules if k.startswith("attn_backends_file_") and "my_attn" in k]:
        monkeypatch.delitem(sys.modules, key)


def test_load_class_names_the_error_inside_a_file(tmp_path):
    bad = tmp_path / "broken_attn.py"
    bad.write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ValueError, match=r"ModuleNotFoundError: No module named 'no_such_dependency_xyz'"):
        registry.get_backend_class(f"{bad}:Backend")
    assert not [k for k in sys.modules if "broken_attn" in k]      # a failed load leaves no module behind


def test_a_builtin_or_registered_name_resolves_without_reading_the_installed_metadata(
        isolated_registry, third_party_dist, monkeypatch):
    """Built-ins and run-time registrations settle a name before the entry points are read (each
    read scans every installed distribution); the resolution is the one ``_entries`` gives."""
    register("triton", "attn_backends.backends.torch_native:TorchNativeBackend")   # overrides a built-in
    register("torch_native_again", "attn_backends.backends.torch_native:TorchNativeBackend")
    entries = registry._entries()
    reads = []
    real = registry._installed
    monkeypatch.setattr(registry, "_installed", lambda: reads.append(1) or real())
    assert registry.get_backend_class("torch_native") is TorchNativeBackend
    assert registry.get_backend_class("torch_native_again") is TorchNativeBackend
    assert registry.get_backend_class("triton") is TorchNativeBackend
    assert reads == []
    assert registry.get_backend_class(third_party_dist).__name__ == "ThirdPartyBackend"
    assert reads == [1]
    assert entries[third_party_dist] == "thirdparty_attn.backend:ThirdPartyBackend"
    for name, target in entries.items():
        assert registry._target(name) == target


# --------------------------------------------------------------------------- the order of reasons (issue #38 item 6)

MISSING_SOURCE = textwrap.dedent("""
    from dataclasses import replace
    from attn_backends import ForwardMode
    from attn_backends.backends.torch_native import TorchNativeBackend

    class NeedsPkg(TorchNativeBackend):
        name = "needs_pkg"
        capabilities = replace(TorchNativeBackend.capabilities, requires=("no_such_pkg_xyz",), min_sm=90,
                               modes=frozenset({ForwardMode.DECODE}), page_sizes=(16,), mla=False)
""")


@pytest.fixture
def needs_pkg(builtin_registry, tmp_path, monkeypatch):
    """A backend whose package is missing, that needs sm_90, and serves MHA DECODE at page size 16."""
    (tmp_path / "needs_pkg_mod.py").write_text(MISSING_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    register("needs_pkg", "needs_pkg_mod:NeedsPkg")
    yield "needs_pkg"
    monkeypatch.delitem(sys.modules, "needs_pkg_mod", raising=False)


def _bf16(**kw):
    import torch
    return ModelConfig(**{**dict(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                                 dtype=torch.bfloat16), **kw})


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_reason_that_holds_anywhere_comes_before_this_machines(device, builtin_registry):
    """flashinfer_mla for a GQA model was refused because flashinfer is not installed here:
    installing it would not help. The model's and the request's reasons come first."""
    import torch
    mla = ModelConfig(num_layers=1, num_q_heads=16, is_mla=True, page_size=16, dtype=torch.bfloat16)
    cases = [                       # (backend, model, mode, topk, the reason)
        ("flashinfer_mla", _bf16(), ForwardMode.DECODE, 1, "MLA only, model is MHA/GQA"),
        ("trtllm_mla", _bf16(), ForwardMode.DECODE, 1, "MLA only, model is MHA/GQA"),
        ("flashinfer", mla, ForwardMode.DECODE, 1, "MHA/GQA only, model is MLA"),
        ("flashinfer", _bf16(page_size=32), ForwardMode.DECODE, 1, "page_size=32 not in (1, 16, 64)"),
        ("flashinfer_mla", mla, ForwardMode.TARGET_VERIFY, 4, "topk=4 > 1 not supported: tree verify"),
        ("flashinfer", _bf16(dtype=torch.float32), ForwardMode.DECODE, 1, "dtype float32 not in (float16, bfloat16)"),
        ("flashinfer", _bf16(head_dim=96), ForwardMode.DECODE, 1, "head_dim=96 not in (64, 128, 256)"),
        ("hybrid", _bf16(page_size=32), ForwardMode.DECODE, 1, "page_size=32 not in (1, 16, 64)"),
        ("triton", mla, ForwardMode.DECODE, 1, "MHA/GQA only, model is MLA"),
    ]
    for name, cfg, mode, topk, want in cases:
        why = registry.refusal(name, cfg, mode, device, topk)
        assert why is not None and why.startswith(want), (name, device, why)
    if device == "cpu":             # what select() says, as the issue saw it
        assert select(_bf16(), ForwardMode.DECODE, device="cpu").refused["flashinfer_mla"] == \
            "MLA only, model is MHA/GQA"


def test_the_reasons_in_order_for_one_backend(needs_pkg, monkeypatch):
    """One backend, its reasons peeled one at a time: model kind, page size, mode, then the device
    kind, then this machine (the package, then the architecture)."""
    mla, mha = mla_config(), mha_config(page_size=16)
    assert registry.refusal(needs_pkg, mla, ForwardMode.DECODE, "cpu") == "MHA/GQA only, model is MLA"
    assert registry.refusal(needs_pkg, mha_config(page_size=1), ForwardMode.DECODE, "cpu") == "page_size=1 not in (16,)"
    assert registry.refusal(needs_pkg, mha, ForwardMode.EXTEND, "cpu") == "mode EXTEND not supported"
    assert select(mha, ForwardMode.DECODE, "cpu").refused[needs_pkg] == \
        "python package 'no_such_pkg_xyz' is not installed (pip install 'attn-backends[no_such_pkg_xyz]')"
    import dataclasses

    import needs_pkg_mod
    cls = needs_pkg_mod.NeedsPkg
    monkeypatch.setattr(cls, "capabilities", dataclasses.replace(cls.capabilities, requires=()))    # installed
    monkeypatch.setattr(registry.torch.cuda, "is_available", lambda: True)                       # on an sm_80
    monkeypatch.setattr(registry, "device_sm", lambda: 80)
    assert registry.refusal(needs_pkg, mha, ForwardMode.DECODE, "cuda") == "needs sm_90+, this GPU is sm_80"


def test_a_device_the_backend_does_not_declare_comes_before_a_missing_package(needs_pkg, monkeypatch):
    import dataclasses

    import needs_pkg_mod
    monkeypatch.setattr(needs_pkg_mod.NeedsPkg, "capabilities",
                        dataclasses.replace(needs_pkg_mod.NeedsPkg.capabilities, devices=("cuda",)))
    assert registry.refusal(needs_pkg, mha_config(page_size=16), ForwardMode.DECODE, "cpu") == \
        "device cpu not supported (needs cuda)"


def test_get_backend_gives_the_models_reason_first(builtin_registry):
    cfg = _bf16()
    mem = make_memory(cfg, num_pages=8, max_reqs=2, max_context_len=64, fill=False)
    with pytest.raises(ValueError, match=r"^backend 'flashinfer_mla' cannot serve this model on cpu: "
                                         r"MLA only, model is MHA/GQA$"):
        get_backend("flashinfer_mla", cfg, mem)
