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


def _config() -> ModelConfig:
    return ModelConfig(num_layers=2, num_q_heads=128, num_kv_heads=1, head_dim=16, is_mla=True, kv_lora_rank=512,
                       qk_rope_head_dim=64, page_size=64, dtype=torch.bfloat16)


def _memory(cfg, batches: int):
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the batches' plans are chosen for 132 SMs (an H200 or H100 SXM)")
    return make_memory(cfg, num_pages=600 * batches, max_reqs=34 * batches, max_context_len=4096,
                       page_order="shuffled", seed=7, device="cuda")


def _backend(mem, cfg, plans: bool) -> TritonMLABackend:
    be = TritonMLABackend(cfg, mem)
    be.PLAN_STEP = plans
    return be


def _published(be) -> int:
    """The chunk size (tiles) the key's chunk pass read: the log-sum-exp row past its slots."""
    return int(be.forward_metadata.workspace[1][-1, 0].item())


def _captured(fn):
    """``(graph, outputs)`` of ``fn`` captured after a warm-up on a side stream (Triton compiles outside capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = fn()
    return g, outs


def test_triton_mla_plans_a_budget_of_waves_once_a_step():
    """Replays of one captured CUDA graph of two layers over batches A, B, A: each replay update plans from its own
    lengths (the published size is ``planned_tiles`` of them, larger than the capped fit's, which a backend without
    the plan publishes), both layers read it, the graph's outputs equal eager calls bitwise and the float64
    reference."""
    from attn_backends_kernels.mla.chunk_plan import planned_tiles
    cfg = _config()
    mem = _memory(cfg, 5)
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
    q = torch.zeros(34, 128, 576, device="cuda", dtype=torch.bfloat16)
    graph, graph_out = _captured(lambda: [planner.forward(q, None, None, cfg.layer(i), cap.batch, save_kv_cache=False)
                                          for i in (0, 1)])
    g = torch.Generator().manual_seed(11)
    seen = {}
    for name, lens in (("A", A), ("B", B), ("A", A)):
        m = materialize(Scenario(ForwardMode.DECODE, 34, lens), mem, fill)
        q.copy_(torch.randn(34, 128, 576, generator=g).to("cuda", torch.bfloat16))
        plain.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
        plain.forward(q, None, None, cfg.layer(0), m.batch, save_kv_cache=False)
        fit = _published(plain)
        replays = meta.plan["rec"].replays
        planner.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
        assert meta.plan["rec"].replays == replays + 1, "a replay update that did not plan its step"
        graph.replay()
        want = planned_tiles([-(-x // 64) for x in lens], fit, 2, 132, 64)
        assert want > fit, f"batch {name}: the plan keeps the fit's {fit} tiles, the case is not exercised"
        assert _published(planner) == want, f"batch {name}: the graph read {_published(planner)} tiles"
        planner.init_forward_metadata(m.batch)
        assert planner.forward_metadata.planned
        for layer in (0, 1):            # every layer reads the step's plan
            eager = planner.forward(q, None, None, cfg.layer(layer), m.batch, save_kv_cache=False)
            assert torch.equal(eager, graph_out[layer]), f"batch {name}, layer {layer}: eager differs from the graph"
            ref = dense_reference(m.batch, mem, layer, q.cpu(), cfg.layer(layer).scaling, cfg.kv_lora_rank)
            err = float((eager.cpu().double() - ref).norm() / ref.norm())
            assert err < 1e-2, f"batch {name}, layer {layer}: relative error {err:.2e}"
        assert int(planner.forward_metadata.workspace[1][-1, 0].item()) == want
        seen.setdefault(name, want)
    assert seen["A"] != seen["B"], "batches of one plan: a stale plan would pass"


def test_the_instances_of_a_step_plan_once(monkeypatch):
    """Two ``triton_mla`` instances on one step (a backend per layer) share its workspace and plan once: an eager
    step, each new eager step, a graph key's capture and each of its replays."""
    from attn_backends.step import Step
    from attn_backends.step.eager import eager_step
    from attn_backends_kernels.mla import balanced
    cfg = _config()
    mem = _memory(cfg, 4)
    a, b = TritonMLABackend(cfg, mem), TritonMLABackend(cfg, mem)
    calls = []
    real = balanced.plan_chunks
    monkeypatch.setattr(balanced, "plan_chunks", lambda *x: calls.append(1) or real(*x))
    fill = a.get_cuda_graph_seq_len_fill_value()
    for step in range(2):
        m = materialize(Scenario(ForwardMode.DECODE, 34, A), mem, fill)
        batch = eager_step(m.batch, [a, b])
        a.init_forward_metadata(batch)
        b.init_forward_metadata(batch)
        assert a.forward_metadata.workspace is b.forward_metadata.workspace
        assert a.forward_metadata.planned and b.forward_metadata.planned
        assert len(calls) == step + 1, f"eager step {step}: {len(calls)} plans"
    for be in (a, b):
        be.init_cuda_graph_state(34, 34)
    step = Step(mem, fill, max_bs=34, max_width=1, prep=prep_placement([a, b]))
    cap = materialize(Scenario(ForwardMode.DECODE, 34, C), mem, fill)
    gi = step.graph_inputs(cap.batch.graph_key(), step.capture_inputs(cap.batch.graph_inputs()))
    del calls[:]
    for be in (a, b):
        be.init_forward_metadata_capture_cuda_graph(gi)
    assert len(calls) == 1, f"{len(calls)} plans for one capture of two instances"
    ma, mb = a.forward_metadata, b.forward_metadata
    assert ma.workspace is mb.workspace and ma.plan is mb.plan and ma.planned and mb.planned
    m = materialize(Scenario(ForwardMode.DECODE, 34, B), mem, fill)
    for _ in range(2):
        gi = step.graph_inputs(m.batch.graph_key(), step.update_inputs(m.batch.graph_inputs()))
        replays = ma.plan["rec"].replays
        for be in (a, b):
            be.init_forward_metadata_replay_cuda_graph(gi)
        assert ma.plan["rec"].replays == replays + 1, "two instances, not one plan a replay"


def test_a_key_plans_only_where_its_replays_do():
    """A graph key plans only where every replay will plan again: not for a backend whose replay does no work
    (``replay_work`` false at ``init_cuda_graph_state``, the plan switched on after), nor on a step whose layout prep
    runs in the step's graph (the update would read the last step's lengths); such a key runs the capped fit."""
    from attn_backends.step import Step
    cfg = _config()
    mem = _memory(cfg, 3)
    fill = 1
    late = _backend(mem, cfg, False)
    late.init_cuda_graph_state(34, 34)
    late.PLAN_STEP = True
    cap = materialize(Scenario(ForwardMode.DECODE, 34, C), mem, fill)
    late.init_forward_metadata_capture_cuda_graph(cap.batch.graph_inputs())
    assert late.forward_metadata.many_waves and late.forward_metadata.plan is None
    assert not late.forward_metadata.planned
    planner = _backend(mem, cfg, True)
    planner.init_cuda_graph_state(34, 34)
    step = Step(mem, fill, max_bs=34, max_width=1, prep=Prep.IN_STEP_GRAPH)
    cap = materialize(Scenario(ForwardMode.DECODE, 34, C), mem, fill)
    gi = step.graph_inputs(cap.batch.graph_key(), step.capture_inputs(cap.batch.graph_inputs()))
    planner.init_forward_metadata_capture_cuda_graph(gi)
    assert planner.forward_metadata.many_waves and planner.forward_metadata.plan is None
