"""What vLLM's Triton attention backend needs around it, on a CPU: vLLM imported so that its Triton
helpers run in the interpreter, a stand-in vllm config the builder is constructed from, and the
persistent input buffers of vLLM's V2 GPU model runner (``vllm/v1/worker/gpu/model_runner.py``, the
default runner of 0.33) written by vLLM's own kernels.

Stand-ins (each where vLLM cannot import or run on a CPU; none computes metadata):

- the platform: with no GPU vLLM picks ``UnspecifiedPlatform``, whose ``device_type`` is empty (its
  buffer fallbacks allocate on it). ``VLLM_TARGET_DEVICE=cpu`` makes vLLM pick its own ``CpuPlatform``.
- ``CUDA_VISIBLE_DEVICES=""``: ``vllm/triton_utils/importing.py`` disables Triton where no GPU driver is
  active, except in the "distributed environment" an empty ``CUDA_VISIBLE_DEVICES`` marks; the Triton
  interpreter needs no driver. Without it vLLM's ``@triton.jit`` kernels are plain functions.
- UVA (``buffer_utils.is_uva_available``): pinned host memory mapped into the GPU's address space needs
  CUDA; it is reported unavailable so that vLLM's own ``NonUvaBuffer`` fallback (explicit copies) is used.
- the vllm config (:func:`standin_config`): vLLM's ``VllmConfig`` validates a Hugging Face model; the
  builder reads head counts, the CUDA-graph mode and capture sizes, ``max_num_seqs`` and the
  speculative config. vLLM's own ``FullAttentionSpec`` is the KV cache spec.
- the request states' block ids (:meth:`RunnerBuffers.load_requests`): vLLM's scheduler hands them from
  the host (``BlockTables.append_block_ids``); the suite's batch has them only in the device
  request-to-token table, so they are written into vLLM's per-request table with device ops (a host
  read there would be a sync the suite's I15 guard counts). What follows is vLLM's.
"""
from __future__ import annotations

import functools
import importlib
import os
import types

import numpy as np
import torch

from attn_backends.check.hostsync import unguard_interpreted_launches

# the stand-in config's cudagraph_capture_sizes: vLLM's default list up to 32 (the builder picks its 2D/3D
# kernel threshold as the capture size nearest 128 / num_kv_heads)
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32)


@functools.lru_cache(maxsize=None)
def vllm():
    """Import vLLM with the CPU stand-ins above; a one-line error where it is not on the path."""
    if not torch.cuda.is_available():
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # our kernels package patches the Triton interpreter for numpy >= 2.4 (kernels/_interpret_compat.py):
    # vLLM's input kernels loop to bounds loaded from memory, which the unpatched interpreter refuses
    importlib.import_module("attn_backends_kernels")
    try:
        v = importlib.import_module("vllm")
        importlib.import_module("vllm.v1.attention.backends.triton_attn")
        bu = importlib.import_module("vllm.v1.worker.gpu.buffer_utils")
    except ImportError as e:
        raise ImportError(f"vLLM cannot be imported ({e}); install it with adapters/install_engines.sh "
                          "vllm-0.33.0 and put its target folder on PYTHONPATH") from e
    if not torch.cuda.is_available():
        bu.is_uva_available = lambda: False
    unguard_interpreted_launches()      # interpreted launches are no host sync (I15)
    return v


def standin_config(config, memory, max_bs: int, num_spec: int):
    """The fields of ``VllmConfig`` that ``TritonAttentionMetadataBuilder.__init__`` reads, at vLLM's
    defaults (FULL_AND_PIECEWISE graphs, TP 1); ``num_spec`` speculative tokens (0: none)."""
    from vllm.config import CUDAGraphMode
    mc = types.SimpleNamespace(get_num_attention_heads=lambda pc: config.num_q_heads,
                               get_num_kv_heads=lambda pc: config.num_kv_heads,
                               get_head_size=lambda: config.head_dim, rswa_window=None,
                               max_model_len=memory.max_context_len)
    cc = types.SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                               cudagraph_capture_sizes=list(CAPTURE_SIZES), static_forward_context={})
    spec = (types.SimpleNamespace(num_speculative_tokens=num_spec, parallel_drafting=False)
            if num_spec else None)
    return types.SimpleNamespace(model_config=mc, parallel_config=types.SimpleNamespace(), compilation_config=cc,
                                 scheduler_config=types.SimpleNamespace(max_num_seqs=max_bs),
                                 speculative_config=spec)


def kv_cache_spec(config, memory):
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    return FullAttentionSpec(block_size=memory.page_size, num_kv_heads=config.num_kv_heads,
                             head_size=config.head_dim, dtype=config.dtype)


class RunnerBuffers:
    """The persistent inputs of vLLM's V2 ``GPUModelRunner`` (``InputBuffers``: ``query_start_loc``,
    ``seq_lens``, ``positions``; ``BlockTables``: the per-request block table, the forward's input block
    table and the slot mappings; ``req_states.num_computed_tokens``), one set for the backend's life,
    as the runner keeps them: a captured graph reads their addresses."""

    def __init__(self, memory, max_reqs: int, max_tokens: int) -> None:
        from vllm.v1.worker.gpu.block_table import BlockTables
        from vllm.v1.worker.gpu.input_batch import InputBuffers
        dev, ps = memory.device, memory.page_size
        self.memory, self.max_reqs = memory, max_reqs
        self.rows = int(memory.req_to_token.shape[0])          # vLLM's req_state_idx: our request rows
        self.max_blocks = -(-memory.max_context_len // ps)
        self.inputs = InputBuffers(max_reqs, max_tokens, dev)
        self.tables = BlockTables([ps], max_num_reqs=self.rows, max_num_batched_tokens=max_tokens,
                                  max_num_blocks_per_group=[self.max_blocks], device=dev)
        self.num_computed = torch.zeros(self.rows, dtype=torch.int32, device=dev)

    def load_requests(self, rows: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor) -> None:
        """The scheduler's part, with device ops: each request row's block ids (its pages through our
        request-to-token table), its block count, and its computed tokens (``seq_lens - q_lens``)."""
        ps, r2t = self.memory.page_size, self.memory.req_to_token
        cols = torch.arange(self.max_blocks, device=rows.device) * ps
        pages = (r2t[rows.long()][:, cols] // ps).to(torch.int32)
        nblk = (seq_lens + ps - 1) // ps
        pages = torch.where(cols[None, :] < nblk[:, None] * ps, pages, 0)
        self.tables.block_tables[0].gpu[rows.long()] = pages
        self.tables.num_blocks.gpu[0, rows.long()] = nblk.to(torch.int32)
        self.num_computed[rows.long()] = (seq_lens - q_lens).to(torch.int32)

    def prepare(self, rows: torch.Tensor, q_lens_cpu: list, num_reqs_padded: int, num_tokens_padded: int):
        """``prepare_inputs`` + ``prepare_attn`` of the V2 runner for ``len(q_lens_cpu)`` real requests
        (``model_runner.py:1388-1615``): ``query_start_loc`` from the host (pad entries = the token
        count), positions and ``seq_lens`` (pad entries 0) by ``prepare_pos_seq_lens``, the input block
        table by ``gather_block_tables``, the slot mapping by ``compute_slot_mappings`` (pad -1)."""
        from vllm.v1.worker.gpu.input_batch import prepare_pos_seq_lens
        num_reqs = len(q_lens_cpu)
        qsl = np.empty(self.max_reqs + 1, dtype=np.int32)
        qsl[0] = 0
        np.cumsum(np.asarray(q_lens_cpu, dtype=np.int32), out=qsl[1:num_reqs + 1])
        num_tokens = int(qsl[num_reqs])
        qsl[num_reqs + 1:] = num_tokens
        ib = self.inputs
        ib.query_start_loc.copy_(torch.from_numpy(qsl))
        idx = rows[:num_reqs].to(torch.int64)
        qs = ib.query_start_loc[:num_reqs_padded + 1]
        prepare_pos_seq_lens(idx, qs, self.num_computed, ib.positions, ib.seq_lens)
        (table,) = self.tables.gather_block_tables(idx, num_reqs_padded=num_reqs_padded,
                                                   num_computed_tokens=self.num_computed)
        slots = self.tables.compute_slot_mappings(idx, qs, ib.positions, num_tokens_padded=num_tokens_padded)
        return qsl, table, slots[0]

    def dummy(self, num_reqs: int, num_tokens: int):
        """What ``prepare_inputs_to_capture`` hands a FULL capture (``cudagraph_utils.py:827``):
        ``InputBatch.make_dummy`` (seq_lens = query lens), zeroed block tables, slot mappings all -1."""
        from vllm.v1.worker.gpu.input_batch import InputBatch
        batch = InputBatch.make_dummy(num_reqs, num_tokens, self.inputs)
        (table,) = self.tables.get_dummy_block_tables(num_reqs)
        slots = self.tables.get_dummy_slot_mappings(num_tokens)
        return batch, table, slots[0]

    def buffers(self) -> dict:
        """Every persistent tensor a captured attention kernel reads (the suite poisons them)."""
        ib = self.inputs
        return {"query_start_loc": ib.query_start_loc, "seq_lens": ib.seq_lens,
                "input_block_table": self.tables.input_block_tables[0], "slot_mappings": self.tables.slot_mappings}


def common_metadata(qsl_cpu, qsl, seq_lens, table, slots, num_reqs: int, num_tokens: int, max_query_len: int,
                    max_seq_len: int):
    """vLLM's ``CommonAttentionMetadata`` as ``build_attn_metadata`` makes it (``attn_utils.py:527``)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    return CommonAttentionMetadata(
        query_start_loc=qsl[:num_reqs + 1], query_start_loc_cpu=torch.from_numpy(np.array(qsl_cpu[:num_reqs + 1])),
        seq_lens=seq_lens[:num_reqs], num_reqs=num_reqs, num_actual_tokens=num_tokens, max_query_len=max_query_len,
        max_seq_len=max_seq_len, block_table_tensor=table[:num_reqs], slot_mapping=slots[:num_tokens], causal=True)
