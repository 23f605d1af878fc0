"""Issue #11 deliverable 3: bad input, fuzzed. Hypothesis drives the public API (a backend's eager
and graph entry points, the graph runners, the KV memory) with wrong shapes, dtypes, devices,
out-of-range indices, exhausted pools and oversize batches. Each gets a clear error (its message
names the value) before any kernel runs; afterwards the same object is unchanged (fingerprints of
every tensor byte and host field) and produces, bit for bit, the output it produced before.

The objects are built once per module and reused across examples on purpose: every bad call is
made on an object that has already seen many others."""
import dataclasses
import functools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_nan_padding import _scenario  # noqa: I001 (a sibling test module)

from attn_backends import CaptureHiddenMode as H
from attn_backends import ForwardMode, GraphKey, KVCacheFullError, LayoutError, ModelConfig, get_backend
from attn_backends.check.scenarios import make_memory, materialize
from attn_backends.check.state import fingerprint, state_diff
from attn_backends_runtime.runner_base import RunnerRefusal
from attn_backends_runtime.testing.rig import Rig, RigSpec

CFG = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16)
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
MODES = ["decode", "verify_tree", "draft_extend"]
ERRORS = (LayoutError, ValueError, RunnerRefusal, KVCacheFullError)


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def corrupt(b, name: str, d: int, rows: int, ctx: int):
    """``(bad batch, regex of the error)``: batch ``b`` with one thing wrong, ``d >= 0`` its size."""
    rep = lambda **k: dataclasses.replace(b, **k)  # noqa: E731
    i = d % b.raw_bs
    req, seq = b.req_pool_indices.clone(), b.seq_lens.clone()
    if name == "seq_lens rows":
        return rep(seq_lens=seq[:d % b.batch_size]), r"seq_lens has shape"
    if name == "seq_lens_cpu rows":
        return rep(seq_lens_cpu=b.seq_lens_cpu[:d % b.batch_size]), r"seq_lens_cpu has shape"
    if name == "float request rows":
        return rep(req_pool_indices=req.float()), r"req_pool_indices.*dtype.*float"
    if name == "request row out of range":
        req[i] = rows + d if d % 2 else -1 - d
        return rep(req_pool_indices=req), r"req_pool_indices .* outside 0\.\.%d" % (rows - 1)
    if name == "seq_len over the context":
        seq[i] = ctx + 1 + d
        msg = r"seq_len=%d exceeds max_context_len=%d" % (ctx + 1 + d, ctx)
        return rep(seq_lens=seq, seq_lens_cpu=seq.clone()), msg
    if name == "seq_len below W":
        seq[i] = b.width - 1 - d
        return rep(seq_lens=seq, seq_lens_cpu=seq.clone()), r"request %d: seq_len=-?\d+ < %d" % (i, b.width)
    if name == "raw_bs over bs":
        return rep(raw_bs=b.batch_size + 1 + d), r"raw_bs=%d outside 1\.\.bs=%d" % (b.batch_size + 1 + d, b.batch_size)
    if name == "raw_bs zero":
        return rep(raw_bs=0), r"raw_bs=0 outside"
    if name == "seq_lens_cpu on another device":
        return rep(seq_lens_cpu=_meta(b.seq_lens_cpu)), r"seq_lens_cpu must be a host tensor"
    if name == "request rows on another device":
        return rep(req_pool_indices=_meta(req)), r"req_pool_indices is on meta"
    if name == "seq_lens disagree with the host copy":
        seq[i] += 1
        return rep(seq_lens=seq), r"seq_lens and seq_lens_cpu disagree"
    if name == "IDLE":
        return rep(forward_mode=ForwardMode.IDLE), r"IDLE"
    raise AssertionError(name)


CORRUPTIONS = ["seq_lens rows", "seq_lens_cpu rows", "float request rows", "request row out of range",
               "seq_len over the context", "seq_len below W", "raw_bs over bs", "raw_bs zero",
               "seq_lens_cpu on another device", "request rows on another device",
               "seq_lens disagree with the host copy", "IDLE"]


def _qkv(n: int):
    g = torch.Generator().manual_seed(n)
    return (torch.randn(n, CFG.num_q_heads, CFG.qk_dim, generator=g),
            torch.randn(n, CFG.num_kv_heads, CFG.qk_dim, generator=g),
            torch.randn(n, CFG.num_kv_heads, CFG.out_dim, generator=g))


@functools.lru_cache(maxsize=None)
def _backend_world(mode: str, graph: bool):
    """A backend, its memory, a good batch (eager, or captured then replayed) and its output."""
    mem = make_memory(CFG, num_pages=48, max_reqs=8, max_context_len=128, seed=5)
    be = get_backend("torch_native", CFG, mem)
    b = materialize(_scenario(mode, 4, [30, 9, 17], random.Random(2)), mem, 1).batch
    if graph:
        be.init_cuda_graph_state(4, 16)
        be.init_forward_metadata_capture_cuda_graph(b.graph_inputs())
    world = (mem, be, b, _qkv(b.num_tokens))
    return world + (_good(world),)


def _good(world):
    mem, be, b, (q, k, v) = world[:4]
    if not be.graph_steps:                 # eager world (no capture)
        be.init_forward_metadata(b)
    else:
        be.init_forward_metadata_replay_cuda_graph(b.graph_inputs())
    return be.forward(q, k, v, CFG.layer(0), b).clone()


def _refused(objs, call, match):
    before = [fingerprint(o) for o in objs]
    with pytest.raises(ERRORS, match=match):
        call()
    for o, f in zip(objs, before):
        diff = state_diff(f, fingerprint(o))
        assert not diff, f"the refused call changed {type(o).__name__}: {diff[:6]}"


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("mode", MODES)
@SETTINGS
@given(name=st.sampled_from(CORRUPTIONS), d=st.integers(0, 300))
def test_backend_refuses_bad_batches(mode, graph, name, d):
    """Replay preparation never reads device values (no host sync, I15): row indices and a
    device copy of seq_lens that disagrees with the host copy are validated eagerly and at capture
    only."""
    if graph and name in DEVICE_VALUES:
        return
    world = _backend_world(mode, graph)
    mem, be, b, _, want = world
    bad, match = corrupt(b, name, d, mem.req_to_token.shape[0], mem.max_context_len)
    if graph:
        call = lambda: be.init_forward_metadata_replay_cuda_graph(bad.graph_inputs())  # noqa: E731
        if name in ("raw_bs over bs", "raw_bs zero") or name.endswith("rows") and "seq_lens" in name:
            call = lambda: be.init_forward_metadata_replay_cuda_graph(  # noqa: E731
                dataclasses.replace(b.graph_inputs(), **_gi_fields(bad)))
    else:
        call = lambda: be.init_forward_metadata(bad)  # noqa: E731
    _refused([be, mem], call, match)
    assert torch.equal(_good(world), want), f"{name}: the output changed after a refused call"


def _gi_fields(bad) -> dict:
    return {"req_pool_indices": bad.req_pool_indices, "seq_lens": bad.seq_lens, "seq_lens_cpu": bad.seq_lens_cpu,
            "raw_bs": bad.raw_bs}


DEVICE_VALUES = ("request row out of range", "seq_lens disagree with the host copy")
FORWARD_FAULTS = ["q rows", "q heads", "q dim", "k rows", "out_cache_loc rows"]


@pytest.mark.parametrize("mode", MODES)
@SETTINGS
@given(name=st.sampled_from(FORWARD_FAULTS), d=st.integers(1, 5))
def test_forward_refuses_bad_tensors(mode, name, d):
    world = _backend_world(mode, False)
    mem, be, b, (q, k, v), want = world
    _good(world)
    n = q.shape[0]
    bq, bk, bv, bb = q, k, v, b
    if name == "q rows":
        bq = torch.randn(n + d, *q.shape[1:])
        match = r"q has %d rows" % (n + d)
    elif name == "q heads":
        bq, match = torch.randn(n, q.shape[1] + d, q.shape[2]), r"q has shape .* expected \[T, 4, 16\]"
    elif name == "q dim":
        bq, match = torch.randn(n, q.shape[1], q.shape[2] + d), r"q has shape .* expected \[T, 4, 16\]"
    elif name == "k rows":
        bk, match = k[:max(0, n - d)], r"save_kv_cache needs k and out_cache_loc with %d rows" % n
    else:       # the prepared batch itself, its slot column cut (another batch object is refused first)
        loc = b.out_cache_loc
        b.out_cache_loc = loc[:max(0, n - d)]
        match = r"save_kv_cache needs k and out_cache_loc with %d rows" % n
    try:
        _refused([be, mem], lambda: be.forward(bq, bk, bv, CFG.layer(0), bb), match)
    finally:
        if name == "out_cache_loc rows":
            b.out_cache_loc = loc
    assert torch.equal(_good(world), want)


@SETTINGS
@given(bs=st.integers(5, 64), width=st.integers(1, 12))
def test_graph_capture_refuses_oversize_keys(bs, width):
    mem, be, b, _, want = world = _backend_world("decode", True)
    gi = dataclasses.replace(b.graph_inputs(), key=GraphKey(ForwardMode.DECODE, bs, width))
    match = r"bs=%d exceeds the graph buffers' max_bs=4" % bs if bs > 4 else r"W=%d" % width
    _refused([be, mem], lambda: be.init_forward_metadata_capture_cuda_graph(gi), match)
    assert torch.equal(_good(world), want)


# --------------------------------------------------------------------------- runners

@functools.lru_cache(maxsize=None)
def _runner_world(kind: str):
    rig = Rig(RigSpec(kind, buckets=(2, 4), hidden=H.LAST, max_ctx=128))
    reqs = rig.new_requests(3, random.Random(4))
    good = rig.batch(reqs, hidden=H.LAST)
    return rig, good, rig.runner.run(good)


RUNNER_FAULTS = ["oversize batch", "float request rows", "float token ids", "token ids on another device",
                 "too few positions", "seq_len over the context", "hidden mode above the captured",
                 "input embeddings", "another mode"]


def bad_runner_batch(rig, good, name: str, d: int):
    """``(bad batch, regex)`` for a runner of ``rig`` whose good batch is ``good``."""
    rep = lambda **k: dataclasses.replace(good, **k)  # noqa: E731
    draft = rig.kind == "draft_decode"
    if name == "oversize batch":
        return rig.batch(rig.new_requests(5 + d % 4, random.Random(d))), r"bs=\d+ (outside 1\.\.|exceeds)"
    if name == "float request rows":
        return rep(req_pool_indices=good.req_pool_indices.float()), r"req_pool_indices has dtype torch.float32"
    if name == "float token ids":
        return rep(input_ids=good.input_ids.float()), r"input_ids has dtype torch.float32"
    if name == "token ids on another device":
        return rep(input_ids=_meta(good.input_ids)), r"input_ids is on meta"
    if name == "too few positions":
        if draft:
            return rep(input_ids=good.input_ids[:1]), r"input_ids has shape \(1,\), expected at least"
        return rep(positions=good.positions[:d % good.positions.shape[0]]), r"positions has shape"
    if name == "seq_len over the context":
        if draft:
            pre = good.prefix_lens_cpu + 128
            return rep(prefix_lens_cpu=pre, prefix_lens=pre.clone()), r"exceeds max_context_len=128"
        seq = good.seq_lens_cpu.clone()
        seq[d % good.raw_bs] = 129 + d
        return rep(seq_lens_cpu=seq, seq_lens=seq.clone()), r"seq_len=%d exceeds max_context_len=128" % (129 + d)
    if name == "hidden mode above the captured":
        return rep(capture_hidden_mode=H.FULL), r"hidden mode FULL exceeds the captured LAST"
    if name == "input embeddings":
        return rep(input_embeds=torch.zeros(1, rig.tc.hidden_size)), r"input embeddings"
    other = ForwardMode.TARGET_VERIFY if rig.mode != ForwardMode.TARGET_VERIFY else ForwardMode.DRAFT_EXTEND
    return rep(forward_mode=other), r"mode %s" % other.name


@pytest.mark.parametrize("kind", ["decode", "verify_tree", "draft_extend", "draft_decode"])
@settings(SETTINGS, max_examples=15)
@given(name=st.sampled_from(RUNNER_FAULTS), d=st.integers(0, 40))
def test_runner_refuses_bad_batches(kind, name, d):
    rig, good, want = _runner_world(kind)
    bad, match = bad_runner_batch(rig, good, name, d)
    assert not rig.runner.can_run(bad) or name == "seq_len over the context"
    _refused([rig.runner, rig.mem], lambda: rig.runner.run(bad), match)
    got = rig.runner.run(good)
    for f in ("logits", "hidden", "rows"):
        a, b = getattr(got, f), getattr(want, f)
        assert (a is None and b is None) or torch.equal(a, b), f"{name}: {f} changed after a refused run"


# --------------------------------------------------------------------------- the KV memory

@SETTINGS
@given(steps=st.lists(st.tuples(st.sampled_from(["request", "extend", "truncate", "free"]), st.integers(0, 90)),
                      min_size=1, max_size=25))
def test_kv_memory_refusals_change_nothing(steps):
    """Exhausted request rows, pages and context: each refusal raises before anything is written."""
    mem = make_memory(CFG, num_pages=6, max_reqs=3, max_context_len=64, seed=1, fill=False)
    rows = []
    for op, n in steps:
        before = fingerprint(mem)
        try:
            if op == "request":
                rows.append(mem.new_request())
            elif op == "extend" and rows:
                mem.extend(rows[n % len(rows)], n)
            elif op == "truncate" and rows:
                mem.truncate(rows[n % len(rows)], n)
            elif op == "free" and rows:
                mem.free_request(rows.pop(n % len(rows)))
        except ERRORS as e:
            assert str(e), f"{op}({n}) raised {type(e).__name__} without a message"
            diff = state_diff(before, fingerprint(mem))
            assert not diff, f"{op}({n}) raised {e} but changed {diff}"
