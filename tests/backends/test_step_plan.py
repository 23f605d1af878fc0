"""``triton_mla``'s chunk size planned once a step (``PLAN_STEP``, ``kernels/mla/chunk_plan.py``): MLA-128 decode at
bs 34, a budget of several waves on the Gluon chunk pass (sm_90), over bimodal lengths whose plan takes larger chunks
than the capped fit's. Eager and every replay plan from the step's own lengths; every layer reads that plan; the
graph path equals eager bitwise and both the float64 reference."""
import pytest
import torch
from reference import dense_reference

from attn_backends import ForwardMode, ModelConfig
from attn_backends.backends.triton_mla import TritonMLABackend
from attn_backends.check.scenarios import Scenario, make_memory, materialize
from attn_backends.step import Prep, prep_placement

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="the Gluon chunk pass runs a budget of several waves on sm_90 alone")]

# bs 34 of 128 heads on 132 SMs: 68 programs a chunk, one chunk a request leaves half the SMs idle, so 5 a request
# (``schedule.many_waves``); bimodal lengths whose capped fit is 4 tiles (of 64 tokens), the plan's 7 and 8
A = [1732, 464, 3706, 394, 126, 2183, 349, 498, 2429, 347, 571, 273, 254, 1635, 356, 368, 233, 586, 304, 471, 1645, 411,
     599, 196, 140, 446, 324, 314, 492, 3752, 161, 576, 143, 297]
B = [516, 415, 2035, 349, 590, 570, 251, 188, 199, 554, 144, 394, 3122, 3379, 540, 2723, 510, 2165, 532, 496, 267, 290,
     415, 201, 393, 263, 412, 458, 353, 303, 3436, 3295, 407, 562]
C = [4000] * 3 + [64] * 31          # the capture's batch


def _backend(mem, cfg, plans: bool) -> TritonMLABackend:
    be = TritonMLABackend(cfg, mem)
    be.PLAN_STEP = plans
    return be


def _published(be) -> int:
    """The chunk size (tiles) the key's chunk pass read: the log-sum-exp row past its slots."""
    return int(be.forward_metadata.workspace[1][-1, 0].item())


def test_triton_mla_plans_a_budget_of_waves_once_a_step():
    from attn_backends_kernels.mla.chunk_plan import planned_tiles
    cfg = ModelConfig(num_layers=2, num_q_heads=128, num_kv_heads=1, head_dim=16, is_mla=True, kv_lora_rank=512,
                      qk_rope_head_dim=64, page_size=64, dtype=torch.bfloat16)
    mem = make_memory(cfg, num_pages=2400, max_reqs=5 * 34, max_context_len=4096, page_order="shuffled", seed=7,
                      device="cuda")
    plain, planner = _backend(mem, cfg, False), _backend(mem, cfg, True)
    assert (plain.replay_work, planner.replay_work) == (False, True)
    assert prep_placement([planner]) is Prep.BEFORE_UPDATE and prep_placement([plain]) is Prep.IN_STEP_GRAPH
    fill = planner.get_cuda_graph_seq_len_fill_value()
    cap = materialize(Scenario(ForwardMode.DECODE, 34, C), mem, fill)
    for be in (plain, planner):
        be.init_cuda_graph_state(34, 34)
        be.init_forward_metadata_capture_cuda_graph(cap.batch.graph_inputs())
    meta = planner.forward_metadata
    assert meta.many_waves and meta.planned, "bs 34 of 128 heads: a budget of several waves, planned (132 SMs)"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator().manual_seed(11)
    seen = {}
    for name, lens in (("A", A), ("B", B), ("A", A)):
        m = materialize(Scenario(ForwardMode.DECODE, 34, lens), mem, fill)
        q = torch.randn(34, 128, 576, generator=g).to("cuda", torch.bfloat16)
        plain.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
        plain.forward(q, None, None, cfg.layer(0), m.batch, save_kv_cache=False)
        fit = _published(plain)
        replays = meta.book["plan"].replays
        planner.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
        assert meta.book["plan"].replays == replays + 1, "a replay that did not plan its step"
        want = planned_tiles([-(-x // 64) for x in lens], fit, 2, sms, 64)
        assert want > fit, f"batch {name}: the plan keeps the fit's {fit} tiles, the case is not exercised"
        outs = []
        for layer in (0, 1):            # every layer reads the step's plan
            outs.append(planner.forward(q, None, None, cfg.layer(layer), m.batch, save_kv_cache=False))
            assert _published(planner) == want, f"batch {name}, layer {layer}: read {_published(planner)} tiles"
            ref = dense_reference(m.batch, mem, layer, q.cpu(), cfg.layer(layer).scaling, cfg.kv_lora_rank)
            err = float((outs[-1].cpu().double() - ref).norm() / ref.norm())
            assert err < 1e-2, f"batch {name}, layer {layer}: relative error {err:.2e}"
        planner.init_forward_metadata(m.batch)
        assert planner.forward_metadata.planned
        for layer in (0, 1):
            eager = planner.forward(q, None, None, cfg.layer(layer), m.batch, save_kv_cache=False)
            assert torch.equal(eager, outs[layer]), f"batch {name}, layer {layer}: eager differs from the replay"
        assert int(planner.forward_metadata.workspace[1][-1, 0].item()) == want
        seen.setdefault(name, want)
    assert seen["A"] != seen["B"], "batches of one plan: a stale plan would pass"


def test_an_eager_step_plans_once_for_every_instance(monkeypatch):
    """Two ``triton_mla`` instances on one eager step (a backend per layer) share the step's workspace and plan it
    once; a new step plans again."""
    from attn_backends.step.eager import eager_step
    from attn_backends_kernels.mla import balanced
    cfg = ModelConfig(num_layers=2, num_q_heads=128, num_kv_heads=1, head_dim=16, is_mla=True, kv_lora_rank=512,
                      qk_rope_head_dim=64, page_size=64, dtype=torch.bfloat16)
    mem = make_memory(cfg, num_pages=1200, max_reqs=2 * 34, max_context_len=4096, page_order="shuffled", seed=7,
                      device="cuda")
    a, b = TritonMLABackend(cfg, mem), TritonMLABackend(cfg, mem)
    calls = []
    real = balanced.plan_chunks
    monkeypatch.setattr(balanced, "plan_chunks", lambda *x: calls.append(1) or real(*x))
    for step in range(2):
        m = materialize(Scenario(ForwardMode.DECODE, 34, A), mem, a.get_cuda_graph_seq_len_fill_value())
        batch = eager_step(m.batch, [a, b])
        a.init_forward_metadata(batch)
        b.init_forward_metadata(batch)
        assert a.forward_metadata.workspace is b.forward_metadata.workspace
        assert a.forward_metadata.planned and b.forward_metadata.planned
        assert len(calls) == step + 1, f"step {step}: {len(calls)} plans"
