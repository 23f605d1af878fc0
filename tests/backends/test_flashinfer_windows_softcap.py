"""The ``flashinfer`` backend's sliding windows, softcap, sinks and refusals, through FlashInfer's real
wrapper code on the CPU with its kernels emulated in FlashInfer's own semantics
(tests/support/fi_emulation.py: the window counts query rows, ``kv + qo_len + window_left >=
kv_len + qo``; the cap is ``cap * tanh(q.k * sm_scale / cap)``; a module built without a flag
ignores its argument; the sink wrapper's ``AttentionSink`` variant reads its sinks, no mask bits, no
cap): what is checked is our plan arguments, against torch_native (itself checked against a float64
brute force in test_windows_sinks_softcap.py).

Models of two layers, full and sliding (two plan variants per step); shuffled pages, ragged
lengths, padded buckets; windows of 1, below W, not a page multiple, larger than the sequence;
caps small enough to bind; sinks of large magnitude; every mode the backend serves, eager and
replayed after poison. Tree verify and multi-branch draft decode: the full layer (cap) served, the
windowed layer and sinks refused with the reason, and the reason shown to hold (FlashInfer's row
window there differs from torch_native). Skipped where ``import flashinfer`` fails."""
import random

import pytest
import torch

pytest.importorskip("flashinfer", reason="flashinfer is not importable here (needs its wheels)")

import fi_emulation as E  # noqa: E402
from test_windows_sinks_softcap import SCENARIOS  # noqa: E402

from attn_backends import ForwardMode, ModelConfig  # noqa: E402
from attn_backends.backends import flashinfer_backend as fib  # noqa: E402
from attn_backends.backends.torch_native import TorchNativeBackend  # noqa: E402
from attn_backends.check.layout_checks import poison  # noqa: E402
from attn_backends.check.scenarios import make_memory, materialize  # noqa: E402
from attn_backends.config import FULL, SLIDING, AttentionLayer  # noqa: E402

SERVED = ("decode_padded", "extend_ragged", "verify_chain_n4", "draft_extend_n4", "draft_decode_chain")
MASKED = ("verify_tree_n8", "draft_decode_topk4")
# (window, cap): windows of 1, below W = 4, not a multiple of the page size 16, over the sequence
CASES = ((1, None), (3, 0.5), (5, None), (37, 2.0), (1000, 0.5))
SINKS = torch.tensor([9.0, -11.0, 0.5, 3.0, -2.0, 12.0, 0.0, -9.0])      # per query head, large magnitudes


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    E.install(monkeypatch)


def _cfg(window, cap, group=4, ps=16, sinks=False):
    return ModelConfig(num_layers=2, num_q_heads=2 * group, num_kv_heads=2, head_dim=64, page_size=ps,
                       dtype=torch.bfloat16, sliding_window=window, logit_softcap=cap, sinks=sinks,
                       layer_types=None if window is None else (FULL, SLIDING))


def _layer(cfg, lid):
    return cfg.layer(lid, sinks=SINKS[:cfg.num_q_heads] if cfg.sinks else None)


def _q(cfg, n, seed):
    g = torch.Generator().manual_seed(seed)       # scores of several units: a cap of 0.5 binds
    return (3 * torch.randn(n, cfg.num_q_heads, cfg.qk_dim, generator=g)).to(cfg.dtype)


def _rows(m):
    s = m.scenario
    return m.batch.raw_bs * s.width if s.width else sum(s.extend_lens)


def _eager(cfg, mem, scn_name, seed, layers=(0, 1)):
    """``[(layer, flashinfer, torch_native)]`` eager outputs of the scenario's real rows."""
    be, ref = E.EmulatedFlashInfer(cfg, mem), TorchNativeBackend(cfg, mem)
    m = materialize(SCENARIOS[scn_name](random.Random(seed))[0], mem, 1)
    be.init_forward_metadata(m.batch)
    ref.init_forward_metadata(m.batch)
    q, out = _q(cfg, m.batch.num_tokens, seed), []
    for lid in layers:
        got = be.forward(q, None, None, _layer(cfg, lid), m.batch, save_kv_cache=False)[:_rows(m)]
        want = ref.forward(q, None, None, _layer(cfg, lid), m.batch, save_kv_cache=False)[:_rows(m)]
        out.append((lid, got.float(), want.float()))
    return out


def _close(pairs, what):
    for lid, got, want in pairs:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=lambda m: f"{what}, layer {lid}: {m}")


@pytest.mark.parametrize("group,modes,cases", [(1, SERVED[-1:] + SERVED[:1], CASES[::2]), (4, SERVED, CASES)],
                         ids=["cuda-core-decode", "tensor-core-decode-and-prefill"])
def test_windows_and_caps_equal_torch_native_in_every_served_mode(group, modes, cases):
    """GQA group 1 runs W = 1 on the CUDA-core decode kernel, group 4 on the prefill kernels."""
    for i, (window, cap) in enumerate(cases):
        cfg = _cfg(window, cap, group)
        mem = make_memory(cfg, num_pages=300, max_reqs=16, max_context_len=256, seed=i)
        for name in modes:
            _close(_eager(cfg, mem, name, seed=i), f"{name} w={window} cap={cap}")


def test_page_size_one_and_cap_only_models():
    for cfg in (_cfg(5, 0.5, ps=1), _cfg(None, 0.5)):
        mem = make_memory(cfg, num_pages=1500 if cfg.page_size == 1 else 300, max_reqs=16, max_context_len=256,
                          seed=2)
        for name in ("decode_padded", "verify_chain_n4", "extend_ragged"):
            _close(_eager(cfg, mem, name, seed=3), f"{name} ps={cfg.page_size} w={cfg.sliding_window}")


@pytest.mark.parametrize("window", [None, 3, 37])
def test_sinks_with_windows_equal_torch_native_in_every_served_mode(window):
    """gpt-oss's kind: sinks on every layer, windows on some: the sink wrapper (W = 1 too)."""
    cfg = _cfg(window, None, sinks=True)
    mem = make_memory(cfg, num_pages=300, max_reqs=16, max_context_len=256, seed=5)
    for name in SERVED:
        _close(_eager(cfg, mem, name, seed=5), f"{name} w={window} sinks")


@pytest.mark.parametrize("name", MASKED)
def test_masked_modes_serve_the_capped_full_layer_and_refuse_windows_and_sinks(name):
    cfg = _cfg(3, 0.5)
    mem = make_memory(cfg, num_pages=300, max_reqs=16, max_context_len=256, seed=4)
    _close(_eager(cfg, mem, name, seed=4, layers=(0,)), name)
    with pytest.raises(ValueError, match=r"layer 1 window=3 in .* with topk > 1 not supported: FlashInfer's window "
                                         r"counts query rows"):
        _eager(cfg, mem, name, seed=4, layers=(1,))
    sinks = _cfg(None, None, sinks=True)
    with pytest.raises(ValueError, match=r"layer 0 sinks in .* with topk > 1 not supported: FlashInfer's sink "
                                         r"variant .* reads no custom mask"):
        _eager(sinks, make_memory(sinks, num_pages=300, max_reqs=16, max_context_len=256, seed=4), name, 4, (0,))


@pytest.mark.parametrize("name", MASKED)
def test_flashinfers_row_window_differs_from_torch_native_where_refused(name, monkeypatch):
    """Why the refusal: passing window_left in tree verify / multi-branch draft decode (as the
    plain modes do) windows by query row, not by the token's depth or step."""
    monkeypatch.setattr(fib.FlashInferBackend, "_variants", lambda self, lay: ((-1, 0.0, False), (2, 0.0, False)))
    monkeypatch.setattr(fib.FlashInferBackend, "_variant", lambda self, layer, lay: (2 if layer.window else -1, 0.0,
                                                                                     False))
    cfg = _cfg(3, None)
    mem = make_memory(cfg, num_pages=300, max_reqs=16, max_context_len=256, seed=4)
    (_, got, want), = _eager(cfg, mem, name, seed=4, layers=(1,))
    assert (got - want).abs().max() > 0.1, "FlashInfer's row-based window matched the positions"


def test_capabilities_refuse_windowed_or_sink_topk_and_sinks_with_a_cap_with_the_reason():
    caps = fib.FlashInferBackend.capabilities
    gemma, oss, both = _cfg(5, 30.0), _cfg(5, None, sinks=True), _cfg(None, 30.0, sinks=True)
    assert caps.features() == ("windows", "sinks", "softcap")
    assert caps.refusal(gemma, ForwardMode.TARGET_VERIFY, device="cuda", sm=90) is None
    assert caps.refusal(oss, ForwardMode.TARGET_VERIFY, device="cuda", sm=90) is None
    assert caps.refusal(gemma, ForwardMode.TARGET_VERIFY, device="cuda", sm=90, topk=4) == \
        f"sliding windows (w=5) with topk=4 > 1 not supported: {fib.ROWS_NOT_DEPTH}"
    assert caps.refusal(gemma, ForwardMode.TARGET_VERIFY, device="cuda", sm=90, topk=4, layer=0) is None  # full
    assert caps.refusal(oss, ForwardMode.DECODE, device="cuda", sm=90, topk=4, layer=0) == \
        f"attention sinks with topk=4 > 1 not supported in layer 0: {fib.SINK_NO_MASK}"
    assert caps.refusal(both, device="cuda", sm=90) == \
        f"attention sinks with logit softcapping (c=30.0) not supported: {fib.SINK_NO_CAP}"
    mem = make_memory(both, num_pages=20, max_reqs=4, max_context_len=64)
    with pytest.raises(ValueError, match=r"backend fi_emulated: attention sinks with logit softcapping \(c=30.0\) "
                                         r"not supported: FlashInfer's sink variant applies no logits transform"):
        E.EmulatedFlashInfer(both, mem)


def test_a_layer_whose_window_the_config_does_not_give_is_refused():
    cfg = _cfg(5, None)
    mem = make_memory(cfg, num_pages=20, max_reqs=4, max_context_len=64)
    be = E.EmulatedFlashInfer(cfg, mem)
    m = materialize(SCENARIOS["decode_padded"](random.Random(0))[0], mem, 1)
    be.init_forward_metadata(m.batch)
    layer = AttentionLayer(1, 8, 2, 64, 64, cfg.sm_scale, window=9)
    with pytest.raises(ValueError, match=r"layer 1 needs plan variant \(8, 0.0, False\), the step planned "
                                         r"\[\(-1, 0.0, False\), \(4, 0.0, False\)\]"):
        be.forward(_q(cfg, 4, 0), None, None, layer, m.batch, save_kv_cache=False)


@pytest.mark.parametrize("name,sinks", [("decode_padded", False), ("verify_chain_n4", False), ("decode_padded", True),
                                        ("draft_extend_n4", True)])
def test_replays_after_poison_equal_eager_and_torch_native(name, sinks):
    """Capture one batch, replay A, B, A with every graph buffer poisoned first (the light replan of
    both variants): each replay equals eager bitwise and torch_native within bf16."""
    cfg = _cfg(5, None if sinks else 0.5, sinks=sinks)
    mem = make_memory(cfg, num_pages=300, max_reqs=32, max_context_len=256, seed=6)
    be, eager, ref = E.EmulatedFlashInfer(cfg, mem), E.EmulatedFlashInfer(cfg, mem), TorchNativeBackend(cfg, mem)
    cap, a, b = (materialize(SCENARIOS[name](random.Random(s))[0], mem, 1) for s in (1, 2, 3))
    n = cap.batch.num_tokens
    be.init_cuda_graph_state(cap.batch.batch_size, n)
    be.init_forward_metadata_capture_cuda_graph(cap.batch.graph_inputs())
    # the window layout the sliding calls read is among the graph's buffers (poisoned, I2)
    (win,) = be.forward_metadata.windows.values()
    assert any(t is win.kv_indices for t in be.graph_buffers().values())
    for i, m in enumerate((a, b, a)):
        poison(be.graph_buffers())
        be.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
        assert all(p.light for p in be.forward_metadata.planned.values()), "a replay planned in full"
        eager.init_forward_metadata(m.batch)
        ref.init_forward_metadata(m.batch)
        q = _q(cfg, n, i % 2)
        for lid in (0, 1):
            got = be.forward(q, None, None, _layer(cfg, lid), cap.batch, save_kv_cache=False)[:_rows(m)]
            same = eager.forward(q, None, None, _layer(cfg, lid), m.batch, save_kv_cache=False)[:_rows(m)]
            want = ref.forward(q, None, None, _layer(cfg, lid), m.batch, save_kv_cache=False)[:_rows(m)]
            assert torch.equal(got, same), f"replay {i} layer {lid}: != eager"
            _close([(lid, got.float(), want.float())], f"replay {i}")


@pytest.mark.parametrize("group,sinks", [(1, False), (4, False), (4, True)],
                         ids=["cuda-core-decode", "tensor-core-decode", "sink-wrapper"])
def test_light_replan_hands_the_scheduler_the_window_plan_hands_it(group, sinks):
    """Per variant: the scheduler arguments of a replay's light ``replan`` equal the full
    ``plan()``'s on the same step (window_left among them)."""
    cap = None if sinks else 0.5
    cfg = _cfg(5, cap, group, sinks=sinks)
    mem = make_memory(cfg, num_pages=300, max_reqs=32, max_context_len=256, seed=7)
    for name in ("decode_padded", "verify_chain_n4"):
        be = E.EmulatedFlashInfer(cfg, mem)
        c, r = (materialize(SCENARIOS[name](random.Random(s))[0], mem, 1) for s in (1, 2))
        be.init_cuda_graph_state(c.batch.batch_size, c.batch.num_tokens)
        be.init_forward_metadata_capture_cuda_graph(c.batch.graph_inputs())
        be.init_forward_metadata_replay_cuda_graph(r.batch.graph_inputs())
        meta = be.forward_metadata
        host = be.graph_host_plan(meta.view, meta.key)
        assert set(meta.planned) == {(-1, cap or 0.0, sinks), (4, cap or 0.0, sinks)}
        for variant, planned in meta.planned.items():
            planned.call.replan(meta.view.layout, host)
            light = E.PLAN_ARGS[-1]
            planned.call.plan(meta.view.layout, host)
            full = E.PLAN_ARGS[-1]
            bad = [i for i, (x, y) in enumerate(zip(light, full)) if not (
                x is y or (torch.is_tensor(x) and torch.is_tensor(y) and torch.equal(x, y)) or
                (not torch.is_tensor(x) and x == y))]
            assert bad == [], f"{name} {variant}: scheduler arguments {bad} differ"
