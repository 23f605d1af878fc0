"""Issue #42's contract: the config's sliding window, layer types, softcap and sinks (validated with
the value and the limit), the layer records, the capabilities that declare them and the refusals:
a backend is offered only the features it declares (torch_native all; flashinfer all three, but
windows and sinks not with topk > 1, sinks not with a cap), so none runs a model wrongly."""
import dataclasses
import re

import pytest
import torch

from attn_backends import ForwardMode, ModelConfig, get_backend, registry, select
from attn_backends.backends.triton_backend import TritonBackend
from attn_backends.capabilities import Capabilities
from attn_backends.check import cli
from attn_backends.check.scenarios import make_memory, materialize
from attn_backends.config import FULL, SLIDING
from attn_backends.registry import builtin_names, get_backend_class

ALL = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND})


def _cfg(**kw):
    base = dict(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    return ModelConfig(**{**base, **kw})


GEMMA = dict(sliding_window=5, layer_types=(SLIDING, FULL), logit_softcap=50.0)


@pytest.mark.parametrize("kw, match", [
    (dict(sliding_window=0), r"sliding_window=0 must be an int >= 1"),
    (dict(sliding_window=2.5), r"sliding_window=2.5 must be an int >= 1"),
    (dict(sliding_window=True), r"sliding_window=True must be an int >= 1"),
    (dict(layer_types=(FULL,)), r"layer_types has 1 entries, the model 2 layers"),
    (dict(layer_types=(FULL, "local")), r"layer_types entry 'local' is neither 'full_attention' nor"),
    (dict(layer_types=(FULL, SLIDING)), r"layer 1 is 'sliding_attention' but sliding_window is None"),
    (dict(sliding_window=8, layer_types=(FULL, FULL)), r"sliding_window=8 but no layer of layer_types is"),
    (dict(logit_softcap=0.0), r"logit_softcap=0.0 must be finite and > 0"),
    (dict(logit_softcap=-1), r"logit_softcap=-1 must be finite and > 0"),
    (dict(logit_softcap=float("inf")), r"logit_softcap=inf must be finite and > 0"),
])
def test_config_errors_name_the_value_and_the_limit(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_layer_types_default_and_layer_records():
    assert _cfg().layer_types == (FULL, FULL) and _cfg().features() == ()
    mistral = _cfg(sliding_window=4096)             # Mistral: a window and no layer types, every layer
    assert mistral.layer_types == (SLIDING, SLIDING) and mistral.layer(1).window == 4096
    gemma = _cfg(**{**GEMMA, "layer_types": [SLIDING, FULL]})     # a list becomes a tuple: the config stays hashable
    hash(gemma)
    assert (gemma.layer(0).window, gemma.layer(1).window) == (5, None)
    assert gemma.layer(1).softcap == 50.0 and gemma.layer(1).sinks is None
    assert gemma.features() == ("windows", "softcap") and gemma.features(1) == ("softcap",)
    assert gemma.layer(0).features == {"windows", "softcap"} and _cfg().layer(0).features == frozenset()
    with pytest.raises(ValueError, match=r"layer_id=-1 outside 0..1"):
        select(gemma, mode=ForwardMode.DECODE, device="cpu", layer=-1)


def test_sinks_come_with_the_layer_record():
    cfg = _cfg(sinks=True)
    s = torch.tensor([1.0, -2.0, 30.0, 0.0])
    assert torch.equal(cfg.layer(0, sinks=s).sinks, s) and cfg.features(0) == ("sinks",)
    with pytest.raises(ValueError, match=r"layer 0: the config says sinks=True, sink logits missing"):
        cfg.layer(0)
    with pytest.raises(ValueError, match=r"layer 1: the config says sinks=False, sink logits given"):
        _cfg().layer(1, sinks=s)
    with pytest.raises(ValueError, match=r"sinks must be a float tensor \[num_q_heads=4\], got \(2,\)"):
        cfg.layer(0, sinks=s[:2])
    with pytest.raises(ValueError, match=r"sinks must be a float tensor \[num_q_heads=4\], got \(4,\)"):
        cfg.layer(0, sinks=torch.arange(4))
    assert cfg.layer(0, sinks=s) == cfg.layer(0, sinks=s.clone())    # a weight is not compared


@pytest.mark.parametrize("kw, words", [
    (dict(sliding_window=7), "sliding windows (w=7) not supported"),
    (dict(logit_softcap=30.0), "logit softcapping (c=30.0) not supported"),
    (dict(sinks=True), "attention sinks not supported"),
    (dict(**GEMMA, sinks=True), "sliding windows (w=5), attention sinks, logit softcapping (c=50.0) not supported"),
])
def test_a_backend_that_does_not_declare_a_feature_is_refused_with_the_reason(kw, words):
    plain = Capabilities(modes=ALL)
    assert plain.refusal(_cfg(**kw), ForwardMode.DECODE) == words
    assert Capabilities(modes=ALL, windows=True, sinks=True, softcap=True).refusal(_cfg(**kw)) is None
    mla = _cfg(num_kv_heads=1, head_dim=576, is_mla=True, **kw)
    assert Capabilities(modes=ALL, mha=False, mla=True).refusal(mla) == words + " (no MLA model uses them)"


@pytest.mark.parametrize("name", [n for n in builtin_names() if n != "torch_native"])
def test_every_builtin_but_the_reference_is_refused_the_features_it_does_not_declare(name):
    """A kernel that reads no window, cap or sink would ignore them: the backend is refused a model
    that uses one it does not declare. Each kind it serves, in a model it serves otherwise (so the
    feature is the reason)."""
    caps = get_backend_class(name).capabilities
    kinds = [dict(head_dim=128)] * caps.mha + [dict(num_kv_heads=1, head_dim=576, is_mla=True)] * caps.mla
    for kw in kinds:
        assert caps.refusal(_cfg(**kw, dtype=torch.bfloat16), device="cuda", sm=None) is None, (name, kw)
        for feat, flag, words in ((dict(sliding_window=3), "windows", "sliding windows"),
                                  (dict(logit_softcap=1.0), "softcap", "softcapping"),
                                  (dict(sinks=True), "sinks", "attention sinks")):
            why = caps.refusal(_cfg(**kw, **feat, dtype=torch.bfloat16), device="cuda", sm=None)
            assert (why is None) if getattr(caps, flag) else (why and words in why), (name, kw, feat, why)
    assert get_backend_class("torch_native").capabilities.features() == ("windows", "sinks", "softcap")


class PlainTriton(TritonBackend):
    """``triton`` declaring none of the features: a backend whose kernels would ignore them."""

    name = "triton_plain"
    capabilities = dataclasses.replace(TritonBackend.capabilities, windows=False, sinks=False, softcap=False)


@pytest.fixture
def plain(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")                # triton serves on this CPU
    monkeypatch.setitem(registry._extra, "triton_plain", f"{__file__}:PlainTriton")


def test_select_refuses_a_backend_without_the_feature_and_per_layer_takes_it(plain):
    gemma = _cfg(**{**GEMMA, "logit_softcap": None})
    choice = select(gemma, mode=ForwardMode.DECODE, device="cpu")
    assert get_backend_class(choice.name).capabilities.windows, choice.name
    assert choice.refused["triton_plain"] == "sliding windows (w=5) not supported"
    assert select(gemma, mode=ForwardMode.DECODE, device="cpu", backend="triton_plain", layer=1).name == "triton_plain"
    with pytest.raises(ValueError, match=r"cannot serve this model in DECODE for layer 0 on cpu: sliding windows"):
        select(gemma, mode=ForwardMode.DECODE, device="cpu", backend="triton_plain", layer=0)
    with pytest.raises(ValueError, match=r"'triton_plain' cannot serve this model on cpu: sliding windows \(w=5\)"):
        get_backend("triton_plain", gemma, make_memory(gemma, num_pages=8, max_reqs=2, max_context_len=64))


def test_forward_refuses_a_layer_record_its_backend_does_not_declare(plain):
    """A backend made for the full layers of a model with sliding ones is handed a sliding layer."""
    from attn_backends.check.scenarios import Scenario
    gemma = _cfg(**{**GEMMA, "logit_softcap": None})
    mem = make_memory(gemma, num_pages=8, max_reqs=2, max_context_len=64)
    be = get_backend("triton_plain", gemma, mem, layers=[1])
    m = materialize(Scenario(ForwardMode.DECODE, 1, [5]), mem, be.get_cuda_graph_seq_len_fill_value())
    be.init_forward_metadata(m.batch)
    q = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match=r"backend triton_plain does not declare windows, used by layer 0"):
        be.forward(q, None, None, gemma.layer(0), m.batch, save_kv_cache=False)
    assert be.forward(q, None, None, gemma.layer(1), m.batch, save_kv_cache=False).shape == (1, 4, 64)


def test_list_shows_what_each_backend_declares(capsys, builtin_registry):
    assert cli.main(["list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    blocks = out.split("\ntorch_native")[1]
    assert "attention: sliding windows, attention sinks, logit" in blocks
    fi_block = re.search(r"\nflashinfer .*?(?=\n\S)", out, re.S).group(0)
    assert "attention: sliding windows, attention sinks, logit softcapping" in fi_block, fi_block
    assert out.count("attention: sliding windows") == 3, out         # torch_native, triton and flashinfer


def test_features_refused_with_topk_and_their_reasons_compose_in_hybrid():
    """A backend serving windows but not with topk > 1 (flashinfer: its window counts query rows) is
    refused tree verify of a windowed model, with the reason; a hybrid over it inherits both."""
    from attn_backends.backends.hybrid import compose_capabilities
    rows = Capabilities(modes=ALL, topk_gt1=True, windows=True, softcap=True, topk_gt1_features=("softcap",),
                        why_not=(("windows", "rows, not depth"),))
    gemma = _cfg(**GEMMA)
    assert rows.refusal(gemma, ForwardMode.TARGET_VERIFY) is None
    assert rows.refusal(gemma, ForwardMode.TARGET_VERIFY, topk=4) == \
        "sliding windows (w=5) with topk=4 > 1 not supported: rows, not depth"
    assert rows.refusal(gemma, ForwardMode.TARGET_VERIFY, topk=4, layer=1) is None       # a full layer
    assert rows.refusal(_cfg(sinks=True)) == "attention sinks not supported"
    fi = get_backend_class("flashinfer").capabilities
    both = compose_capabilities({m: ("flashinfer", None) for m in ALL})
    assert (both.windows, both.sinks, both.softcap, both.topk_gt1_features, both.apart, both.why_not) == \
        (True, True, True, ("softcap",), (("sinks", "softcap"),), fi.why_not)
