"""Known bug classes planted into our own code (the step, the layout builders, the runners,
the executor, the reference backend's kernel), each as a named function that applies it with a
``pytest.MonkeyPatch``; tests/check/test_planted_bugs.py shows that a check reports each one and that
the unmodified code passes the very same cases. Scopes: ``layout`` = the layout suite
(``run_suite``) on the listed modes; ``runner`` = the runner checks (``check_case``) on the
listed rig kinds; ``builder`` = garbage pad rows handed to the eager builder
(tests/core/test_builder_padding.py); ``executor`` = the eager fallback of a model executor.

=============================  ======================  ===============  ==================================
mutant                         bug (source)            scope            reported as
=============================  ======================  ===============  ==================================
packed_replay_stride           A1 sgl #21987, #19807   layout           I1 (replay cu_seqlens_q != runner)
steps_stride_draft_extend      A2 sgl #19807, #27545   layout           I13 / I1 (stride num_steps+1)
no_plus_w_in_builder           A3 KNOWN_FAILURES C.3   layout           I5 (seq_lens_k != prefix + W)
fresh_layout_on_replay         A4 rtp-llm #1259        layout           I1 (the bound views stay stale)
kv_indices_without_factor      A5 sgl #27338           layout           I6 (kv_indices capacity)
mask_indptr_of_raw_rows        A6 sgl #13740           layout           I4 (mask_indptr != arange*W*W)
pad_rows_to_real_request       B1 sgl #28569           layout           I3 (pad row page_table)
pad_fill_below_width           B2 sgl #31270           layout           I3 (pad seq_len < W)
builder_trusts_caller_pads     issue #11 defect 5      builder          I3 (garbage pads reach the layout)
stale_max_seq_len_k            C1 transformers #45323  layout, runner   I4 / I1; I9
plan_not_refreshed             C2 rtp-llm #378         layout           I1 (A's layout replayed for B)
host_item_in_plan_update       C1 sgl #29413           layout           I15
stale_pad_out_cache_loc        issue #11 defect 4, B1  runner           I16 (pad K/V into a real slot)
pad_kv_into_real_slots         B2 sgl #25529           runner           I16
causal_mask_off_by_one         kernel mask (M6)        runner           I9 (vs the float64 reference)
tree_mask_of_wrong_request     A6, kernel offset       runner           I9 (vs the float64 reference)
last_hidden_every_row          D2 / E1 sgl #28870      runner           I7 (the one hidden rule)
outputs_sliced_to_bs           D2 sgl #35546           runner           I9 (row count)
bucket_smaller_than_raw_bs     E2 sgl #31537           runner           I9 (a clear error: crashed)
key_without_hidden_mode        E1 sgl #22128           runner           I11 (captured hidden mode)
graph_replayed_for_other_mode  E1 sgl #22128           runner           I11 (mode refusal)
hidden_mode_not_guarded        E1 sgl #22128, #25568   runner           I11 (hidden refusal)
embeds_into_graph              D3 sgl #23613           runner           I11 (input-embeds refusal)
hidden_buffer_sized_for_last   E1 sgl #25795           runner           I11, I7
can_run_always_true            E2 vllm #36165          runner           I11 (can_run of a refused batch)
sub_backend_skipped            C3 MUTATION M19         runner           I12
aliased_outputs                D1 sgl #35546           runner           I8
shared_step_plan               D4 sgl #22930           runner           I9
graph_buffers_after_fallback   D1 sgl #22832           executor         I9 (fallback != eager)
=============================  ======================  ===============  ==================================

Not planted: A7 (a token bucket not a multiple of 1+K: our uniform runners bucket requests, so
``bs*W`` is a multiple of W by construction) and B3 (an invalid capture batch: the step validates
the capture batch with the replay validator, I13, and a capture on synthetic zeros has no
observable effect on the CPU stand-in). The backend-level copies of tests/support/planted_bugs.py stay.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from attn_backends import CaptureHiddenMode as H
from attn_backends import ForwardMode, GraphInputs, GraphKey
from attn_backends import layout as L
from attn_backends.backends import torch_native as TN
from attn_backends.layout import MaskKind, real_rows
from attn_backends.step import buffers as LB
from attn_backends.step import step as S
from attn_backends_runtime import draft, executor, full_graph, piecewise, runner_base
from attn_backends_runtime.runner_base import GraphRunnerBase, RunnerOutput
from attn_backends_runtime.testing import rig as rig_mod

I32 = torch.int32


@dataclass
class Mutant:
    plant: object                  # (MonkeyPatch) -> None
    scope: str                     # layout | runner | builder | executor
    cases: list                    # layout: modes; runner: RigSpec keyword dicts; builder: modes
    expect: set = field(default_factory=set)   # invariants that must be reported (any one of them)

    @property
    def name(self) -> str:
        return self.plant.__name__


# --------------------------------------------------------------------------- layout builders and the step

def packed_replay_stride(mp):
    orig = L.build_draft_extend

    def bug(inp, out=None):
        lay = orig(inp, out)
        if inp.static:           # replay packs by accept length; the runner strides N
            torch.cumsum(inp.spec_info.accept_lens.to(I32), 0, out=lay.cu_seqlens_q[1:])
        return lay
    mp.setitem(L.BUILDERS, ForwardMode.DRAFT_EXTEND, bug)


def steps_stride_draft_extend(mp):
    def bug(inp, out=None):
        s = inp.spec_info
        return L._uniform(inp, s.num_steps + 1, MaskKind.CAUSAL, out)
    mp.setitem(L.BUILDERS, ForwardMode.DRAFT_EXTEND, bug)


def no_plus_w_in_builder(mp):
    orig = L._write_kv

    def bug(out, inp, req, seq):
        w = out.width or 1
        orig(out, inp, req, torch.where(real_rows(inp), seq - w, seq))
    mp.setattr(L, "_write_kv", bug)


def fresh_layout_on_replay(mp):
    orig = S.Step._prep

    def bug(self, entry):
        if entry.graph is None and getattr(entry, "_seen", False):   # replay: into fresh tensors
            bound = entry.layout
            entry.layout = dataclasses.replace(bound, **{k: v.clone() for k, v in vars(bound).items()
                                                         if isinstance(v, torch.Tensor)})
            orig(self, entry)
            entry.layout = bound
            return
        entry._seen = True
        orig(self, entry)
    mp.setattr(S.Step, "_prep", bug)


def kv_indices_without_factor(mp):
    orig = LB.LayoutBuffers.__init__

    def bug(self, *a, **k):
        orig(self, *a, **k)
        self.kv_indices = self.kv_indices[:max(1, self.kv_indices.numel() // (4 * self.max_bs))]
    mp.setattr(LB.LayoutBuffers, "__init__", bug)


def mask_indptr_of_raw_rows(mp):
    orig = L.build_target_verify

    def bug(inp, out=None):
        lay = orig(inp, out)
        if lay.mask_indptr is not None:   # the mask of the live batch only: pad rows add W*W anyway
            lay.mask_indptr.clamp_(max=inp.raw_bs * lay.width * lay.width - 1)
        return lay
    mp.setitem(L.BUILDERS, ForwardMode.TARGET_VERIFY, bug)


def _patch_canonical(mp, fn):
    mp.setattr(L, "canonical_rows", fn)      # the one pad rule: the builder and the step's prep read it there


def pad_rows_to_real_request(mp):
    def bug(inp):
        real = real_rows(inp)
        req = inp.req_pool_indices.to(torch.int64)
        return torch.where(real, req, req[0]), torch.where(real, inp.seq_lens.to(I32), inp.pad_seq_len)
    _patch_canonical(mp, bug)


def pad_fill_below_width(mp):
    for mod in (L, S):
        mp.setattr(mod, "pad_seq_len", lambda fill, width: max(fill, 1))


def builder_trusts_caller_pads(mp):
    _patch_canonical(mp, lambda inp: (inp.req_pool_indices.to(torch.int64), inp.seq_lens.to(I32)))


def stale_max_seq_len_k(mp):
    orig = S.Step._prep

    def bug(self, entry):     # the host bound of the capture batch, where the prep builds the layout
        orig(self, entry)
        key = entry.key
        stale = self.__dict__.setdefault("_stale", {})
        stale.setdefault(key, int(self.seq_lens_cpu[:key.bs].max()))     # the first prep: the capture's
        entry.layout.max_seq_len_k = stale[key]                         # what a graph would replay
    mp.setattr(S.Step, "_prep", bug)


def plan_not_refreshed(mp):
    cap, upd, run_prep = S.Step.capture, S.Step.update, S.Step.run_prep

    def capture(self, key, spec, raw_bs):
        self._last, self._skip = (key, cap(self, key, spec, raw_bs)), False
        return self._last[1]

    def update(self, key, raw_bs, draft_step=None):
        self._skip = self.__dict__.get("_last", (None,))[0] == key      # "nothing changed": the last view
        if not self._skip:
            self._last = (key, upd(self, key, raw_bs, draft_step))
        return self._last[1]
    mp.setattr(S.Step, "capture", capture)
    mp.setattr(S.Step, "update", update)           # nor where the step's graph holds the prep
    mp.setattr(S.Step, "run_prep", lambda self, key: None if self.__dict__.get("_skip") else run_prep(self, key))


def host_item_in_plan_update(mp):
    upd = S.Step.update

    def update(self, key, raw_bs, draft_step=None):
        self._hint = int(self.seq_lens[:raw_bs].max().item())
        return upd(self, key, raw_bs, draft_step)
    mp.setattr(S.Step, "update", update)


# --------------------------------------------------------------------------- padding of the runners' tokens

def stale_pad_out_cache_loc(mp):
    orig = S.Step._prep

    def bug(self, entry):     # the token pad rows keep what an earlier replay left there
        tokens, self.tokens = self.tokens, None
        try:
            orig(self, entry)
        finally:
            self.tokens = tokens
    mp.setattr(S.Step, "_prep", bug)


def pad_kv_into_real_slots(mp):
    orig = S.Step._prep

    def bug(self, entry):
        orig(self, entry)
        if self.tokens is not None:
            n, w = entry.key.bs * entry.key.width, entry.key.width
            real = real_rows(self._inputs(entry)).repeat_interleave(w)
            loc = self.tokens[2, :n]       # the slot of position 0 of the first request: its cached prompt
            first = self.memory.req_to_token[self.req_pool_indices[0].long(), 0].long()
            loc.copy_(torch.where(real, loc, first))
    mp.setattr(S.Step, "_prep", bug)


# --------------------------------------------------------------------------- the kernel (torch_native's masks)

def causal_mask_off_by_one(mp):
    orig = TN.visible
    mp.setattr(TN, "visible", lambda lay, q, k: orig(lay, q + 1 if lay.mask == MaskKind.CAUSAL else q, k))


def tree_mask_of_wrong_request(mp):
    orig = TN.visible

    def bug(lay, q, k):
        if lay.mask == MaskKind.TREE:
            lay = dataclasses.replace(lay, custom_mask=lay.custom_mask.view(lay.bs, -1).roll(1, 0).reshape(-1))
        return orig(lay, q, k)
    mp.setattr(TN, "visible", bug)


# --------------------------------------------------------------------------- runners

def last_hidden_every_row(mp):
    orig = runner_base.slice_hidden

    def bug(hidden, mode, n_rows, width, valid=None):
        return orig(hidden, H.FULL if mode == H.LAST else mode, n_rows, width, valid)
    for mod in (runner_base, full_graph, draft, piecewise, executor, rig_mod):   # the reference's too
        mp.setattr(mod, "slice_hidden", bug)


def outputs_sliced_to_bs(mp):
    def bug(self, out, batch, static_batch):
        n = static_batch.batch_size * self.width
        return RunnerOutput(out[0][:n].clone(), runner_base.slice_hidden(out[1], batch.capture_hidden_mode, n,
                                                                         self.width))
    mp.setattr(full_graph.UniformGraphRunner, "_slice", bug)


def bucket_smaller_than_raw_bs(mp):
    orig = full_graph.UniformGraphRunner._capture_metadata

    def bug(self, key, sb):
        orig(self, key, sb)
        if key.bs + 1 <= self.max_bs:
            self._by_raw[key.bs + 1] = (key, sb)                       # raw_bs one above the bucket
    mp.setattr(full_graph.UniformGraphRunner, "_capture_metadata", bug)


def key_without_hidden_mode(mp):
    orig = full_graph.UniformGraphRunner._static_batch

    def bug(self, bucket):
        key, sb = orig(self, bucket)
        plain = GraphKey(key.forward_mode, key.bs, key.width)
        self._rows[plain] = self._rows.pop(key)
        return plain, sb
    mp.setattr(full_graph.UniformGraphRunner, "_static_batch", bug)


def graph_replayed_for_other_mode(mp):
    mp.setattr(full_graph.UniformGraphRunner, "refusal", GraphRunnerBase.refusal)


def hidden_mode_not_guarded(mp):
    base = GraphRunnerBase.refusal
    mp.setattr(GraphRunnerBase, "refusal",
               lambda self, b: base(self, dataclasses.replace(b, capture_hidden_mode=H.NULL)))


def embeds_into_graph(mp):
    mp.setattr(full_graph.UniformGraphRunner, "accepts_input_embeds", True, raising=False)


def hidden_buffer_sized_for_last(mp):
    orig = full_graph.UniformGraphRunner._forward

    def forward(self, sb):
        logits, hidden = orig(self, sb)
        if self.capture_hidden_mode == H.LAST:           # a static hidden buffer of one row per request
            hidden = hidden[self.width - 1::self.width]
        return logits, hidden
    mp.setattr(full_graph.UniformGraphRunner, "_forward", forward)
    hidden_mode_not_guarded(mp)


def can_run_always_true(mp):
    mp.setattr(GraphRunnerBase, "can_run", lambda self, batch: True)


def sub_backend_skipped(mp):
    def prepare(self, key, raw_bs):
        view = self.step.update(key, raw_bs)
        gi = GraphInputs(key, *self._rows[key], view.spec, raw_bs, view)
        self.backends[0].init_forward_metadata_replay_cuda_graph(gi)   # the other layers' instances skipped
    mp.setattr(full_graph.UniformGraphRunner, "_prepare_replay", prepare)


def aliased_outputs(mp):
    def bug(self, out, batch, static_batch):
        n = batch.raw_bs * self.width
        return RunnerOutput(out[0][:n], runner_base.slice_hidden(out[1], batch.capture_hidden_mode, n, self.width))
    mp.setattr(full_graph.UniformGraphRunner, "_slice", bug)


def shared_step_plan(mp):
    orig = draft.MultiStepDraftRunner.__init__

    def init(self, *a, **k):
        orig(self, *a, **k)
        self.steps.steps = [self.steps[0]] * self.num_steps            # one step for every draft step
    mp.setattr(draft.MultiStepDraftRunner, "__init__", init)


def graph_buffers_after_fallback(mp):
    orig = executor.ModelExecutor.forward

    def forward(self, batch):
        runner = self.runners.get(executor.MODE_KEYS[batch.forward_mode])
        if runner is not None and runner.graphs and not runner.can_run(batch):
            self._count("fallback", False)
            logits, hidden = next(iter(runner.graphs.values()))[1]     # the last replay's static outputs
            n = batch.raw_bs * batch.width
            return RunnerOutput(logits[:n].clone(), None if hidden is None else hidden[:n].clone())
        return orig(self, batch)
    mp.setattr(executor.ModelExecutor, "forward", forward)


# --------------------------------------------------------------------------- the table, as data

R = dict                                   # a RigSpec's keywords
TREE_DE = R(kind="draft_extend", n=4, topk=2, steps=2)
MUTANTS = [Mutant(*m) for m in (
    (packed_replay_stride, "layout", ["draft_extend"], {"I1"}),
    (steps_stride_draft_extend, "layout", ["draft_extend"], {"I1", "I13"}),
    (no_plus_w_in_builder, "layout", ["decode", "verify_chain"], {"I5"}),
    (fresh_layout_on_replay, "layout", ["decode", "verify_tree"], {"I1"}),
    (kv_indices_without_factor, "layout", ["decode"], {"I6"}),
    (mask_indptr_of_raw_rows, "layout", ["verify_tree"], {"I4"}),
    (pad_rows_to_real_request, "layout", ["decode", "verify_chain"], {"I3"}),
    (pad_fill_below_width, "layout", ["verify_chain", "draft_extend"], {"I3"}),
    (builder_trusts_caller_pads, "builder", ["decode", "verify_tree", "draft_extend"], {"I3"}),
    (stale_max_seq_len_k, "layout", ["decode", "verify_chain"], {"I4", "I1"}),
    (stale_max_seq_len_k, "runner", [R(kind="verify")], {"I9"}),
    (plan_not_refreshed, "layout", ["decode", "draft_extend"], {"I1"}),
    (host_item_in_plan_update, "layout", ["decode"], {"I15"}),
    (stale_pad_out_cache_loc, "runner", [R(kind="decode", seed=3), R(kind="verify", seed=4)], {"I16"}),
    (pad_kv_into_real_slots, "runner", [R(kind="decode", seed=3), R(kind="verify", seed=4)], {"I16"}),
    (causal_mask_off_by_one, "runner", [R(kind="verify"), TREE_DE], {"I9"}),
    (tree_mask_of_wrong_request, "runner", [R(kind="verify_tree", seed=2)], {"I9"}),
    (last_hidden_every_row, "runner", [R(kind="verify", hidden=H.LAST), TREE_DE], {"I7"}),
    (outputs_sliced_to_bs, "runner", [R(kind="decode")], {"I9"}),
    (bucket_smaller_than_raw_bs, "runner", [R(kind="decode", buckets=(2, 4), seed=5)], {"I9"}),
    (key_without_hidden_mode, "runner", [R(kind="decode", hidden=H.LAST)], {"I11"}),
    (graph_replayed_for_other_mode, "runner", [R(kind="verify")], {"I11"}),
    (hidden_mode_not_guarded, "runner", [R(kind="decode", hidden=H.NULL)], {"I11"}),
    (embeds_into_graph, "runner", [R(kind="decode")], {"I11"}),
    (hidden_buffer_sized_for_last, "runner", [R(kind="verify", hidden=H.LAST)], {"I11"}),
    (can_run_always_true, "runner", [R(kind="decode")], {"I11"}),
    (sub_backend_skipped, "runner", [R(kind="verify", buckets=(4,))], {"I12"}),
    (aliased_outputs, "runner", [R(kind="decode")], {"I8"}),
    (shared_step_plan, "runner", [R(kind="draft_decode", topk=2, steps=2)], {"I9"}),
    (graph_buffers_after_fallback, "executor", [], {"I9"}),
)]
