"""SGLang 0.5.13+ ("in-graph metadata"): what the Triton adapter needs for the graph API and the
runtime configuration of that generation.

What changed in SGLang (``base_attn_backend.py``, 0.5.13 on; read in 0.5.23): the backend's
``init_forward_metadata_capture_cuda_graph`` / ``_replay_cuda_graph`` are gone. A graph runner now
calls ``init_forward_metadata_out_graph(fb, in_capture=True)`` before ``graph.capture()`` and
``init_forward_metadata_in_graph(fb)`` inside it (recorded, so ``graph.replay()`` re-runs it);
each replay calls ``init_forward_metadata_out_graph(fb_view)`` on a view of the padded static
inputs, then replays the graph. ``TritonAttnBackend`` does all its work in ``_out_graph``
(``_apply_cuda_graph_metadata``: the same buffer writers for capture and replay; the capture
then builds its ``ForwardMetadata`` over the static buffers) and keeps the no-op ``_in_graph``.
The adapter makes the same calls in the same order; replay calls ``_in_graph`` too, standing in
for ``graph.replay()`` re-running what capture recorded there.

The backend no longer reads server args from the runner: it reads SGLang's process-wide config
(``runtime_context.get_exec()`` / ``get_spec()`` / ``get_parallel()`` ...). :func:`publish`
installs a real ``ServerArgs`` with the backend's fields through SGLang's own test hook
(``get_context().override_server_args``, what SGLang's attention unit tests use), TP 1.
Its KV indices come from the runner's ``KVIndexTranslator`` (``pack_read_stream``: the index kernel
over ``req_to_token``) through a per-batch ``KVLocPlan``: both are SGLang's own, built here as
``ModelRunner.init_kv_index_translator`` and the graph runners build them.

Stand-ins added for this generation (on top of ``engine.StandInRunner``'s):

- :class:`StandInRunner13` ``decode_num_tokens_per_req()``: ``ModelRunner``'s method (its module
  does not import here: ``distributed/gated_launch.py`` imports ``uvicorn``, a server dependency the
  light install leaves out); for EAGLE it is SGLang's own
  ``resolve_num_tokens_per_req(phase="target_verify")``, else 1 (no dLLM, no DSpark here).
- Model-config fields the constructor reads (``get_max_num_attention_heads``, ``v_head_dim``,
  ``hf_config`` with no hybrid/linear-attention layers), as in SGLang's ``TinyModelConfig``.
- ``out_cache_loc`` of a graph's batch: zeros (the reserved slot); the Triton backend's graph
  prep reads it only for a sliding-window pool, which the adapter does not declare.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import types

from . import engine


@functools.lru_cache(maxsize=None)
def in_graph_api() -> bool:
    """True for SGLang 0.5.13+ (``init_forward_metadata_out_graph``; no capture/replay methods)."""
    engine.sglang()
    tb = importlib.import_module("sglang.srt.layers.attention.triton_backend").TritonAttnBackend
    return not hasattr(tb, "init_forward_metadata_capture_cuda_graph")


def publish(args: engine.ServerArgs) -> None:
    """Install SGLang's process-wide config for a backend made with ``args`` (last one wins, as
    SGLang's ``publish``), one attention rank."""
    rc = importlib.import_module("sglang.srt.runtime_context")
    spec = args.speculative_num_draft_tokens is not None
    rc.get_context().override_server_args(
        tp_size=1, dp_size=1, pp_size=1, page_size=args.page_size, kv_cache_dtype=args.kv_cache_dtype,
        chunked_prefill_size=args.chunked_prefill_size,
        triton_attention_num_kv_splits=args.triton_attention_num_kv_splits,
        triton_attention_split_tile_size=args.triton_attention_split_tile_size,
        enable_deterministic_inference=args.enable_deterministic_inference,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens if spec else 0,
        speculative_num_steps=args.speculative_num_steps if spec else 0,
        speculative_eagle_topk=args.speculative_eagle_topk if spec else 0).install()
    rc.get_parallel().override_permanently(attn_tp_size=1, attn_dcp_rank=0)


class StandInRunner13(engine.StandInRunner):
    """``engine.StandInRunner`` with what 0.5.13+'s constructor reads besides (module docstring)."""

    def __init__(self, config, memory, server_args: engine.ServerArgs) -> None:
        super().__init__(config, memory, server_args)
        publish(server_args)
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        self.is_draft_worker = False
        self.spec_algorithm = (SpeculativeAlgorithm.NONE if server_args.speculative_num_draft_tokens is None
                               else SpeculativeAlgorithm.EAGLE)
        self.token_to_kv_pool.start_layer = 0
        mc = self.model_config
        mc.get_max_num_attention_heads = lambda: config.num_q_heads
        mc.get_num_kv_heads = lambda tp_size, dcp_size=1: max(1, config.num_kv_heads // tp_size)
        mc.head_dim = mc.v_head_dim = mc.swa_v_head_dim = config.head_dim
        mc.hf_config = types.SimpleNamespace(architectures=["StandInForCausalLM"], get_text_config=lambda: mc.hf_config)
        mc.hf_text_config, mc.linear_attn_registry_result = mc.hf_config, None
        self.kv_index_translator = KVIndexTranslator(
            req_to_token=self.req_to_token_pool.req_to_token,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator, token_to_kv_pool=self.token_to_kv_pool,
            page_size=server_args.page_size, device=self.device, is_draft_worker=False)

    def decode_num_tokens_per_req(self) -> int:
        if not self.spec_algorithm.is_speculative():
            return 1
        from sglang.srt.speculative.spec_utils import resolve_num_tokens_per_req
        return resolve_num_tokens_per_req(phase="target_verify", spec_algorithm=self.spec_algorithm,
                                          is_draft_worker=False)


def bind_plan(sgl_backend, fb) -> None:
    """A batch made outside ``ForwardBatch.init_new`` gets its own ``KVLocPlan`` (SGLang's
    ``bind_own_plan``, what its graph runners' capture and its attention tests do)."""
    sgl_backend.kv_index_translator.bind_own_plan(fb)


def spec_fields(cls, **fields) -> dict:
    """``fields`` under the names ``cls`` has (0.5.23 renamed ``retrive_*`` to ``retrieve_*``)."""
    names = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for k, v in fields.items():
        alt = k.replace("retrive_", "retrieve_")
        out[k if k in names else alt] = v
    return out


def draft_extend_input(n: int, extend_lens=None):
    """SGLang's ``EagleDraftExtendInput`` as its draft-extend graph runner builds it: the padded
    width N per request; at replay, ``extend_seq_lens_tensor`` = the padded extend lengths
    (``eagle_draft_extend_cuda_graph_runner.py``: N for real and pad rows in v2); at capture none
    (its capture batch has none either)."""
    from sglang.srt.speculative.eagle_info import EagleDraftExtendInput
    spec = EagleDraftExtendInput(num_tokens_per_req=n)
    if extend_lens is not None:
        spec.extend_seq_lens_tensor = extend_lens
    return spec


def capture(sgl_backend, fb) -> None:
    """What SGLang's graph runners do around ``graph.capture()`` (decode_cuda_graph_runner.py,
    eagle_draft_extend_cuda_graph_runner.py): the out-of-graph prep with ``in_capture=True``, then
    the in-graph prep (recorded)."""
    sgl_backend.init_forward_metadata_out_graph(fb, in_capture=True)
    sgl_backend.init_forward_metadata_in_graph(fb)


def replay(sgl_backend, fb_view) -> None:
    """A replay: the out-of-graph prep on the padded view, then what ``graph.replay()`` re-runs of
    the capture's in-graph prep. The ``ForwardMetadata`` the graph reads stays the capture's
    (the adapter states that one, not whatever the replay leaves in ``forward_metadata``)."""
    sgl_backend.init_forward_metadata_out_graph(fb_view)
    sgl_backend.init_forward_metadata_in_graph(fb_view)
