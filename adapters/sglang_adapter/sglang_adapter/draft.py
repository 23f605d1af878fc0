"""Draft decode through SGLang's ``TritonMultiStepDraftBackend`` (``triton_backend.py``), chains
(topk 1) only.

SGLang's multi-step draft backend holds one ``TritonAttnBackend`` per draft forward
(``speculative_num_steps - 1`` of them: the first draft token of each branch comes out of the draft
extend, so ``S`` steps take ``S - 1`` forwards) and prepares all of them in one call: its index
kernel (``generate_draft_decode_kv_indices``) writes step ``i``'s ``kv_indptr`` / ``kv_indices``
rows, then each step's backend makes its ``ForwardMetadata`` over them. Our draft decode is one
forward per step, each with its own backend instance (``runtime/draft.py``): our ``num_steps``
forwards are SGLang's ``speculative_num_steps = num_steps + 1``, and our draft step ``s`` (1-based)
is SGLang's per-step backend ``attn_backends[s - 1]`` (it reads ``s`` tokens of its branch). The
adapter makes the multi-step backend, calls its own methods as SGLang's draft graph runner does
(capture / replay; 0.5.13+: ``init_forward_metadata_out_graph`` then ``_in_graph``), and states
the step's backend's ``ForwardMetadata``: the decode layout (``metadata.py``).

Conventions translated:

- ``seq_lens``: SGLang's draft batch carries the committed prefix (the draft tokens are added by
  the index kernel: ``seq_len + iters``); ours count them (``prefix + topk * draft_step``).
- ``positions``: SGLang's index kernel takes ``kv_indptr`` from the batch's positions (the prefix
  of each branch row: ``eagle_worker.py`` sets ``positions = seq_lens.repeat_interleave(topk)``),
  its ``kv_indices`` from ``seq_lens``; the adapter passes the positions made from the same
  ``seq_lens``, pad rows included (SGLang's draft runner zeroes the pad rows' positions; those rows
  read the reserved row 0's slots either way).

Why chains only: SGLang lays a request's draft tokens out branch-major in ``req_to_token`` (branch
``j``'s step-``t`` token at ``prefix + j * speculative_num_steps + t``,
``generate_draft_decode_kv_indices``); ours are step-major (``prefix + t * topk + j``,
``SpecInfo.draft_step``). For topk 1 both are ``prefix + t``. For topk > 1 SGLang's kernel reads
other slots of the runner's table than our layout names, so the mapping would need a permuted
copy of the request-to-token table, i.e. the adapter computing the layout itself; not declared
(``Capabilities.topk_gt1`` is one flag: ``docs/engines.md``).
"""
from __future__ import annotations

import dataclasses

import torch

from attn_backends.layout import LayoutError

from . import engine, ingraph


def is_draft(spec) -> bool:
    return spec is not None and spec.is_draft_decode


def backend(adapter, spec):
    """SGLang's per-step backend for ``spec.draft_step`` (the multi-step backend made at the first
    batch, with SGLang's ``speculative_num_steps = num_steps + 1``)."""
    multi = getattr(adapter, "multi", None)
    if multi is None:
        steps = spec.num_steps + 1
        args = engine.ServerArgs(speculative_num_draft_tokens=spec.num_draft_tokens, speculative_num_steps=steps,
                                 speculative_eagle_topk=spec.topk)
        adapter.draft_runner = runner = adapter._runner(args)
        adapter.multi = multi = adapter.draft_engine_class()(runner, spec.topk, steps)
        adapter.draft_key = (spec.num_steps, spec.topk, spec.draft_step)
        adapter.sgl = multi.attn_backends[spec.draft_step - 1]
        if adapter.graph_state is not None:
            adapter._init_graph_state()
    elif adapter.draft_key != (spec.num_steps, spec.topk, spec.draft_step):
        raise LayoutError(f"{adapter.name}: made for (num_steps, topk, draft_step)={adapter.draft_key} (SGLang's "
                          f"server args and the step's backend); this batch has "
                          f"{(spec.num_steps, spec.topk, spec.draft_step)}: use a new instance")
    return adapter.sgl


def batch(adapter, bs: int, req_pool_indices, seq_lens, seq_lens_cpu, spec, out_cache_loc=None):
    """SGLang's draft-decode ``ForwardBatch`` for ours (module docstring: ``seq_lens`` and positions)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput
    k, dev = spec.topk, adapter.memory.device
    # pad rows (seq_len = the fill value, under topk * draft_step) get SGLang's prefix 0: its step
    # backend reads draft_step tokens of every row, there the reserved row 0's slots
    seq = (seq_lens - k * spec.draft_step).clamp(min=0)
    seq_cpu = (seq_lens_cpu - k * spec.draft_step).clamp(min=0)
    pos = seq.to(torch.int64) if k == 1 else seq.to(torch.int64).repeat_interleave(k, output_size=bs * k)
    if out_cache_loc is None:
        out_cache_loc = torch.zeros(bs * k, dtype=torch.int64, device=dev)
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs,
                      input_ids=torch.zeros(bs * k, dtype=torch.int64, device=dev),
                      req_pool_indices=req_pool_indices.to(torch.int64), seq_lens=seq, seq_lens_cpu=seq_cpu,
                      seq_lens_sum=int(seq_cpu.sum()), out_cache_loc=out_cache_loc, positions=pos,
                      spec_info=EagleDraftInput())
    fb.req_to_token_pool = adapter.draft_runner.req_to_token_pool     # 0.5.9 / 0.5.10's kernel reads it there
    fb.token_to_kv_pool = engine.StandInKVPool(adapter.memory)
    if ingraph.in_graph_api():
        ingraph.bind_plan(adapter.sgl, fb)
    return fb


def eager(adapter, b) -> object:
    fb = batch(adapter, b.batch_size, b.req_pool_indices, b.seq_lens, b.seq_lens_cpu, b.spec_info, b.out_cache_loc)
    adapter.multi.init_forward_metadata(fb)
    return fb


def capture(adapter, inputs) -> None:
    """What SGLang's draft graph runner does before ``graph.capture()``
    (``eagle_draft_cuda_graph_runner.py``)."""
    fb = batch(adapter, inputs.key.bs, inputs.req_pool_indices, inputs.seq_lens, inputs.seq_lens_cpu,
               inputs.spec_info)
    if ingraph.in_graph_api():
        ingraph.capture(adapter.multi, fb)
    else:
        adapter.multi.init_forward_metadata_capture_cuda_graph(fb)


def replay(adapter, inputs) -> None:
    """What SGLang's draft graph runner does before ``graph.replay()`` on the padded batch (0.5.13+:
    the out-of-graph prep, then the capture's in-graph prep that the graph re-runs)."""
    fb = batch(adapter, inputs.key.bs, inputs.req_pool_indices, inputs.seq_lens, inputs.seq_lens_cpu,
               inputs.spec_info)
    if ingraph.in_graph_api():
        ingraph.replay(adapter.multi, fb)
    else:
        adapter.multi.init_forward_metadata_replay_cuda_graph(fb, inputs.key.bs)


def graph_kv_indices(adapter, meta):
    """The buffer row a captured draft step's kernels read ``kv_indices`` from. SGLang's multi-step
    capture hands each step a slice of its row sized by the capture batch
    (``kv_indices_buffer[i][:seq_lens_sum * topk + bs * (i + 1)]``); the graph holds the slice's
    pointer, so a replay's longer batch is read past the slice's end, from the row. The view
    states the row; the slice must start it."""
    row = adapter.multi.cuda_graph_kv_indices[adapter.draft_key[2] - 1]
    if meta.kv_indices.data_ptr() != row.data_ptr():
        raise LayoutError(f"{adapter.name}: the captured kv_indices do not start the step's buffer row")
    return row


def with_graph_kv(meta):
    """SGLang's captured ``ForwardMetadata`` with ``kv_indices`` over the whole row: what the captured
    kernel reads on a GPU (one pointer); the interpreter copies a tensor argument's extent only."""
    return dataclasses.replace(meta.sgl, kv_indices=meta.kv_full)
