"""The tiny models of issue #42.5: tiny-gemma2 (sliding and full layers alternating, softcap) and
tiny-gptoss (windowed and full layers alternating, sinks per head): EAGLE lossless on both in
float32 (chain and tree, graphs on), their features change the tokens, per-layer backends where
the one asked for lacks a layer's features (chosen from capabilities), ``generate --model``."""
import dataclasses
import random
import re
from dataclasses import replace

import pytest
import torch
from engine_reference import (
    assert_all_graphs,
    assert_matches,
    assert_no_leaks,
    greedy,
    make_cases,
    reference_model,
    run_cases,
)
from test_eagle import ALL_MODES, engine_for

from attn_backends import ForwardMode, registry
from attn_backends.backends.torch_native import TorchNativeBackend
from attn_backends.check import cli
from attn_backends.config import FULL, SLIDING
from attn_backends.registry import get_backend_class, select, unavailable_reason
from attn_backends_runtime.eagle import SpecConfig
from attn_backends_runtime.executor import layer_backend_names
from attn_backends_runtime.models import TINY_MODELS, TinyConfig
from attn_backends_runtime.request import SamplingParams

MODELS = {"tiny-gemma2": dict(page_size=16), "tiny-gptoss": dict(page_size=1)}
SPECS = {"chain": SpecConfig("eagle", 1, 3, 4, noise=0.1), "tree": SpecConfig("eagle3", 2, 3, 5, noise=0.1)}


def tiny(name: str, **kw):
    return TINY_MODELS[name](**{**MODELS[name], **kw})


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("name", list(MODELS))
def test_eagle_lossless_on_windows_sinks_softcap(name, spec):
    """Greedy EAGLE output == greedy plain decode token for token (float32, torch_native), with
    requests long enough to pass the windows (prompts 3-12 plus up to 16 tokens, windows 5 and 7);
    every mode replayed a graph."""
    tc = tiny(name)
    cases = make_cases(reference_model(tc), [16, 10, 13], seed=7)
    engine = engine_for(tc, SPECS[spec])
    assert_matches(run_cases(engine, cases, join_after=2), cases)
    assert_all_graphs(engine, ALL_MODES)
    assert_no_leaks(engine)


@pytest.mark.cuda
@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("name", list(MODELS))
def test_eagle_lossless_on_windows_sinks_softcap_cuda(name, spec):
    """The same on the GPU with real graphs on triton, which declares every feature (float32: the
    reference's margins hold; flashinfer takes no float32 nor head dim 16: the test below)."""
    tc = tiny(name)
    cases = make_cases(reference_model(tc, device="cuda"), [16, 10, 13], seed=7)
    engine = engine_for(tc, SPECS[spec], "triton", device="cuda")
    assert_matches(run_cases(engine, cases, join_after=2), cases)
    assert_all_graphs(engine, ALL_MODES)
    assert_no_leaks(engine)


GPU_FEATURES = {"tiny-gemma2": dict(sliding_window=37, layer_pattern=(SLIDING, FULL), logit_softcap=2.0),
                "tiny-gptoss": dict(sliding_window=37, layer_pattern=(SLIDING, FULL), sinks=True, page_size=1)}


@pytest.mark.cuda
@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("name", list(GPU_FEATURES))
def test_flashinfer_feature_models_bf16_replays(name, spec):
    """flashinfer on the two models' features at its sizes (bf16, head dim 128; window 37, not a
    page multiple, passed by requests of up to 160 tokens), the benchmark pairing of the bf16 EAGLE
    test: graphs replayed hundreds of times, every request finishes, nothing leaks, the acceptance
    stays high. Chain: flashinfer serves every layer (its window layout on the sliding ones); tree:
    the windowed layers and those with sinks go to a backend that serves them in trees, the others stay.
    An engine check, not the window's values (draft and target share the backend, so a consistent
    error could keep the acceptance): those are test_flashinfer_windows_gpu.py's, against
    torch_native, and ``check --device cuda``'s."""
    if unavailable_reason(get_backend_class("flashinfer"), "cuda"):
        pytest.skip(unavailable_reason(get_backend_class("flashinfer"), "cuda"))
    tc = TinyConfig.gpu_gqa(num_layers=2, **GPU_FEATURES[name])
    sc = SpecConfig("eagle", 1, 4, 5, draft_layers=1) if spec == "chain" else SpecConfig("eagle3", 2, 3, 5,
                                                                                           draft_layers=1)
    topk = 1 if spec == "chain" else 2
    names = layer_backend_names("flashinfer", tc.attention(), range(2), "cuda",
                                {ForwardMode.TARGET_VERIFY: topk, ForwardMode.DECODE: topk})
    moved = {"chain": [], "tree": [0] if name == "tiny-gemma2" else [0, 1]}[spec]     # gpt-oss: sinks in every layer
    assert [i for i, n in enumerate(names) if n != "flashinfer"] == moved, names
    engine = engine_for(tc, sc, "flashinfer", device="cuda", max_batch=4, buckets=(1, 2, 4), max_context_len=512,
                        token_buckets=(32, 128, 256), max_prefill_tokens=256, skippable_from=1)
    rng = random.Random(0)
    reqs = engine.generate([[rng.randrange(tc.vocab_size) for _ in range(rng.randint(8, 64))] for _ in range(16)],
                           SamplingParams(max_tokens=96))
    assert all(r.finish_reason == "length" and len(r.output) == 96 for r in reqs)
    # bf16 near ties flip a few drafts; the tree drafts 3 steps (at most 4 tokens a round), the chain 4
    assert engine.stats.mean_accept > (3.5 if spec == "chain" else 2.5), engine.stats.accept_hist
    assert_all_graphs(engine, ALL_MODES)
    assert engine.target.counts["verify"]["graph"] > 60
    assert_no_leaks(engine)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_features_change_the_tokens(name):
    """Each model's window, cap and sinks decide tokens: without them (the same weights and seed)
    greedy decoding differs, so the lossless test above covers them."""
    tc = tiny(name)
    plain = replace(tc, sliding_window=None, layer_pattern=None, logit_softcap=None)
    model, model_plain = reference_model(tc), reference_model(plain)
    if tc.sinks:                                                    # sinks off: the same weights, none read
        for b in model_plain.layers:
            b.layer = dataclasses.replace(b.layer, sinks=None)
        model_plain.config = replace(plain, sinks=False)
    prompt = list(range(3, 15))
    assert greedy(model, prompt, 16)[0] != greedy(model_plain, prompt, 16)[0]
    types = [b.layer.window is not None for b in model.layers]
    assert types == [True, False] and tc.attention().layer_types == (SLIDING, FULL)


def _declaring(*features):
    """A torch_native that declares only ``features``: a backend lacking the others."""
    caps = dataclasses.replace(TorchNativeBackend.capabilities, windows="windows" in features,
                               sinks="sinks" in features, softcap="softcap" in features)
    return type("Partial", (TorchNativeBackend,), {"name": "partial", "capabilities": caps})


@pytest.fixture
def partial(monkeypatch):
    """Register ``partial`` (a module-level class of this file) declaring what the test sets."""
    def make(*features):
        cls = _declaring(*features)
        monkeypatch.setattr(__import__(__name__), "Partial", cls, raising=False)
        monkeypatch.setitem(registry._extra, "partial", f"{__name__}:Partial")
        return cls
    return make


@pytest.mark.parametrize("name,declares,full_only", [("tiny-gemma2", ("softcap",), True),
                                                     ("tiny-gptoss", ("sinks",), True),
                                                     ("tiny-gptoss", ("windows", "sinks"), False)])
def test_layers_get_a_backend_that_has_their_features(partial, name, declares, full_only):
    """Asked for a backend that lacks the sliding layers' window, the engine runs those layers on
    one that declares it (what select(layer=) ranks first from capabilities) and the others on
    the one asked for, target and draft alike; the tokens are those of torch_native alone."""
    partial_cls = partial(*declares)
    tc = tiny(name)
    spec = SPECS["chain"]
    cases = make_cases(reference_model(tc), [12, 9], seed=3)
    engine = engine_for(tc, spec, backend="partial")
    other = engine.target.layer_names[0]          # what select ranks first for the sliding layer
    assert other != "partial" or not full_only
    assert get_backend_class(other).capabilities.features() == ("windows", "sinks", "softcap") or not full_only
    want = [other, "partial"] if full_only else ["partial", "partial"]
    assert [list(ex.layer_names.values()) for ex in engine.executors] == [want, want]
    assert [list(ex.layer_names) for ex in engine.executors] == [[0, 1], [2, 3]]     # the draft's pool layers
    kinds = [type(b) for b in engine.target.eager_backends] if full_only else [type(engine.target.eager_backends)]
    assert kinds == ([get_backend_class(other), partial_cls] if full_only else [partial_cls])
    assert_matches(run_cases(engine, cases), cases)
    assert_no_leaks(engine)


def test_layer_names_follow_capabilities_not_names(partial):
    """A backend that declares nothing of #42 keeps the plain layers only (the windowed one goes to
    what select ranks first, here triton on the interpreter); one declaring windows keeps every layer."""
    tc = tiny("tiny-gptoss", sinks=False)                    # windows only: layer 1 is plain
    cfg = tc.attention()
    modes = {m: 1 for m in TorchNativeBackend.capabilities.modes}
    partial()
    first = select(cfg, ForwardMode.DECODE, "cpu", layer=0).name
    assert first != "partial" and layer_backend_names("partial", cfg, range(2), "cpu", modes) == [first, "partial"]
    partial("windows")
    assert layer_backend_names("partial", cfg, range(2), "cpu", modes) == ["partial", "partial"]


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_model(capsys, name):
    """``generate --model`` for each, plain and EAGLE tree with graphs: the same tokens, every mode
    replayed, no eager fallback."""
    base = ["generate", "--model", name, "--backend", "torch_native", "--batch", "2", "--max-tokens", "12"]
    outs = []
    for extra in ([], ["--spec", "eagle", "--topk", "2"]):
        assert cli.main(base + extra) == 0
        out = capsys.readouterr().out
        outs.append(re.findall(r"^\[\d\] .*$", out, re.M))
        assert f"{name} on torch_native (cpu, float32, graphs)" in out
        assert re.search(r"  target (decode|verify) +[1-9]\d* / 0$", out, re.M), out
    assert outs[0] == outs[1] and len(outs[0]) == 2
    assert torch.float32 == TINY_MODELS[name]().dtype
