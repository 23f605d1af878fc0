"""The fused prep (kernels/layout_prep.py) against the torch prep it replaces
(``write_canonical_pad`` then the uniform builder): every uniform mode, each bucket and raw_bs,
pad rows full of garbage (real request rows, huge lengths, real slots, NaN-like token values),
shuffled pages; every input and layout buffer must match bit for bit."""
import os
import random

import pytest
import torch

from attn_backends import CaptureHiddenMode, ForwardMode, GraphKey, LayoutError, SpecInfo
from attn_backends.check.scenarios import make_memory
from attn_backends.layout import prep_layout
from attn_backends.step import Step
from attn_backends_runtime.models import TinyConfig

CUDA = pytest.param("cuda", marks=pytest.mark.cuda, id="cuda")
NO_INTERPRETER = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
CPU = pytest.param("cpu", marks=pytest.mark.skipif(NO_INTERPRETER, reason="the CPU variant needs TRITON_INTERPRET=1"),
                   id="cpu")
MAX_BS = 8
N, TOPK, STEPS = 4, 2, 3


def _spec(kind: str, bs: int, device):
    if kind == "decode":
        return ForwardMode.DECODE, 1, None
    if kind == "draft_decode":
        return ForwardMode.DECODE, TOPK, SpecInfo(STEPS * TOPK + 1, TOPK, STEPS, draft_step=2)
    if kind == "verify":
        return ForwardMode.TARGET_VERIFY, N, SpecInfo(N, 1, N - 1)
    acc = torch.ones(bs, dtype=torch.int32, device=device)
    return ForwardMode.DRAFT_EXTEND, N, SpecInfo(N, 1, N - 1, accept_lens=acc)


def _plans(kind, bs, page_size, device):
    tc = TinyConfig(page_size=page_size)
    out = []
    for _ in range(2):                     # the same memory seed: identical twins
        mem = make_memory(tc.attention(), num_pages=96, max_reqs=8, max_context_len=128, seed=4, device=device)
        plan = Step(mem, fill=1, max_bs=MAX_BS, max_width=max(N, TOPK), tokens=True)
        mode, w, spec = _spec(kind, bs, device)
        key = GraphKey(mode, bs, w, CaptureHiddenMode.NULL)
        if spec is not None and spec.is_draft_decode:
            plan.seq_lens.fill_(w * spec.draft_step)
            plan.seq_lens_cpu.fill_(w * spec.draft_step)
        plan.capture(key, spec, bs)
        out.append((plan, key))
    return out


def _garbage(plan, key, raw, rng):
    """Real rows in 0..raw-1, garbage past them (what a runner leaves from an earlier replay)."""
    bs, w = key.bs, key.width
    step = plan.captured(key).spec.draft_step if plan.captured(key).spec is not None else 0
    need = w * max(step, 1)
    rows = torch.tensor([rng.randint(1, 7) for _ in range(bs)], dtype=torch.int32)
    seqs = torch.tensor([rng.randint(need, 128) for _ in range(bs)], dtype=torch.int32)
    seqs[raw:] = torch.tensor([rng.choice([10 ** 6, -5, 0, 127]) for _ in range(bs - raw)], dtype=torch.int32)
    plan.req_pool_indices[:bs] = rows.to(plan.req_pool_indices.device)
    plan.seq_lens[:bs] = seqs.to(plan.seq_lens.device)
    plan.seq_lens_cpu[:raw] = seqs[:raw]
    g = torch.Generator().manual_seed(rng.randint(0, 2 ** 31))
    plan.tokens[:, :bs * w] = torch.randint(-2 ** 40, 2 ** 40, (3, bs * w), generator=g).to(plan.tokens.device)
    plan.accept_lens[:bs] = torch.randint(-3, 9, (bs,), dtype=torch.int32, generator=g).to(plan.accept_lens.device)
    plan.raw_bs_dev.fill_(raw)
    for t in plan.buffers.tensors().values():
        t.fill_(True) if t.dtype == torch.bool else t.fill_(-7)        # poison the layout buffers


def _prep(plan, key, fused):
    entry = plan.captured(key)
    inp = plan._inputs(entry)
    prep_layout(inp, key.width, plan.tokens[:, :key.bs * key.width], entry.layout, fused=fused,
                max_bs=plan.max_bs, max_width=plan.max_width)          # the block sizes the plan uses
    return entry.layout


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["decode", "draft_decode", "verify", "draft_extend"])
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_fused_prep_equals_the_torch_prep(kind, page_size, device):
    for bs in (1, 3, 5, 8):                # buckets below the plan's max_bs: blocks wider than the rows
        (a, key), (b, key_b) = _plans(kind, bs, page_size, device)
        for raw in sorted({1, max(1, bs // 2), bs - 1 or 1, bs}):
            _garbage(a, key, raw, random.Random(raw * 31 + bs))
            _garbage(b, key_b, raw, random.Random(raw * 31 + bs))
            la, lb = _prep(a, key, fused=False), _prep(b, key_b, fused=True)
            ta, tb = a.tensors(), b.tensors()
            diff = [n for n in ta if not torch.equal(ta[n], tb[n])]
            assert not diff, f"{kind} bs={bs} raw={raw} page={page_size}: {diff}"
            assert (la.max_seq_len_q, la.max_seq_len_k) == (lb.max_seq_len_q, lb.max_seq_len_k)
            assert a.seq_lens[raw:bs].eq(a.captured(key).pad).all()


def test_fused_prep_refuses_a_tree_mask():
    from attn_backends.check.scenarios import verify_spec
    tc = TinyConfig(page_size=16)
    mem = make_memory(tc.attention(), num_pages=64, max_reqs=8, max_context_len=128, seed=2)
    plan = Step(mem, fill=1, max_bs=4, max_width=N, tokens=True)
    key = GraphKey(ForwardMode.TARGET_VERIFY, 4, N, CaptureHiddenMode.NULL)
    plan.capture(key, verify_spec(N, 4, random.Random(1), topk=2, steps=2), 4)
    with pytest.raises(LayoutError, match="no fused prep for TARGET_VERIFY with a tree mask"):
        _prep(plan, key, fused=True)


def test_uniform_prep_refuses_short_buffers():
    t = lambda n, dt=torch.int32: torch.zeros(n, dtype=dt)  # noqa: E731
    from attn_backends_kernels.layout_prep import uniform_prep
    with pytest.raises(ValueError, match=r"too small for bs=4, W=2: cu_seqlens_q 4 < 5"):
        uniform_prep(t((9, 64)), 16, 2, 2, t(4), t(4), t(1), t(4), t(4), t(4), t(4), t((4, 4)), t(5), t(16))
    with pytest.raises(ValueError, match=r"tokens \(3, 6\) < \(3, 8\)"):
        uniform_prep(t((9, 64)), 16, 2, 2, t(4), t(4), t(1), t(5), t(4), t(4), t(4), t((4, 4)), t(5), t(16),
                     tokens=t((3, 6), torch.int64))
