"""The light replay plan of the FlashInfer backends (``replan``: FlashInfer's scheduler call alone,
after one full ``plan()`` per key at capture) and the per-layer page views, through FlashInfer's
real wrapper code on the CPU with its kernel modules emulated (tests/support/fi_emulation.py);
skipped where ``import flashinfer`` fails, with the reason.

* On a batch whose lengths differ from the capture's, ``replan`` hands the scheduler exactly the
  arguments the full ``plan()`` hands it (host lengths, workspaces, flags) and leaves the same
  state (plan info, the mask offsets); for every call kind.
* Replays take the light path (one full plan per key, at capture) and still equal eager on
  A, B, A (tests/backends/test_flashinfer_emulated.py's poisoned replays); a light path that
  kept the capture's lengths is caught there.
* The page views made once per layer follow the pool's tensors when a layer's tensor is replaced.
"""
import random

import pytest
import torch

pytest.importorskip("flashinfer", reason="flashinfer is not importable here (needs its wheels)")

import fi_emulation as E  # noqa: E402
from test_flashinfer_emulated import _config, _graph_case, _graph_scenarios, _q, _replay_mismatches  # noqa: E402

from attn_backends import ForwardMode  # noqa: E402
from attn_backends.backends import flashinfer_backend as fib  # noqa: E402
from attn_backends.backends import flashinfer_mla as fim  # noqa: E402
from attn_backends.backends.torch_native import TorchNativeBackend  # noqa: E402
from attn_backends.check.scenarios import (  # noqa: E402
    Scenario,
    draft_decode_spec,
    draft_extend_spec,
    make_memory,
    materialize,
    verify_spec,
)

CALLS = (fib.DecodeCall, fib.PrefillCall, fim.MLACall)


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    E.install(monkeypatch)


def _cases(mla, rng, bs=4):
    """(name, capture scenario, replay scenario): the replay's lengths differ from the capture's."""
    pre = lambda n, lo=0: [rng.randint(lo, 200) for _ in range(n)]  # noqa: E731
    out = [("decode", Scenario(ForwardMode.DECODE, bs, pre(bs)), Scenario(ForwardMode.DECODE, bs, pre(3))),
           ("verify", Scenario(ForwardMode.TARGET_VERIFY, bs, pre(bs), spec=verify_spec(3, bs, rng)),
            Scenario(ForwardMode.TARGET_VERIFY, bs, pre(2), spec=verify_spec(3, bs, rng))),
           ("draft_extend",
            Scenario(ForwardMode.DRAFT_EXTEND, bs, pre(bs), spec=draft_extend_spec(3, bs, 3, [1, 3, 2, 2])),
            Scenario(ForwardMode.DRAFT_EXTEND, bs, pre(3), spec=draft_extend_spec(3, bs, 3, [2, 1, 3])))]
    if not mla:
        tree = lambda: verify_spec(6, bs, rng, topk=4, steps=2)  # noqa: E731
        out += [("tree", Scenario(ForwardMode.TARGET_VERIFY, bs, pre(bs), spec=tree()),
                 Scenario(ForwardMode.TARGET_VERIFY, bs, pre(3), spec=tree())),
                ("draft_decode", Scenario(ForwardMode.DECODE, bs, pre(bs, 8), spec=draft_decode_spec(2, bs, 2)),
                 Scenario(ForwardMode.DECODE, bs, pre(3, 8), spec=draft_decode_spec(2, 3, 2)))]
    return out


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return a is b or (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b))
    return type(a) is type(b) and a == b


def _state(call):
    w = call.wrapper
    mask = call.buffers.get("mask_indptr") if isinstance(call.buffers, dict) else None
    return (list(w._plan_info), getattr(w, "_max_kv_len", None), None if mask is None else mask.clone())


def _light_and_full(cls, cfg, mem, cap, rep):
    """Capture ``cap``, replay ``rep`` (the light path), then hand the same step to ``replan``
    and to the full ``plan()``: their scheduler arguments and the state each leaves."""
    be = cls(cfg, mem)
    c, r = materialize(cap, mem, 1), materialize(rep, mem, 1)
    be.init_cuda_graph_state(c.batch.batch_size, c.batch.num_tokens)
    be.init_forward_metadata_capture_cuda_graph(c.batch.graph_inputs())
    be.init_forward_metadata_replay_cuda_graph(r.batch.graph_inputs())
    meta = be.forward_metadata
    (planned,) = meta.planned.values()          # a plain model: one plan variant
    call, lay = planned.call, meta.view.layout
    assert planned.light, "the replay after capture did not take the light path"
    host = be.graph_host_plan(meta.view, meta.key)
    assert host.kv_lens[:3].tolist() != c.batch.seq_lens_cpu[:3].tolist()    # other lengths than captured
    E.PLAN_ARGS.clear()
    call.replan(lay, host)
    light_args, light_state = E.PLAN_ARGS[-1], _state(call)
    E.PLAN_ARGS.clear()
    call.plan(lay, host)
    return light_args, light_state, E.PLAN_ARGS[-1], _state(call)


@pytest.mark.parametrize("mla,group", [(False, 1), (False, 4), (True, 0)], ids=["gqa1-cuda-cores", "gqa4-tc", "mla"])
def test_light_replan_hands_the_scheduler_what_plan_hands_it(mla, group):
    cfg = _config(mla, group)
    mem = make_memory(cfg, num_pages=900, max_reqs=64, max_context_len=256, seed=1)
    cls = E.EmulatedFlashInferMLA if mla else E.EmulatedFlashInfer
    for name, cap, rep in _cases(mla, random.Random(group + 7)):
        light, light_state, full, full_state = _light_and_full(cls, cfg, mem, cap, rep)
        assert len(light) == len(full), name
        # argument 2 is the pinned host staging buffer, which the full MLA plan allocates anew
        # (a backend object per plan): only its size and place matter
        bad = [i for i, (a, b) in enumerate(zip(light, full))
               if not (_same(a, b) or i == 2 and (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device))]
        assert bad == [], f"{name}: scheduler arguments {bad} differ: {[(light[i], full[i]) for i in bad]}"
        assert light_state[0] == full_state[0] and light_state[1] == full_state[1], name
        if full_state[2] is not None:
            assert torch.equal(light_state[2], full_state[2]), f"{name}: mask offsets differ"


def _counting(monkeypatch, counts):
    for cls in CALLS:
        for meth in ("plan", "replan"):
            real = getattr(cls, meth)

            def counted(self, layout, host, _real=real, _key=(cls.__name__, meth)):
                counts[_key] = counts.get(_key, 0) + 1
                return _real(self, layout, host)
            monkeypatch.setattr(cls, meth, counted)


@pytest.mark.parametrize("mla", [False, True], ids=["gqa-tree", "mla-verify"])
def test_replays_take_the_light_path_and_equal_eager(mla, monkeypatch):
    """One full plan per key (the capture; the eager backend's own calls plan in full), light
    replans for the three replays, and the poisoned replays of A, B, A still equal eager."""
    counts: dict = {}
    _counting(monkeypatch, counts)
    cfg = _config(mla)
    mem = make_memory(cfg, num_pages=600, max_reqs=40, max_context_len=256, seed=3)
    cls = E.EmulatedFlashInferMLA if mla else E.EmulatedFlashInfer
    pairs = _graph_case(cls, cfg, mem, _graph_scenarios(mla, random.Random(5)))
    assert all(torch.equal(got, want) for got, want in pairs)
    kind = "MLACall" if mla else "PrefillCall"
    assert counts.get((kind, "replan")) == 3, counts
    assert counts.get((kind, "plan")) == 1 + 3, counts          # the capture, and the 3 eager steps


@pytest.mark.parametrize("mla", [False, True], ids=["gqa-tree", "mla-verify"])
def test_planted_light_plan_on_the_captures_lengths_is_caught(mla, monkeypatch):
    """A light replan that keeps the host lengths it first saw: the replays read a stale schedule."""
    for cls in CALLS:
        real = cls.replan

        def stale(self, layout, host, _real=real):
            self.__dict__.setdefault("_first_host", host)
            return _real(self, layout, self._first_host)
        monkeypatch.setattr(cls, "replan", stale)
    assert _replay_mismatches(mla), "a light plan on stale lengths went unnoticed"


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_page_views_follow_a_replaced_pool_tensor(mla):
    cfg = _config(mla, 4)
    mem = make_memory(cfg, num_pages=200, max_reqs=8, max_context_len=128, seed=2)
    be, ref = (E.EmulatedFlashInferMLA if mla else E.EmulatedFlashInfer)(cfg, mem), TorchNativeBackend(cfg, mem)
    m = materialize(Scenario(ForwardMode.DECODE, 2, [40, 77]), mem, 1)
    q, layer = _q(cfg, 2, 0), cfg.layer(0)
    outs = []
    for _ in range(2):
        be.init_forward_metadata(m.batch)
        ref.init_forward_metadata(m.batch)
        got = be.forward(q, None, None, layer, m.batch, save_kv_cache=False)
        want = ref.forward(q, None, None, layer, m.batch, save_kv_cache=False)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        outs.append(got)
        names = ("kv",) if mla else ("k", "v")
        for n in names:                                   # a new tensor for layer 0, other values
            lst = getattr(mem.pool, n)
            lst[0] = torch.randn_like(lst[0].float()).to(lst[0].dtype)
    assert not torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_per_layer_instances_plan_once_a_step(mla):
    """A backend instance per layer on one runner's step (``runner.prepare``: every instance's replay
    update, I12) share one wrapper a step and plan it once: the first instance updated in a step plans
    (light at replays), the others only refresh. Eager steps likewise."""
    from attn_backends.step import Step, prep_placement
    cfg = _config(mla)
    mem = make_memory(cfg, num_pages=600, max_reqs=40, max_context_len=256, seed=1)
    cls = E.EmulatedFlashInferMLA if mla else E.EmulatedFlashInfer
    layers = [cls(cfg, mem) for _ in range(4)]
    rng = random.Random(3)
    cap, *reps = [materialize(Scenario(ForwardMode.DECODE, 4, [rng.randint(10, 200) for _ in range(n)]), mem, 1)
                  for n in (4, 3, 2)]
    for be in layers:
        be.init_cuda_graph_state(4, 4)
    step = Step(mem, 1, max_bs=4, max_width=1, prep=prep_placement(layers))
    gi = step.graph_inputs(cap.batch.graph_key(), step.capture_inputs(cap.batch.graph_inputs()))
    for be in layers:
        be.init_forward_metadata_capture_cuda_graph(gi)
    assert len({id(p.call) for be in layers for p in be.forward_metadata.planned.values()}) == 1, "a wrapper each"
    for m in reps:
        gi = step.graph_inputs(m.batch.graph_key(), step.update_inputs(m.batch.graph_inputs()))
        E.PLAN_ARGS.clear()
        for be in layers:
            be.init_forward_metadata_replay_cuda_graph(gi)
        assert len(E.PLAN_ARGS) == 1, f"{len(E.PLAN_ARGS)} scheduler calls for one replay of 4 instances"
    eager = Step(mem, 1).build(reps[0].batch)
    E.PLAN_ARGS.clear()
    for be in layers:
        be.init_forward_metadata(eager)
    assert len(E.PLAN_ARGS) == 1, f"{len(E.PLAN_ARGS)} plans for one eager step of 4 instances"
