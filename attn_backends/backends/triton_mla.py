"""``triton_mla``: absorbed MLA over the latent cache ``[slots, 1, latent 512 + rope 64]``.

Every mode runs the MLA kernel, which loads each latent tile once for a block of query
rows and heads and uses it as both K (all 576 columns) and V (the latent 512): DECODE,
TARGET_VERIFY (chain and tree), DRAFT_EXTEND, draft decode (branch mask) and ragged EXTEND
(rows from ``cu_seqlens_q``, the grid sized by the host bound ``max_seq_len_q``). With
the chunk schedule (``schedule = "auto"``, the default, on a 16-bit cache on sm_90; ``"chunks"``,
``BalancedTritonMLABackend``, everywhere) the uniform modes run the chunk schedule's pass
(``kernels/mla/balanced.py``) instead.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from attn_backends_kernels.kv_store import store_mla_kv
from attn_backends_kernels.launch_record import Recorded, recording
from attn_backends_kernels.mla.attention import mla_attention_fwd, tile_shape
from attn_backends_kernels.mla.balanced import mla_chunk_fwd, mla_chunk_plan
from attn_backends_kernels.mla.swap import decodes_transposed
from attn_backends_kernels.mla.warpspec import partial_dtype
from attn_backends_kernels.mla.wgmma import hopper_device

from ..base import Capabilities, GraphSupport, LayoutBackend
from ..batch import ForwardMode
from ..config import FP8_KV, AttentionLayer
from ..layout import MaskKind
from ..step import LibraryKey, Prep, StepView
from .triton_common import TritonBackendBase, TritonMetadata

ALL_MODES = frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                       ForwardMode.DRAFT_EXTEND})


class TritonMLABackend(TritonBackendBase):
    name: ClassVar[str] = "triton_mla"
    capabilities: ClassVar[Capabilities] = Capabilities(
        modes=ALL_MODES, mha=False, mla=True, page_sizes=(1, 16, 64), topk_gt1=True,
        graph=GraphSupport.UNIFORM_BATCH, devices=("cpu", "cuda"), requires=("triton",), kv_dtypes=FP8_KV)
    fuses_merge: ClassVar[bool] = False       # the MLA kernels merge in a separate pass
    # "chunks": the uniform modes cut the batch's KV into equal chunks on the device
    # (``kernels/mla/balanced.py``, merged by a second launch); "split": equal splits of every
    # request; "auto" (the default): chunks where the Gluon kernels run them (a 16-bit cache on
    # sm_90: far faster on ragged, long-tail and bimodal batches, 0.99-1.07x the split's time on
    # uniform ones), the split elsewhere (FP8 caches and the Triton tile: chunks not measured there;
    # figures: bench/RESULTS.md, 'Ragged batches').
    schedule = "auto"
    chunk_merge = "pass"
    SCHEDULES: ClassVar[tuple] = ("split", "chunks", "auto")

    def _programs(self, bs: int, width: int) -> int:
        block_w, block_h = tile_shape(width, self.config.num_q_heads)          # the wrapper's tiles
        return bs * -(-width // block_w) * -(-self.config.num_q_heads // block_h)

    # Verify: two 64-token tiles a split where that leaves a quarter of the SMs a program
    # (bench/RESULTS.md, 'Split counts').
    SPLIT_TOKENS: ClassVar[int] = 128

    def _split_rule(self, width: int, lay=None) -> tuple:
        """Verify: one program an SM. Decode with >= 64 heads: one 64-head program an SM. Decode
        of 16-head tiles: two programs an SM on the Triton kernel, one on the transposed kernel
        (``mla.swap``, which the wrapper's default takes for uniform causal rows where
        ``decodes_transposed``; a q whose strides it refuses runs on the Triton kernel at this
        count). The transposed kernel holds a whole SM's shared memory, so one program an SM is its
        full occupancy (bench/RESULTS.md, 'MLA kernels')."""
        if width > 1 or self.config.num_q_heads >= 64:
            return 1, 1, None
        uniform_causal = lay is None or (lay.mode != ForwardMode.EXTEND and lay.mask == MaskKind.CAUSAL)
        transposed = uniform_causal and self._decodes_transposed()      # either schedule (mla.balanced)
        return (1 if transposed else 2), 1, None

    def _waves_allowed(self, lay) -> bool:
        """Decode where the Gluon chunk pass serves it (a 16-bit cache of the 512 + 64 layout on sm_90:
        ``wgmma_refusal``), which caps the budget's chunks and runs the largest first (``chunk_map.gluon_chunk_of``),
        on the tiles it was measured on: 64-head tiles (64 heads or more; measured at 64 and 128) and 16 heads on the
        transposed kernel (``_split_rule``'s one program an SM; 32 or 48 heads, two or three 16-head tiles a request,
        not measured)."""
        return lay.mode == ForwardMode.DECODE and (lay.width or 1) == 1 and self._waves_facts()

    def _waves_facts(self) -> bool:
        """``_waves_allowed``'s facts of the model and the KV memory."""
        cfg = self.config
        return ((cfg.num_q_heads >= 64 or cfg.num_q_heads == 16)
                and (cfg.kv_lora_rank, cfg.qk_rope_head_dim) == (512, 64)
                and self.memory.pool.kv[0].dtype in (torch.float16, torch.bfloat16)
                and hopper_device(self.memory.device))

    # A budget of several waves' chunk size planned once a step (``kernels/mla/chunk_plan.py``: a wave model of the
    # grid, one program over the device's lengths) by the update (eager, capture, every replay: outside the step's
    # graph, as FlashInfer's plan()), read by every layer's chunk pass and merge: fewer, larger chunks where the capped
    # fit's last wave is nearly empty (bench/RESULTS.md, 'Ragged batches'). A runner then preps the layout before it.
    PLAN_STEP: ClassVar[bool] = True

    @property
    def replay_work(self) -> bool:
        """The step's plan where one may run (``_plans``), or replay work a subclass adds."""
        cls = type(self)
        return self._plans() or cls._update is not TritonMLABackend._update or \
            cls.init_forward_metadata_replay_cuda_graph is not LayoutBackend.init_forward_metadata_replay_cuda_graph

    def _plans(self) -> bool:
        """Whether this instance plans its budgets of several waves: PLAN_STEP where one may run (``_waves_facts``,
        the chunk schedule at the exact count, 16 heads on the transposed kernel)."""
        return (self.PLAN_STEP and self.schedule in ("chunks", "auto") and self.chunk_merge == "pass"
                and self.EXACT_CHUNK_SPLITS and self._waves_facts()
                and (self.config.num_q_heads >= 64 or self._decodes_transposed()))

    def _metadata(self, view: StepView, key) -> TritonMetadata:
        meta = super()._metadata(view, key)
        # a graph key plans at its replays only where its step preps the layout before the update (else the update
        # would read the last step's lengths), as the runner does where replay_work was true at init_cuda_graph_state
        if meta.many_waves and self._plans() and (key is None or (self._replays and view.prep is Prep.BEFORE_UPDATE)):
            meta.plan = self._plan_state(view, meta)
            meta.workspace = meta.plan["ws"]        # the step's, one for every instance, which the plan writes
        return meta

    def _plan_state(self, view: StepView, meta: TritonMetadata) -> dict:
        """What every instance over this memory shares for the plan of ``view``'s key (an eager step: of the step):
        the workspace it writes, q's and out's facts (``mla_chunk_plan``), the graph key's recorded launch, the step
        it last planned and whether it planned; in the step's cache, as ``_step_book``'s launches."""
        owner = LibraryKey(type(self), (self.config, id(self.memory), self.schedule, self.chunk_merge,
                                        self.EXACT_CHUNK_SPLITS), view.key, "planned chunk size")
        state = view.cache.get(owner)
        if state is None or (view.key is None and state["made"] != view.step_id):
            lay, cfg = view.layout, self.config
            rows, dv, dev = lay.bs * (lay.width or 1), cfg.kv_lora_rank, self.memory.device
            one = torch.empty((1, cfg.num_q_heads, dv + cfg.qk_rope_head_dim), dtype=cfg.dtype, device=dev)
            ws = meta.workspace if view.key is not None else \
                self._chunk_workspace(lay, lay.bs, lay.width or 1, meta.num_kv_splits)
            state = view.cache[owner] = dict(made=view.step_id, ws=ws, q=one.expand(rows, -1, -1),
                                             out=one[..., :dv].expand(rows, -1, -1), rec=None, step=None, planned=False)
        return state

    def _update(self, meta: TritonMetadata, view: StepView) -> None:
        """Plan the step's chunk size (``mla_chunk_plan``) once for every instance: a graph key's launch recorded once
        and replayed (its tensors are the key's); a key whose capture planned none plans at no replay."""
        state = meta.plan
        if state is None:
            return
        if state["step"] != view.step_id:
            state["step"] = view.step_id
            rec = state["rec"]
            if rec is None or not rec.replay(()):
                with recording() as launches:
                    state["planned"] = self._plan(state, meta, view)
                if meta.key is not None and state["planned"]:
                    state["rec"] = Recorded(launches, ())
        meta.planned = state["planned"]
        if not meta.planned and meta.key is not None:
            meta.plan = None

    def _plan(self, state: dict, meta: TritonMetadata, view: StepView) -> bool:
        lay = view.layout
        return mla_chunk_plan(state["q"], self.memory.pool.kv[0], lay.page_table, lay.seq_lens_k, lay.page_size,
                              meta.num_kv_splits, state["out"], state["ws"], q_per_req=lay.width or 1,
                              mask=lay.mask.value, custom_mask=lay.custom_mask, draft_prefix_lens=lay.draft_prefix_lens,
                              fit=meta.wave_fit, many_waves=meta.many_waves)

    def _kernel_schedule(self) -> str:
        return "chunks" if self.schedule == "auto" else self.schedule     # "auto" chunks where _chunked says

    def _decodes_transposed(self) -> bool:
        return decodes_transposed(self.memory.device, self.memory.pool.kv[0].dtype, self.memory.page_size)

    def _part_dtype(self, width: int) -> torch.dtype:
        block_w, block_h = tile_shape(width, self.config.num_q_heads)          # the wrapper's tiles
        return partial_dtype(self.memory.pool.kv[0].dtype, self.memory.device, self.memory.page_size,
                             block_w * block_h, self.config.kv_lora_rank, self.config.qk_rope_head_dim)

    def _store_kv(self, layer: AttentionLayer, loc: torch.Tensor, k, v) -> None:
        r = self.config.kv_lora_rank
        store_mla_kv(k[..., :r], k[..., r:], self.memory.pool.kv[layer.layer_id], loc, layer.k_scale)

    def _kv_buffers(self, layer: AttentionLayer) -> tuple:
        return (self.memory.pool.kv[layer.layer_id],)

    def _chunked(self, lay) -> bool:
        if self.schedule not in self.SCHEDULES or self.chunk_merge != "pass":
            raise ValueError(f"triton_mla: schedule={self.schedule!r} not in {self.SCHEDULES}, or chunk_merge="
                             f"{self.chunk_merge!r} not 'pass' (no batch-invariant MLA mode; one chunk merge)")
        if lay.mode == ForwardMode.EXTEND:
            return False
        if self.schedule == "auto":
            return self.memory.pool.kv[0].dtype in (torch.float16, torch.bfloat16) and hopper_device(self.memory.device)
        return self.schedule == "chunks"

    def _launch(self, q: torch.Tensor, kv: tuple, out: torch.Tensor, layer: AttentionLayer,
                meta: TritonMetadata) -> None:
        lay = meta.layout
        splits, ws = meta.num_kv_splits, meta.workspace
        if self._chunked(lay):
            mla_chunk_fwd(q, kv[0], lay.page_table, lay.seq_lens_k, lay.page_size, layer.scaling, splits, out,
                          q_per_req=lay.width or 1, mask=lay.mask.value, custom_mask=lay.custom_mask, workspace=ws,
                          draft_prefix_lens=lay.draft_prefix_lens, schedule=self._kernel_schedule(),
                          merge=self.chunk_merge, kv_scale=layer.k_scale, fit=meta.wave_fit, many_waves=meta.many_waves,
                          planned=meta.planned)
            return
        ragged = lay.mode == ForwardMode.EXTEND
        mla_attention_fwd(q, kv[0], lay.page_table, lay.seq_lens_k, lay.page_size, layer.scaling,
                          splits, out, q_per_req=lay.width or 1, mask=lay.mask.value,
                          custom_mask=lay.custom_mask, workspace=ws,
                          cu_seqlens_q=lay.cu_seqlens_q if ragged else None,
                          max_q_len=lay.max_seq_len_q if ragged else None,
                          draft_prefix_lens=lay.draft_prefix_lens, kv_scale=layer.k_scale)


class BalancedTritonMLABackend(TritonMLABackend):
    """``triton_mla`` with ``schedule = "chunks"`` (the uniform modes balanced over equal KV chunks
    on the device), by name for ``attn-backends check --backend
    attn_backends.backends.triton_mla:BalancedTritonMLABackend`` and the sweep's ``--mla-backend``."""

    name: ClassVar[str] = "triton_mla_balanced"
    schedule = "chunks"


class SplitTritonMLABackend(TritonMLABackend):
    """``triton_mla`` with ``schedule = "split"`` (equal splits of every request: 1.0-1.06x faster than the
    chunks on some uniform batches, far slower on ragged ones), by name as ``BalancedTritonMLABackend``."""

    name: ClassVar[str] = "triton_mla_split"
    schedule = "split"


class Pow2SplitsTritonMLABackend(TritonMLABackend):
    """``triton_mla`` without ``EXACT_CHUNK_SPLITS`` (chunked launches at a power of two below the
    split rule's count, and so without the wave fit), by name as ``BalancedTritonMLABackend``."""

    name: ClassVar[str] = "triton_mla_pow2"
    EXACT_CHUNK_SPLITS: ClassVar[bool] = False
