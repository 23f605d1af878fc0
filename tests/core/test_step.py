"""The step (issue #7): a step with L layers builds the canonical layout once, eagerly and at
replay, whatever the number of per-layer backend instances; the step alone pads, so garbage in the
pad rows of its inputs changes nothing; capture and replay hand views of the same step around."""
import dataclasses
import random

import pytest
import torch

import attn_backends.step.step as step_mod
from attn_backends import CaptureHiddenMode, ForwardMode, GraphKey, LayoutError, get_backend
from attn_backends.check.scenarios import Scenario, make_memory, materialize, random_tree_mask, verify_spec
from attn_backends.step import Step, eager_step
from attn_backends_runtime.full_graph import UniformGraphRunner
from attn_backends_runtime.models import TinyConfig, TinyModel
from attn_backends_runtime.runner_base import run_eager

LAYERS = 4
CUDA = pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")


@pytest.fixture
def builds(monkeypatch):
    """Counts calls of the layout builder from the steps (the runner's, or each backend's own)."""
    calls = []

    def counting(fn):
        def wrapper(*a, **k):
            calls.append(a[0].mode)
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(step_mod, "build_layout", counting(step_mod.build_layout))
    monkeypatch.setattr(step_mod, "prep_layout", counting(step_mod.prep_layout))        # the step's prep
    return calls


def _model(device="cpu"):
    tc = TinyConfig(num_layers=LAYERS, page_size=16)
    model = TinyModel(tc, device)
    mem = make_memory(tc.attention(), num_pages=64, max_reqs=8, max_context_len=128, seed=1, device=device)
    backends = [get_backend("torch_native", tc.attention(), mem) for _ in range(LAYERS)]
    return tc, model, mem, backends


def _decode_batch(mem, tc, prefixes, bs=None):
    m = materialize(Scenario(ForwardMode.DECODE, bs or len(prefixes), prefixes), mem, 1)
    m.batch.input_ids = torch.randint(0, tc.vocab_size, (m.batch.num_tokens,), device=mem.device)
    return m.batch


def test_eager_step_builds_once_for_all_layers(builds):
    tc, model, mem, backends = _model()
    batch = _decode_batch(mem, tc, [5, 40, 17])
    run_eager(model, backends, batch, 1)
    assert len(builds) == 1, f"{LAYERS} per-layer backends built the layout {len(builds)} times in one step"
    # the counter sees per-layer builds: without a step every instance builds its own
    builds.clear()
    for b in backends:
        b.init_forward_metadata(batch)
    assert len(builds) == LAYERS


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_replay_step_builds_once_for_all_layers(builds, device):
    tc, model, mem, backends = _model(device)
    runner = UniformGraphRunner(model, backends, mem, ForwardMode.DECODE, [2, 4])
    runner.capture()
    batch = _decode_batch(mem, tc, [3, 70, 9])
    builds.clear()
    before = runner.step.builds
    out = runner.run(batch)
    if device == "cpu":      # the prep "graph" is the builder run eagerly, once
        assert len(builds) == 1, f"one replay of {LAYERS} layers built the layout {len(builds)} times"
    else:                    # the prep graph replays once; Python builds nothing
        assert builds == []
    assert runner.step.builds == before + 1
    want = run_eager(model, backends, batch, 1)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-4)


def test_eager_plan_is_bound_to_its_batch():
    tc, model, mem, backends = _model()
    a, b = _decode_batch(mem, tc, [5, 6]), _decode_batch(mem, tc, [7])
    planned = eager_step(a, backends)
    backends[0].init_forward_metadata(planned)
    b.step = planned.step                          # a step built for another batch
    with pytest.raises(LayoutError, match="no layout for this batch"):
        backends[0].init_forward_metadata(b)


def test_a_copy_with_other_rows_gets_no_stale_layout():
    """A batch copied from a built one (``dataclasses.replace`` keeps its ``step``) with other
    request rows or lengths is refused, not served the first batch's layout; step ids and origins
    are unique across steps, so a plugin comparing ids never mistakes one step for another."""
    tc, model, mem, backends = _model()
    a, b = _decode_batch(mem, tc, [5, 6]), _decode_batch(mem, tc, [7, 9])
    built = eager_step(a, backends)
    backends[0].init_forward_metadata(built)
    for other in (dataclasses.replace(built, req_pool_indices=b.req_pool_indices),
                  dataclasses.replace(built, seq_lens=b.seq_lens, seq_lens_cpu=b.seq_lens_cpu)):
        with pytest.raises(LayoutError, match="no layout for this batch"):
            backends[0].init_forward_metadata(other)
    again = eager_step(a, backends)
    assert again.step.step_id != built.step.step_id and again.step.origin != built.step.origin


def test_a_backend_that_overrides_its_replay_method_gets_the_layout_first():
    """Replay work is read from the class: overriding ``_update`` or the replay method places the
    step's prep before the backends' replay (the plugin trap of #39 in another shape)."""
    from attn_backends.backends.torch_native import TorchNativeBackend
    from attn_backends.step import Prep, prep_placement

    class Replays(TorchNativeBackend):
        def init_forward_metadata_replay_cuda_graph(self, inputs):
            super().init_forward_metadata_replay_cuda_graph(inputs)

    tc, model, mem, backends = _model()
    assert prep_placement(backends) is Prep.IN_STEP_GRAPH
    assert prep_placement(backends + [Replays(tc.attention(), mem)]) is Prep.BEFORE_UPDATE


def _verify_plan(mem, n=4, max_bs=4):
    plan = Step(mem, fill=1, max_bs=max_bs, max_width=n, tokens=True)
    key = GraphKey(ForwardMode.TARGET_VERIFY, max_bs, n, CaptureHiddenMode.NULL)
    rng = random.Random(3)
    spec = verify_spec(n, max_bs, rng, topk=2, steps=2)
    plan.capture(key, spec, max_bs)                # the plan's initial inputs: a valid all-pad batch
    return plan, key, rng


def test_plan_pads_garbage_rows():
    """Rows past raw_bs hold a real request's row, a huge length, real KV slots, a wrong tree
    mask: the update writes canonical pads into the inputs and the layout equals the layout of
    the cleanly padded batch."""
    tc = TinyConfig(page_size=16)
    mem = make_memory(tc.attention(), num_pages=64, max_reqs=8, max_context_len=128, seed=2)
    plan, key, rng = _verify_plan(mem)
    n = key.width
    m = materialize(Scenario(ForwardMode.TARGET_VERIFY, 4, [30, 9], spec=verify_spec(n, 4, rng, topk=2, steps=2)),
                    mem, 1)
    b, raw = m.batch, m.batch.raw_bs
    plan.load(b.graph_inputs())
    plan.req_pool_indices[raw:] = m.rows[0]                       # a real request row
    plan.seq_lens[raw:] = 10 ** 6
    plan.tokens[:, raw * n:] = b.out_cache_loc[:n].repeat(2)[None]  # real slots, ids, positions
    plan.tree_mask(4, n)[raw:] = random_tree_mask(n, rng).logical_not()
    got = {k: v.clone() for k, v in plan.update(key, raw).layout.as_dict().items() if isinstance(v, torch.Tensor)}
    clean = Step(mem, fill=1, max_bs=4, max_width=n, tokens=True)
    clean.capture(key, b.spec_info, 4)
    clean.load(b.graph_inputs())
    want = clean.update(key, raw).layout.as_dict()
    for k, v in got.items():
        assert torch.equal(v, want[k]), f"{k}: garbage in the pad rows reached the layout"
    assert torch.equal(plan.tokens[:, raw * n:4 * n], torch.zeros(3, (4 - raw) * n, dtype=torch.int64))
    assert plan.req_pool_indices[raw:].eq(0).all() and plan.seq_lens[raw:].eq(n).all()
    tril = torch.tril(torch.ones(n, n, dtype=torch.bool))
    assert all(torch.equal(plan.tree_mask(4, n)[i], tril) for i in range(raw, 4))


def test_capture_and_replay_must_agree_on_the_plan():
    tc = TinyConfig(page_size=16)
    mem = make_memory(tc.attention(), num_pages=64, max_reqs=8, max_context_len=128, seed=2)
    plan, key, _ = _verify_plan(mem)
    be = get_backend("torch_native", tc.attention(), mem)
    be.init_cuda_graph_state(4, 16)
    view = plan.update(key, key.bs)
    gi = plan.graph_inputs(key, view)
    be.init_forward_metadata_capture_cuda_graph(gi)
    assert be.forward_metadata.layout is plan.captured(key).layout   # the step's views, no copy
    with pytest.raises(LayoutError, match="without a runner.s step"):
        be.init_forward_metadata_replay_cuda_graph(dataclasses.replace(gi, step=None))
    other = GraphKey(ForwardMode.TARGET_VERIFY, 2, key.width, CaptureHiddenMode.NULL)
    with pytest.raises(LayoutError, match="step view is for .* bs=2 .*, not .* bs=4"):
        be.init_forward_metadata_replay_cuda_graph(dataclasses.replace(gi, step=view._replace(key=other)))


@pytest.mark.parametrize("tokens", ["int64", "int32", "strided", "partial"])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_load_rows_writes_exactly_the_real_rows(tokens, device):
    """``load_rows`` copies request rows, seq_lens, raw_bs, the draft step and the three token
    rows: in one launch for int32 rows and contiguous int64 tokens (the tokens as int32 word
    pairs), and through the fallback for int32, strided or missing token sources; values near
    2**32 and negative ones catch a word-pair copy that drops or swaps a half."""
    tc = TinyConfig(page_size=16)
    mem = make_memory(tc.attention(), num_pages=64, max_reqs=8, max_context_len=128, seed=2, device=device)
    plan, key, rng = _verify_plan(mem)
    n, raw = key.width, 3
    plan.tokens.fill_(-7)
    before = plan.tokens.clone()
    req = torch.tensor([5, 2, 7, 1], dtype=torch.int32, device=device)          # one row more than raw_bs
    seq = torch.tensor([40, 9, 33, 12], dtype=torch.int32, device=device)
    big = torch.tensor([2 ** 32 + 3, -2, 2 ** 40 - 1, 7] * 3, dtype=torch.int64, device=device)
    src = [big + i for i in range(3)]
    if tokens == "int32":
        src = [(t % 1000).to(torch.int32) for t in src]
    elif tokens == "strided":
        src = [torch.stack([t, t], 1)[:, 0] for t in src]                     # stride 2: no int32 view
    elif tokens == "partial":
        src[1] = None
    plan.load_rows(key, raw, req, seq, seq.cpu(), tokens=src)
    assert plan.req_pool_indices[:raw].tolist() == req[:raw].tolist()
    assert plan.seq_lens[:raw].tolist() == seq[:raw].tolist() and plan.seq_lens_cpu[:raw].tolist() == [40, 9, 33]
    assert plan.raw_bs_dev.item() == raw
    for i, t in enumerate(src):
        want = before[i, :raw * n] if t is None else t[:raw * n].to(torch.int64)
        assert torch.equal(plan.tokens[i, :raw * n], want), f"token row {i} ({tokens})"
        assert torch.equal(plan.tokens[i, raw * n:], before[i, raw * n:]), f"token row {i}: rows past raw_bs written"


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_load_rows_of_steps_equals_load_rows_per_plan(device):
    """A multi-step draft loads every step's plan in one launch: the same bits as ``load_rows``
    plan by plan on a twin rig (input ids go to step 1 only); a step whose lengths are refused
    writes nothing in any plan."""
    from attn_backends.check.state import fingerprint, state_diff
    from attn_backends_runtime.testing.rig import Rig, RigSpec

    spec = RigSpec("draft_decode", topk=2, steps=3, buckets=(4,), device=device)
    joint, single = Rig(spec).runner, Rig(spec).runner
    key = next(iter(joint.graphs))
    raw, k, steps = 3, joint.topk, joint.num_steps
    req = torch.tensor([5, 2, 7, 1], dtype=torch.int32, device=device)
    seq = torch.tensor([40, 9, 33], dtype=torch.int32, device=device)[None, :] + \
        torch.tensor([[(s + 1) * k] for s in range(steps)], dtype=torch.int32, device=device)
    ar = torch.arange(raw * k, device=device)
    tok = [[ar + 2 ** 33 if s == 0 else None, ar * 3 - s, ar + 100 * s] for s in range(steps)]
    before = [fingerprint(p) for p in joint.steps]
    bad = seq.cpu().numpy().copy()
    bad[2, 1] = 1                                                   # step 3 needs seq_len >= topk * 3
    with pytest.raises(LayoutError, match="seq_len=1 < 6"):
        joint.steps.load_rows(key, raw, req, seq, bad, tok)
    with pytest.raises(LayoutError, match=r"3 steps: seq_lens, host, token rows \(3, 3, 2\)"):
        joint.steps.load_rows(key, raw, req, seq, seq.cpu().numpy(), tok[:2])
    assert [d for b, p in zip(before, joint.steps) for d in state_diff(b, fingerprint(p))] == []
    wide = torch.cat([seq.cpu(), seq.cpu()[:, :1]], 1).numpy()      # host rows past raw_bs are cut
    joint.steps.load_rows(key, raw, req, seq, wide, tok)
    for s, p in enumerate(single.steps):
        p.load_rows(key, raw, req, seq[s], seq[s].cpu(), tokens=tok[s])
    for s, (a, b) in enumerate(zip(joint.steps, single.steps)):
        assert a._loaded == b._loaded == (key, raw, s + 1)
        ta, tb = a.tensors(), b.tensors()
        assert all(torch.equal(ta[n], tb[n]) for n in ta), [n for n in ta if not torch.equal(ta[n], tb[n])]
        assert torch.equal(a.seq_lens_cpu, b.seq_lens_cpu)
        assert a.tokens[0, :raw * k].tolist() == (tok[0][0].tolist() if s == 0 else b.tokens[0, :raw * k].tolist())
