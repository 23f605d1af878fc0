"""Graph runners end to end: every runner kind x backend (torch_native, triton / triton_mla) x
GQA and MLA tiny models, on the eager graph stand-in (CPU) and on real CUDA graphs (``cuda``).

Data that hides bugs is not the default: raw_bs < bucket, shuffled pages, ragged accept
lengths, per-layer backend instances, replay data different from capture data. On the CPU
the replay is compared with the eager model forward of the unpadded batch (torch_native
1e-5 relative, triton under the interpreter 1e-4); on the GPU with bf16 and the triton
backends it must be bitwise equal to the eager forward of the same padded batch.
"""
import random

import pytest
import torch

from attn_backends import CaptureHiddenMode as H
from attn_backends import ForwardMode, SpecInfo
from attn_backends_runtime.runner_base import RunnerOutput, RunnerRefusal
from attn_backends_runtime.testing.runner_suite import (
    KINDS,
    Rig,
    RigSpec,
    check_case,
    compare,
    poisoned_pads,
    refresh_counts,
    refusal_batches,
)

CPU = pytest.param("cpu", id="cpu")
CUDA = pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)
MODELS = [pytest.param(False, id="gqa"), pytest.param(True, id="mla")]


def buckets(kind: str) -> tuple:
    return (8, 16) if kind == "piecewise" else (2, 4)


def make_rig(kind, backend, mla, device, **kw) -> Rig:
    bf16 = device == "cuda" and backend != "torch_native"
    spec = RigSpec(kind, backend, mla, kw.pop("buckets", buckets(kind)), device=device,
                   dtype=torch.bfloat16 if bf16 else torch.float32, **kw)
    return Rig(spec)


def tolerance(backend: str, device: str):
    """(tol, exact): bitwise vs the padded eager forward for bf16 triton on the GPU."""
    if device == "cuda":
        return (0.0, True) if backend != "torch_native" else (1e-4, False)
    return (1e-5 if backend == "torch_native" else 1e-4), False


def requests(rig: Rig, rng, raw: int):
    """``raw`` requests, fewer than the bucket they land in (piecewise: raw tokens < bucket)."""
    if rig.kind == "piecewise":
        return rig.new_requests(raw, rng, tokens=max(rig.spec.buckets) - 1)
    return rig.new_requests(raw, rng)


def assert_same(got, want, tol, what):
    msgs = compare(got, want, tol, what)
    assert not msgs, "\n".join(msgs)


# ----------------------------------------------------------------------------- every kind x backend x model

# Every kind x backend x model on each device, except that the interpreter (triton on the CPU, a
# minute a case at MLA's dims) takes one model per kind, alternating, so that both models and every
# kind still run there within CI's time; CUDA runs every pair.
RUNNER_CASES = [
    pytest.param(kind, backend, mla, device, id=f"{kind}-{backend}-{'mla' if mla else 'gqa'}-{device}",
                 marks=[pytest.mark.cuda] if device == "cuda" else [])
    for kind in KINDS for backend in ("torch_native", "triton") for mla in (False, True) for device in ("cpu", "cuda")
    if not (backend == "triton" and device == "cpu" and (KINDS.index(kind) + mla) % 2)]


@pytest.mark.parametrize("kind,backend,mla,device", RUNNER_CASES)
def test_runner_invariants(kind, backend, mla, device):
    """Replay == eager (raw_bs < bucket, ragged, shuffled), A/B/A, no aliasing, poisoned pad
    rows, batch invariance, can_run == replay (counted) with every refusal, per-layer fan-out, KV
    slots (I16), the hidden rule and the float64 reference. The captured hidden mode varies with
    the kind, so that refusing a higher one is exercised too."""
    captured = (H.NULL, H.LAST, H.FULL)[KINDS.index(kind) % 3]
    rig = make_rig(kind, backend, mla, device, page_order="shuffled", hidden=captured)
    tol, exact = tolerance(backend, device)
    failures = []
    check_case(rig, random.Random(7), lambda inv, msgs: failures.extend(f"{inv}: {m}" for m in msgs),
               tol=tol, exact=exact)
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------- single properties (torch_native on CPU, triton on GPU)

PROPS = [pytest.param("torch_native", "cpu", id="torch_native-cpu"),
         pytest.param("triton", "cuda", id="triton-cuda", marks=pytest.mark.cuda),
         pytest.param("torch_native", "cuda", id="torch_native-cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("backend,device", PROPS + [pytest.param("triton", "cpu", id="triton-cpu")])
@pytest.mark.parametrize("mla", MODELS)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_eager_across_layouts_and_buckets(kind, mla, backend, device):
    tol, exact = tolerance(backend, device)
    interpreter = backend == "triton" and device == "cpu"    # slow: one layout, one batch
    for order in ("interleaved",) if interpreter else ("shuffled", "interleaved", "reversed"):
        rig = make_rig(kind, backend, mla, device, page_order=order, page_size=1 if order == "reversed" else 16)
        rng = random.Random(hash(order) % 1000)
        for raw in (3,) if interpreter else (3, 1):  # buckets 4 and 2 (piecewise: token buckets 16, 8)
            reqs = requests(rig, rng, raw)
            if kind == "draft_extend":
                for i, q in enumerate(reqs):        # ragged, both extremes present
                    q.accept = [1, rig.spec.n, 2][i % 3]
            uniform = kind not in ("piecewise", "draft_decode")
            out = rig.runner.run(rig.batch(reqs, rig.bucket(reqs) if uniform else None, H.FULL))
            assert_same(out, rig.expected(reqs, H.FULL, exact), tol, f"{order} raw={raw}")


@pytest.mark.parametrize("backend,device", PROPS)
@pytest.mark.parametrize("mla", MODELS)
@pytest.mark.parametrize("kind", KINDS)
def test_history_aba_and_no_aliasing(kind, mla, backend, device):
    rig = make_rig(kind, backend, mla, device)
    rng = random.Random(1)
    a, b = requests(rig, rng, 3), requests(rig, rng, 2)
    out_a = rig.runner.run(rig.batch(a, hidden=H.FULL))
    kept = {k: v.clone() for k, v in vars(out_a).items() if isinstance(v, torch.Tensor)}
    rig.runner.run(rig.batch(b, hidden=H.FULL))
    for k, v in kept.items():
        assert torch.equal(getattr(out_a, k), v), f"{k} returned by replay A changed when B replayed"
    again = rig.runner.run(rig.batch(a, hidden=H.FULL))
    for k, v in kept.items():
        assert torch.equal(getattr(again, k), v), f"{k}: A, B, A gave a different A"


@pytest.mark.parametrize("backend,device", PROPS)
@pytest.mark.parametrize("mla", MODELS)
@pytest.mark.parametrize("kind", KINDS)
def test_hidden_modes_sliced_to_raw_rows(kind, mla, backend, device):
    rig = make_rig(kind, backend, mla, device)
    tol, exact = tolerance(backend, device)
    rng = random.Random(2)
    reqs = requests(rig, rng, 3)
    if kind == "draft_extend":
        for q, a in zip(reqs, (1, rig.spec.n, 2)):          # ragged valid rows, both extremes
            q.accept = a
    rows = {"draft_extend": len(reqs), "draft_decode": len(reqs) * rig.spec.topk,
            "piecewise": sum(len(q.ids) for q in reqs)}.get(kind, len(reqs) * max(rig.width, 1))
    # one rule for every runner: LAST the last valid row of each request, FULL every valid row
    spans = rig.row_spans(reqs)
    every = rig.eager_rows(reqs, padded=exact)
    want = {H.LAST: every[[s + c - 1 for s, c in spans]],
            H.FULL: every[[s + j for s, c in spans for j in range(c)]]}
    for mode, n in ((H.NULL, None), (H.LAST, len(reqs)), (H.FULL, sum(c for _, c in spans))):
        out = rig.runner.run(rig.batch(reqs, hidden=mode))
        assert out.logits.shape[0] == rows
        assert (out.hidden is None) if n is None else out.hidden.shape == (n, rig.tc.hidden_size), mode
        assert_same(out, rig.expected(reqs, mode, exact), tol, mode.name)
        if n is not None:
            assert_same(RunnerOutput(out.hidden), RunnerOutput(want[mode]), tol, f"{mode.name} by the one rule")


@pytest.mark.parametrize("mla", MODELS)
@pytest.mark.parametrize("kind", KINDS)
def test_can_run_exactly_when_replayed(kind, mla):
    rig = make_rig(kind, "torch_native", mla, "cpu", hidden=H.LAST)
    rng = random.Random(3)
    r = rig.runner
    for raw in (1, 2, 3, 4) if kind != "piecewise" else (1, 2, 3):
        b = rig.batch(requests(rig, rng, raw))
        n = r.replay_count
        assert r.can_run(b)
        r.run(b)
        assert r.replay_count == n + 1
    seen = set()
    for what, b, needle in refusal_batches(rig, rng, requests(rig, rng, 2)):
        n = r.replay_count
        assert not r.can_run(b), what
        with pytest.raises(RunnerRefusal, match="(?i)" + needle.replace("*", r"\*")) as e:
            r.run(b)
        assert type(r).__name__ in str(e.value) and r.replay_count == n, what
        seen.add(what.split()[0])
    expect = {"piecewise": {"tokens", "TARGET_VERIFY", "hidden"}}.get(kind, {"bs=5", "input", "mode", "hidden"})
    assert expect <= seen, seen


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_refusal_messages_name_value_and_limit(kind):
    rig = make_rig(kind, "torch_native", False, "cpu", hidden=H.NULL)
    rng = random.Random(4)
    b = rig.batch(rig.new_requests(5, rng))
    with pytest.raises(RunnerRefusal, match="bs=5 outside 1..4, the largest captured bucket"):
        rig.runner.run(b)
    b = rig.batch(rig.new_requests(2, rng), hidden=H.LAST)
    with pytest.raises(RunnerRefusal, match="hidden mode LAST exceeds the captured NULL"):
        rig.runner.run(b)
    b.capture_hidden_mode, b.input_embeds = H.NULL, torch.zeros(b.num_tokens, rig.tc.hidden_size)
    with pytest.raises(RunnerRefusal, match="input embeddings"):
        rig.runner.run(b)
    if kind == "verify":
        b.input_embeds, b.spec_info = None, SpecInfo(4, 1, 3)
        with pytest.raises(RunnerRefusal, match="spec N=4, topk=1 differs from the captured N=3"):
            rig.runner.run(b)


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("mla", MODELS)
def test_piecewise_embeds_pass_through(mla, device):
    backend = "triton" if device == "cuda" else "torch_native"
    rig = make_rig("piecewise", backend, mla, device)
    tol, exact = tolerance(backend, device)
    rng = random.Random(5)
    reqs = requests(rig, rng, 3)
    g = torch.Generator().manual_seed(0)
    for q in reqs:
        q.embeds = torch.randn(len(q.ids), rig.tc.hidden_size, generator=g).to(device=device, dtype=rig.tc.dtype)
    b = rig.batch(reqs, hidden=H.LAST)
    assert rig.runner.can_run(b)
    out = rig.runner.run(b)
    assert torch.equal(out.input_embeds, b.input_embeds) and out.input_embeds.data_ptr() != b.input_embeds.data_ptr()
    assert out.hidden.shape == (3, rig.tc.hidden_size)
    assert_same(out, rig.expected(reqs, H.LAST, exact), tol, "piecewise with input embeddings")
    ids_only = rig.runner.run(rig.batch(requests(rig, rng, 1), hidden=H.NULL))
    assert ids_only.input_embeds is None and ids_only.hidden is None


def test_piecewise_refuses_verify_and_uncaptured_hidden():
    rig = make_rig("piecewise", "torch_native", False, "cpu", hidden=H.NULL)
    b = rig.batch(requests(rig, random.Random(6), 2))
    verify = type(b)(**{**vars(b), "forward_mode": ForwardMode.TARGET_VERIFY, "spec_info": SpecInfo(2, 1, 1)})
    with pytest.raises(RunnerRefusal, match="TARGET_VERIFY: the piecewise runner runs EXTEND only"):
        rig.runner.run(verify)
    b.capture_hidden_mode = H.FULL
    assert not rig.runner.can_run(b)
    with pytest.raises(RunnerRefusal, match="hidden mode FULL exceeds the captured NULL"):
        rig.runner.run(b)
    assert rig.runner.replay_count == 0


@pytest.mark.parametrize("backend,device", PROPS)
@pytest.mark.parametrize("mla", MODELS)
@pytest.mark.parametrize("kind", KINDS)
def test_per_layer_backends_refreshed_every_replay(kind, mla, backend, device):
    """I12: two distinct instances in the 2-layer model (per draft step too), each refreshed
    once per replay; replay data differs from capture data, so a stale one gives wrong output."""
    rig = make_rig(kind, backend, mla, device)
    tol, exact = tolerance(backend, device)
    instances = rig.flat(rig.backends)
    assert len(instances) == rig.tc.num_layers * (rig.spec.steps if kind == "draft_decode" else 1)
    rng = random.Random(8)
    for raw in (3, 2, 1):
        reqs = requests(rig, rng, raw)
        with refresh_counts(instances) as counts:
            out = rig.runner.run(rig.batch(reqs, hidden=H.FULL))
        assert sorted(counts.values()) == [1] * len(instances), counts
        assert_same(out, rig.expected(reqs, H.FULL, exact), tol, f"raw={raw}")


@pytest.mark.parametrize("backend,device", PROPS)
@pytest.mark.parametrize("mla", MODELS)
@pytest.mark.parametrize("kind", KINDS)
def test_pad_rows_do_not_reach_real_rows(kind, mla, backend, device):
    """I7: pad-row static inputs poisoned (other tokens, positions, masks, accept lengths)
    right before the replay leave the real rows bit-identical."""
    rig = make_rig(kind, backend, mla, device)
    rng = random.Random(9)
    reqs = requests(rig, rng, 3)
    b = rig.batch(reqs, hidden=H.FULL)
    clean = rig.runner.run(b)
    n_raw = b.num_tokens if kind == "piecewise" else len(reqs)
    with poisoned_pads(rig, n_raw, rng):
        poisoned = rig.runner.run(b)
    assert_same(poisoned, clean, 0.0, "poisoned pad rows")
