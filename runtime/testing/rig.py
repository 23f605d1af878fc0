"""The rig of the runner checks: a tiny model, a KV memory with shuffled pages, per-layer
(and per-step) backend instances, one runner of a given kind, requests that can be assembled
into batches at any bucket, and the eager reference outputs (``Rig.expected``)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import torch

from attn_backends import CaptureHiddenMode, ForwardBatch, ForwardMode, SpecInfo, select_rows
from attn_backends.check.features import Features
from attn_backends.check.scenarios import dims_for, make_memory, random_tree_mask
from attn_backends.check.suite import fp8_scales
from attn_backends.config import FULL, SLIDING
from attn_backends.kinds import BATCH_KINDS
from attn_backends.layout import pad_seq_len
from attn_backends.registry import get_backend, get_backend_class
from attn_backends.step import eager_step, fill_of

from ..breakable import BreakableGraphRunner
from ..draft import DraftExtendRunner, DraftInput, MultiStepDraftRunner
from ..full_graph import UniformGraphRunner
from ..models import TinyConfig, TinyModel
from ..piecewise import PiecewiseRunner
from ..runner_base import RunnerOutput, run_eager, slice_hidden
from .reference import Float64Reference

I32, I64 = torch.int32, torch.int64


@dataclass(frozen=True)
class RunnerKind:
    """A runner class driven with one batch kind of ``attn_backends.kinds.BATCH_KINDS``."""
    name: str
    batch: str
    runner: type

    @property
    def mode(self) -> ForwardMode:
        return BATCH_KINDS[self.batch].mode

    @property
    def label(self) -> str:
        """The mode column of the runner suite's rows."""
        return f"runner:{self.name}"


RUNNER_KINDS = {k.name: k for k in (
    RunnerKind("decode", "decode", UniformGraphRunner),
    RunnerKind("verify", "verify_chain", UniformGraphRunner),
    RunnerKind("verify_tree", "verify_tree", UniformGraphRunner),
    RunnerKind("draft_extend", "draft_extend", DraftExtendRunner),
    RunnerKind("draft_decode", "draft_decode", MultiStepDraftRunner),
    RunnerKind("piecewise", "extend", PiecewiseRunner),
    RunnerKind("breakable_decode", "decode", BreakableGraphRunner),
    RunnerKind("breakable_verify", "verify_chain", BreakableGraphRunner),
)}
KINDS = tuple(RUNNER_KINDS)
H = CaptureHiddenMode


@dataclass
class Req:
    """One request of a rig: its KV row and the new tokens this forward writes."""
    row: int
    prefix: int
    loc: torch.Tensor                  # [t] int64 new slots (draft decode: [steps*topk], step-major)
    ids: torch.Tensor                  # [t] int64 (draft decode: [topk] first branch tokens)
    accept: int = 1                    # DRAFT_EXTEND
    mask: Optional[torch.Tensor] = None  # [N, N] bool, tree verify
    embeds: Optional[torch.Tensor] = None  # [t, hidden]: piecewise input embeddings (override ids)


@dataclass
class RigSpec:
    kind: str
    backend: str = "torch_native"      # "triton" becomes "triton_mla" for an MLA model
    mla: bool = False
    buckets: tuple = (2, 4)            # requests (piecewise: tokens)
    page_size: int = 16
    page_order: str = "shuffled"
    n: int = 3                         # N: verify and draft extend
    topk: int = 2                      # tree verify, draft decode
    steps: int = 2                     # draft decode
    hidden: CaptureHiddenMode = H.FULL  # the captured hidden mode
    per_layer: bool = True             # distinct backend instances per layer (I12)
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    max_ctx: int = 128
    seed: int = 0
    kv_dtype: Optional[torch.dtype] = None   # the KV cache's (None: dtype's), with check's fp8_scales
    features: Features = Features()          # the window of the sliding layers (even ids), cap and sinks of all

    def describe(self) -> str:
        return (f"kind={self.kind} backend={self.backend} {'MLA' if self.mla else 'GQA'} buckets={list(self.buckets)} "
                f"page={self.page_size} layout={self.page_order} N={self.n} topk={self.topk} steps={self.steps} "
                f"hidden={self.hidden.name} per_layer={self.per_layer} {self.device} {str(self.dtype)[6:]}"
                + (f" kv={str(self.kv_dtype)[6:]}" if self.kv_dtype is not None else "")
                + (f" {self.features.describe()}" if self.features.labels() else ""))


def backend_for(name: str, mla: bool) -> str:
    return "triton_mla" if mla and name == "triton" else name


class Rig:
    def __init__(self, spec: RigSpec, capture: bool = True) -> None:
        s = self.spec = spec
        self.kind, self.mode, self.device = s.kind, RUNNER_KINDS[s.kind].mode, torch.device(s.device)
        self.backend_name = backend_for(s.backend, s.mla)
        f = s.features
        self.tc = TinyConfig(is_mla=s.mla, page_size=s.page_size, dtype=s.dtype, seed=s.seed,
                             kv_dtype=s.kv_dtype, kv_scale=fp8_scales(s.mla),
                             sliding_window=f.window, layer_pattern=(SLIDING, FULL) if f.window else None,
                             logit_softcap=f.softcap, sinks=f.sinks is not None,
                             **dims_for(get_backend_class(self.backend_name).capabilities, s.mla))
        self.model = TinyModel(self.tc, s.device)
        for block in self.model.layers if f.sinks is not None else ():   # the drawn sinks (up to +-12)
            block.sinks.copy_(torch.tensor(f.sinks))
        cfg = self.tc.attention()
        self.mem = make_memory(cfg, num_pages=48 * (s.max_ctx // s.page_size) + 2, max_reqs=48,
                               max_context_len=s.max_ctx, page_order=s.page_order, seed=s.seed, device=s.device)
        self.backends, self.ref_backends = self._backends(), self._backends()  # the reference never shares state
        self.width = {"decode": 1, "breakable_decode": 1, "draft_decode": s.topk, "piecewise": 0}.get(s.kind, s.n)
        self.runner = self._runner(self.backends)
        if s.kind == "draft_decode":
            self.ref_draft = MultiStepDraftRunner(self.model, self.ref_backends, self.mem, s.topk, s.steps, [1])
        if capture:
            self.runner.capture()

    def _backends(self):
        n = self.tc.num_layers
        mk = lambda: get_backend(self.backend_name, self.tc.attention(), self.mem)  # noqa: E731
        one = lambda: [mk() for _ in range(n)] if self.spec.per_layer else mk()  # noqa: E731
        return [one() for _ in range(self.spec.steps)] if self.kind == "draft_decode" else one()

    def flat(self, backends) -> list:
        """Every distinct backend instance, and the sub-backends that composites (``hybrid``)
        run in this rig's mode (each is refreshed once per replay too: I12)."""
        bs = backends if isinstance(backends, list) else [backends]
        out = [b for x in bs for b in (x if isinstance(x, list) else [x])]
        out += [d for b in out for d in (b.sub_backends(self.mode) if hasattr(b, "sub_backends") else [])]
        return list({id(b): b for b in out}.values())

    def spec_template(self) -> Optional[SpecInfo]:
        s = self.spec
        if self.kind == "draft_extend" and s.topk > 1 and s.steps + 1 <= s.n <= s.steps * s.topk + 1:
            return SpecInfo(s.n, s.topk, s.steps)        # a tree's draft extend: N is not num_steps + 1
        if self.kind in ("verify", "breakable_verify", "draft_extend"):
            return SpecInfo(s.n, 1, s.n - 1)
        if self.kind == "verify_tree":
            return SpecInfo(s.n, s.topk, s.steps)
        return None

    def _runner(self, backends):
        s, m, mem = self.spec, self.model, self.mem
        if self.kind == "draft_decode":
            return MultiStepDraftRunner(m, backends, mem, s.topk, s.steps, s.buckets, s.hidden)
        if self.kind == "piecewise":
            return PiecewiseRunner(m, backends, mem, s.buckets, s.hidden)
        cls = RUNNER_KINDS[self.kind].runner
        return cls(m, backends, mem, self.mode, s.buckets, spec=self.spec_template(), capture_hidden_mode=s.hidden)

    @property
    def fill(self) -> int:
        return fill_of(self.flat(self.backends))

    # -- requests and batches
    def new_requests(self, count: int, rng: random.Random, tokens: Optional[int] = None) -> list:
        """``count`` requests with random prefixes (page-boundary biased); piecewise: at most
        ``tokens`` new tokens in all (default: the largest token bucket)."""
        s, mem = self.spec, self.mem
        if self.kind == "piecewise":
            budget = tokens or max(s.buckets)
            per = max(1, budget // count)
            new = [rng.randint(1, per) for _ in range(count)]
        else:
            new = [s.steps * s.topk if self.kind == "draft_decode" else self.width] * count
        lo = 1 if self.kind == "draft_decode" else 0
        ps = s.page_size
        pre = [min(max(lo, rng.choice([0, ps - 1, ps, ps + 1, 2 * ps + 1, rng.randint(0, s.max_ctx)])),
                   s.max_ctx - t) for t in new]
        rows = [mem.new_request() for _ in range(count)]
        left = list(pre)
        step = ps if s.page_order == "interleaved" else s.max_ctx   # interleaved: round robin, a page at a time
        while any(left):
            for i, r in enumerate(rows):
                k = min(left[i], step)
                if k:
                    mem.extend(r, k)
                    left[i] -= k
        reqs = []
        for r, p, t in zip(rows, pre, new):
            ids = torch.randint(0, self.tc.vocab_size, (s.topk if self.kind == "draft_decode" else t,),
                                generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
            mask = random_tree_mask(s.n, rng) if self.kind == "verify_tree" else None
            reqs.append(Req(r, p, mem.extend(r, t), ids.to(self.device), rng.randint(1, s.n), mask))
        return reqs

    def batch(self, reqs: list, bucket: Optional[int] = None, hidden=H.NULL):
        """The batch of ``reqs`` in this order, padded by the pad rule (layout.canonical_rows) to ``bucket``
        requests (uniform kinds; draft decode pads only for the eager reference)."""
        dev, raw = self.device, len(reqs)
        bs = bucket or raw
        pad = bs - raw
        z = lambda n: torch.zeros(n, dtype=I64, device=dev)  # noqa: E731
        if self.kind == "draft_decode":
            k, st = self.spec.topk, self.spec.steps
            pre = torch.tensor([r.prefix for r in reqs] + [0] * pad, dtype=I32)
            return DraftInput(torch.tensor([r.row for r in reqs] + [0] * pad, dtype=I32, device=dev), pre.to(dev), pre,
                              torch.cat([r.ids for r in reqs] + [z(pad * k)]),
                              torch.cat([r.loc.view(1, -1) for r in reqs] + [z(pad * st * k).view(pad, st * k)]),
                              capture_hidden_mode=hidden, pad_rows=pad)
        if self.kind == "piecewise":
            ext = torch.tensor([len(r.ids) for r in reqs], dtype=I32)
            seq = torch.tensor([r.prefix + len(r.ids) for r in reqs], dtype=I32)
            return ForwardBatch(ForwardMode.EXTEND, raw, torch.tensor([r.row for r in reqs], dtype=I32, device=dev),
                                seq.to(dev), seq, torch.cat([r.loc for r in reqs]),
                                torch.cat([torch.arange(r.prefix, r.prefix + len(r.ids), device=dev) for r in reqs]),
                                ext.to(dev), ext, capture_hidden_mode=hidden,
                                input_ids=torch.cat([r.ids for r in reqs]),
                                input_embeds=(torch.cat([r.embeds for r in reqs])
                                              if reqs[0].embeds is not None else None))
        w = self.width
        seq = torch.tensor([r.prefix + w for r in reqs] + [pad_seq_len(self.fill, w)] * pad, dtype=I32)
        spec = self.spec_template()
        if self.kind == "verify_tree":
            tril = torch.tril(torch.ones(w, w, dtype=torch.bool))
            spec.tree_mask = torch.stack([r.mask for r in reqs] + [tril] * pad).to(dev)
        elif self.kind == "draft_extend":
            spec.accept_lens = torch.tensor([r.accept for r in reqs] + [1] * pad, dtype=I32, device=dev)
        return ForwardBatch(self.mode, bs, torch.tensor([r.row for r in reqs] + [0] * pad, dtype=I32, device=dev),
                            seq.to(dev), seq, torch.cat([r.loc for r in reqs] + [z(pad * w)]),
                            torch.cat([torch.arange(r.prefix, r.prefix + w, device=dev) for r in reqs] + [z(pad * w)]),
                            spec_info=spec, capture_hidden_mode=hidden,
                            input_ids=torch.cat([r.ids for r in reqs] + [z(pad * w)]), raw_bs=raw)

    def bucket(self, reqs: list) -> int:
        n = sum(len(r.ids) for r in reqs) if self.kind == "piecewise" else len(reqs)
        return self.runner.bucket_for(n)

    # -- the reference
    def expected(self, reqs: list, hidden=H.NULL, padded: bool = False, float64: bool = False) -> RunnerOutput:
        """Eager model output of ``reqs`` on the reference backends: on the unpadded batch, or
        (``padded``) on the batch padded to the runner's bucket, which launches the same
        kernels as the replay (bitwise equal on the GPU). ``float64``: attention by the
        independent float64 reference (:mod:`.reference`) instead of the backend under test."""
        raw, m = len(reqs), self.model
        bucket = self.bucket(reqs) if padded else None
        backends = self._float64() if float64 else self.ref_backends
        if self.kind == "draft_decode":
            draft = MultiStepDraftRunner(m, backends, self.mem, self.spec.topk, self.spec.steps, [1]) if float64 \
                else self.ref_draft
            out = draft.run_eager(self.batch(reqs, bucket, hidden))
            n = raw * self.spec.topk
            h = None if out.hidden is None else out.hidden[:raw if hidden == H.LAST else n]   # padded: raw rows
            return RunnerOutput(out.logits[:n], h, rows=out.rows[:raw])
        if self.kind == "piecewise":
            b = self.batch(reqs, hidden=hidden)
            out = piecewise_eager(m, backends, b, bucket) if padded else run_eager(m, backends, b, 0)
            out.input_embeds = b.input_embeds     # passed through, cut to the raw tokens
            return out
        if self.kind == "draft_extend":
            b = self.batch(reqs, bucket, H.FULL)
            out = run_eager(m, backends, b, self.width)
            acc = b.spec_info.accept_lens[:raw]
            rows = select_rows(raw, self.width, acc)
            return RunnerOutput(out.logits[rows], slice_hidden(out.hidden, hidden, raw * self.width, self.width, acc),
                                rows=rows)
        return run_eager(m, backends, self.batch(reqs, bucket, hidden), self.width)

    def _float64(self):
        mk = lambda: Float64Reference(self.tc.attention(), self.mem)  # noqa: E731
        return [mk() for _ in range(self.spec.steps)] if self.kind == "draft_decode" else mk()

    def row_spans(self, reqs: list) -> list:
        """``(first row, valid rows)`` of each request in a forward's rows, from first principles:
        what the one hidden rule (LAST: the last valid row, FULL: every valid row) selects from."""
        if self.kind == "piecewise":
            ends = torch.tensor([len(r.ids) for r in reqs]).cumsum(0).tolist()
            return [(e - len(r.ids), len(r.ids)) for r, e in zip(reqs, ends)]
        w = self.spec.topk if self.kind == "draft_decode" else self.width
        return [(i * w, r.accept if self.kind == "draft_extend" else w) for i, r in enumerate(reqs)]

    def eager_rows(self, reqs: list, padded: bool = False) -> torch.Tensor:
        """The eager hidden states of every row of the raw requests (draft decode: its last step)."""
        if self.kind == "draft_extend":
            b = self.batch(reqs, self.bucket(reqs) if padded else None, H.FULL)
            return run_eager(self.model, self.ref_backends, b, self.width).hidden
        return self.expected(reqs, H.FULL, padded).hidden

    def per_request(self, out: RunnerOutput, reqs: list) -> list:
        """Each request's slice of ``out.logits`` (draft decode: with its tokens)."""
        if self.kind == "piecewise":
            ends = torch.tensor([len(r.ids) for r in reqs]).cumsum(0).tolist()
            return [out.logits[e - len(r.ids):e] for r, e in zip(reqs, ends)]
        w = 1 if self.kind == "draft_extend" else max(self.width, 1)
        parts = [out.logits[i * w:(i + 1) * w] for i in range(len(reqs))]
        if self.kind == "draft_decode":
            return [(p, out.rows[i]) for i, p in enumerate(parts)]
        return parts


def piecewise_eager(model, backends, batch: ForwardBatch, t: int) -> RunnerOutput:
    """EXTEND eagerly with the piecewise runner's shapes: the layers' dense parts over ``t``
    padded token rows, attention over the raw tokens (the bitwise reference on the GPU)."""
    per_layer = model.backends_per_layer(backends)
    batch = eager_step(batch, per_layer)
    for b in {id(b): b for b in per_layer}.values():
        b.init_forward_metadata(batch)
    raw, c, dev = batch.num_tokens, model.config, batch.positions.device
    pos = torch.zeros(t, dtype=I64, device=dev)
    pos[:raw] = batch.positions
    h = torch.zeros(t, c.hidden_size, dtype=c.dtype, device=dev)
    h[:raw] = batch.input_embeds if batch.input_embeds is not None else model.embed(batch.input_ids)
    with torch.no_grad():
        for block, be in zip(model.layers, per_layer):
            q, k, v = block.pre_attn(h, pos)
            o = torch.zeros(t, *q.shape[1:2], c.kv_lora_rank if c.is_mla else c.head_dim, dtype=c.dtype, device=dev)
            o[:raw] = be.forward(q[:raw], k[:raw], None if v is None else v[:raw], block.layer, batch)
            h = block.post_attn(h, o)
        h = model.norm(h)
        logits = model.lm_head(h).float()
    hidden = slice_hidden(h, batch.capture_hidden_mode, raw, 0, batch.extend_seq_lens_cpu[:batch.raw_bs])
    return RunnerOutput(logits[:raw].clone(), hidden)
