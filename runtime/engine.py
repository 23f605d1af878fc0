"""A tiny serving engine: a request queue, continuous batching, prefill (EXTEND), plain decode
or EAGLE speculative decode, greedy sampling, stop rules, KV pages freed when a request ends.

Each ``step()`` is a prefill of newly admitted requests (when some fit) or one decode step over
every running request: plain DECODE (one token each) or one EAGLE step (1..N tokens each).
Requests join and finish at different steps. Admission reserves each request's worst-case
pages, so no allocation fails mid-generation; a request that can never fit fails at once with
an error naming the value and the limit, and the others go on. A setting the engine cannot take
(:func:`refusal`, or more memory than the device has free: limits.py) raises
:class:`~.limits.ConfigError` before anything is allocated. The target is the seeded model:
a draft shares its weights and never changes them (``skippable_from`` asks for another target).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from attn_backends import CaptureHiddenMode, ForwardMode, KVMemory

from . import limits
from .batches import device_rows, extend_batch, uniform_batch
from .draft_model import DraftModel, make_top_layers_skippable
from .eagle import EagleWorker, SpecConfig
from .executor import draft_executor, target_executor
from .kv_bookkeeping import PageBudget
from .limits import ConfigError
from .models import TinyConfig, TinyModel
from .request import Request, SamplingParams, Status
from .stats import EngineStats
from .tp import TensorParallel, shard_config, shard_model


def powers_of_two(limit: int, start: int = 1) -> tuple:
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    return tuple(out + [limit])


@dataclass
class EngineConfig:
    model: TinyConfig = field(default_factory=TinyConfig)
    backend: str = "torch_native"
    spec: Optional[SpecConfig] = None         # None: plain decode
    device: str = "cpu"
    max_batch: int = 8                        # running requests
    max_context_len: int = 256
    num_pages: Optional[int] = None           # None: max_batch requests at max_context_len
    max_prefill_tokens: int = 256             # prompt tokens per prefill batch (one prompt may exceed it)
    graphs: bool = True                       # False: every forward eager
    buckets: Optional[tuple] = None           # requests per captured graph; None: 1, 2, 4, .., max_batch
    token_buckets: Optional[tuple] = None     # piecewise EXTEND tokens; None: 16, 32, .., max_prefill_tokens
    page_order: str = "shuffled"
    # the target's layers from this one on write only where its LM head does not read
    # (make_top_layers_skippable), so that a draft of that many layers agrees with it: another
    # target, chosen here, plain or speculative alike. None: the target as seeded; no draft changes it.
    skippable_from: Optional[int] = None
    tp: Optional[TensorParallel] = None       # this process's rank (runtime/tp.py); None: one process

    @property
    def draft_layers(self) -> int:
        """The draft trunk's layers (its own KV layers after the target's); 0 without spec."""
        return (self.spec.draft_layers or self.model.num_layers) if self.spec else 0

    @property
    def pages(self) -> int:
        """KV pages: ``num_pages``, else every request at ``max_context_len``, and the reserved page 0."""
        return self.num_pages or self.max_batch * -(-self.max_context_len // self.model.page_size) + 1


def refusal(cfg: EngineConfig):
    """The first setting of ``cfg`` an engine cannot take, as ``render(names)`` (limits.py), or None.
    Checked before anything is allocated."""
    c, spec = cfg.model, cfg.spec
    if cfg.max_batch < 1:
        return lambda x: f"{x.set('max_batch', cfg.max_batch)} must be >= 1"
    if spec is not None and spec.topk > c.vocab_size:
        return lambda x: f"{x.set('topk', spec.topk)} exceeds the vocabulary size {c.vocab_size}"
    if spec is not None and spec.draft_layers is not None and spec.draft_layers > c.num_layers:
        return lambda x: f"{x.set('draft_layers', spec.draft_layers)} exceeds the target's {c.num_layers} layers"
    s = cfg.skippable_from
    if s is not None and not 1 <= s <= c.num_layers:
        return lambda x: f"{x.set('skippable_from', s)} outside 1..{c.num_layers} (the target's layers)"
    return None


class Engine:
    def __init__(self, cfg: EngineConfig, capture: bool = True) -> None:
        """``capture=False`` builds the executors without capturing their graphs (what `check`
        inspects of them: which modes they serve with a graph)."""
        self.cfg, c, spec = cfg, cfg.model, cfg.spec
        reason = refusal(cfg)
        if reason is not None:
            raise ConfigError(reason)
        too_big = limits.memory_refusal(cfg, f"max_batch={cfg.max_batch}, max_context_len={cfg.max_context_len}")
        if too_big:
            raise ConfigError(lambda x: too_big)
        draft_layers = cfg.draft_layers
        self.tp = cfg.tp or TensorParallel()
        local = shard_config(c, self.tp)                    # this rank's heads (all of them at TP 1)
        attn = replace(local, num_layers=c.num_layers + draft_layers).attention()   # target and draft layers
        self.memory = KVMemory(num_layers=c.num_layers + draft_layers, num_pages=cfg.pages, page_size=c.page_size,
                               max_reqs=cfg.max_batch, max_context_len=cfg.max_context_len, is_mla=c.is_mla,
                               num_kv_heads=local.num_kv_heads, head_dim=c.head_dim, kv_lora_rank=c.kv_lora_rank,
                               rope_dim=c.qk_rope_head_dim, dtype=attn.cache_dtype, device=cfg.device,
                               page_order=cfg.page_order)
        aux = spec.target_aux_layers(c.num_layers) if spec else ()
        self.target_model = TinyModel(c, cfg.device, aux_hidden_layers=aux)
        if cfg.skippable_from is not None:
            make_top_layers_skippable(self.target_model, cfg.skippable_from)
        shard_model(self.target_model, self.tp)             # the full seeded model's slices: TP 1's weights
        buckets = cfg.buckets or powers_of_two(cfg.max_batch)
        tokens = cfg.token_buckets or powers_of_two(cfg.max_prefill_tokens, 16)
        kw = dict(buckets=buckets, token_buckets=tokens, graphs=cfg.graphs)
        self.target = target_executor(self.target_model, self.memory, cfg.backend, attn,
                                      spec=spec.verify_spec() if spec else None, **kw)
        self.executors, self.worker = [self.target], None
        if spec is not None:
            self.draft_model = DraftModel(self.target_model, self.memory, num_layers=draft_layers,
                                          noise=spec.noise, temperature=spec.draft_temperature, seed=spec.seed)
            draft = draft_executor(self.draft_model, self.memory, cfg.backend, attn, topk=spec.topk,
                                   num_steps=spec.num_steps, num_draft_tokens=spec.num_draft_tokens, **kw)
            self.executors.append(draft)
            self.worker = EagleWorker(spec, self.memory, self.target, draft, self.draft_model, c.num_layers)
        for ex in self.executors if capture else ():
            ex.capture()
        self.budget = PageBudget(self.memory)
        self.waiting: deque = deque()
        self.running: list = []
        self.requests: dict = {}
        self.stats = EngineStats()

    # ------------------------------------------------------------------ queue
    def add_request(self, prompt: list, params: SamplingParams = SamplingParams()) -> int:
        rid = len(self.requests)
        req = Request(rid, [int(t) for t in prompt], params)
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _worst_len(self, r: Request) -> int:
        """The most positions ``r`` can ever hold: prompt, outputs and a step's draft positions."""
        spec = self.cfg.spec
        return len(r.prompt) + r.params.max_tokens + (spec.headroom + 1 if spec else 0)

    def _refusal(self, r: Request) -> Optional[str]:
        vocab, limit = self.cfg.model.vocab_size, self.cfg.max_context_len
        if not r.prompt:
            return f"request {r.rid}: empty prompt"
        bad = [t for t in r.prompt if not 0 <= t < vocab]
        if bad:
            return f"request {r.rid}: token {bad[0]} outside the vocabulary 0..{vocab - 1}"
        worst = self._worst_len(r)
        if worst > limit:
            return (f"request {r.rid}: prompt of {len(r.prompt)} tokens + max_tokens={r.params.max_tokens} "
                    f"+ {worst - len(r.prompt) - r.params.max_tokens} speculative positions = {worst} "
                    f"exceeds max_context_len={limit}")
        pages = self.budget.pages_for(worst)
        if pages > self.budget.total:
            return f"request {r.rid}: needs {pages} KV pages, the pool has {self.budget.total}"
        return None

    def _admit(self, done: list) -> list:
        batch, tokens = [], 0
        while self.waiting and len(self.running) + len(batch) < self.cfg.max_batch:
            r = self.waiting[0]
            reason = self._refusal(r)
            if reason:
                self.waiting.popleft()
                r.fail(reason)
                done.append(r)
                continue
            pages = self.budget.pages_for(self._worst_len(r))
            if (batch and tokens + len(r.prompt) > self.cfg.max_prefill_tokens) or not self.budget.fits(pages):
                break
            self.waiting.popleft()
            self.budget.reserve(pages)
            r.pages, r.status = pages, Status.RUNNING
            batch.append(r)
            tokens += len(r.prompt)
        return batch

    # ------------------------------------------------------------------ steps
    def step(self) -> list:
        """One prefill or one decode step; returns the requests that finished in it."""
        done: list = []
        admitted = self._admit(done)
        t0 = time.perf_counter()
        if admitted:
            self._prefill(admitted)
            self.stats.prefill_seconds += time.perf_counter() - t0
        elif self.running:
            emitted = self._decode()
            self.stats.decode_seconds += time.perf_counter() - t0
            self.stats.decode_tokens += emitted
        self._check_ranks()
        for r in [r for r in self.running if r.finished]:
            self._release(r)
            done.append(r)
        return done

    def _check_ranks(self) -> None:
        """Debug mode at TP > 1: the step's requests, tokens and KV slots equal on every rank."""
        if not self.tp.debug or self.tp.size == 1:
            return
        rows = [torch.tensor([r.rid, r.num_tokens, *r.output], dtype=torch.float64) for r in self.running]
        slots = [self.memory.req_to_token[r.row, :r.num_tokens].double().cpu() for r in self.running]
        self.tp.check_same("the step's requests, tokens and KV slots", torch.cat(rows + slots + [torch.zeros(1)]))

    def _prefill(self, reqs: list) -> None:
        mem, spec = self.memory, self.cfg.spec
        for r in reqs:
            r.row = mem.new_request()
            mem.extend(r.row, len(r.prompt) + (1 if spec else 0))     # spec: the draft runs one ahead
            self.running.append(r)
        hidden = CaptureHiddenMode.FULL if spec else CaptureHiddenMode.NULL
        batch = extend_batch(mem, [r.row for r in reqs], [0] * len(reqs), [r.prompt for r in reqs], hidden)
        out = self.target.forward(batch)
        ends = torch.tensor([len(r.prompt) for r in reqs]).cumsum(0) - 1
        first = out.logits[ends.to(out.logits.device)].argmax(-1).tolist()
        if self.worker is not None:
            self.worker.prefill(reqs, batch, out, first)
        for r, t in zip(reqs, first):
            self.stats.tokens += r.emit([t])

    def _decode(self) -> int:
        reqs, emitted = self.running, 0
        if self.worker is not None:
            tokens, lens = self.worker.step(reqs)
            for r, a in zip(reqs, lens):
                r.accept_lens.append(a)
                self.stats.accept_hist[a] += 1
        else:
            tokens = self._plain_decode(reqs)
        for r, ts in zip(reqs, tokens):
            emitted += r.emit(ts)
        self.stats.tokens += emitted
        return emitted

    def _plain_decode(self, reqs: list) -> list:
        dev = self.memory.device
        starts = [r.num_tokens - 1 for r in reqs]                       # KV length; the last output is pending
        for r in reqs:
            self.memory.extend(r.row, 1)
        host = device_rows([[r.row for r in reqs], starts, [r.output[-1] for r in reqs]], dev)   # one copy
        batch = uniform_batch(ForwardMode.DECODE, self.memory, host[0].to(torch.int32), host[1],
                              torch.tensor(starts, dtype=torch.int32), host[2])
        out = self.target.forward(batch)
        return [[t] for t in out.logits.argmax(-1).tolist()]

    def _release(self, r: Request) -> None:
        self.memory.free_request(r.row)
        self.budget.release(r.pages)
        if self.worker is not None:
            self.worker.release(r.rid)
        self.running.remove(r)
        r.row, r.pages, r.status = None, 0, Status.FINISHED

    # ------------------------------------------------------------------ drivers
    def run(self, progress: Optional[Callable[[int], None]] = None) -> list:
        """Step until every request has finished; ``progress(tokens emitted so far)`` after each step."""
        while self.has_work():
            self.step()
            if progress is not None:
                progress(self.stats.tokens)
        return [self.requests[i] for i in sorted(self.requests)]

    def generate(self, prompts: list, params: SamplingParams = SamplingParams()) -> list:
        ids = [self.add_request(p, params) for p in prompts]
        self.run()
        return [self.requests[i] for i in ids]

    def summary(self) -> str:
        n = self.cfg.spec.num_draft_tokens if self.cfg.spec else 0
        return self.stats.summary(self.executors, n)
