"""The ``triton``, ``triton_mla`` and ``trtllm_mla`` (its block table, the Triton kernel off SM100)
backends against the float64 reference: eager and through the graph metadata path, every
declared mode. On the CPU this runs the kernels under
TRITON_INTERPRET=1 (small shapes, float32); on a GPU the same test runs for real."""
import pytest
import torch
from reference import dense_reference
from test_torch_native import named_batches

from attn_backends import ModelConfig, get_backend
from attn_backends.check.scenarios import make_memory, materialize
from attn_backends.registry import list_backends

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter on the CPU; on a GPU these are GPU tests (`pytest -m cuda` picks them)
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []
AVAILABLE = {b.name for b in list_backends(DEVICE) if b.available}


def _setup(backend, ps):
    mla = backend in ("triton_mla", "trtllm_mla")
    cfg = ModelConfig(num_layers=2, num_q_heads=4, num_kv_heads=1 if mla else 2, head_dim=16, is_mla=mla,
                      kv_lora_rank=32, qk_rope_head_dim=16, page_size=ps)
    mem = make_memory(cfg, num_pages=1024 // ps + 4, max_reqs=12, max_context_len=128,
                      page_order="shuffled", seed=ps, device=DEVICE)
    return cfg, mem, get_backend(backend, cfg, mem)


def _qkv(cfg, n, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    v = None if cfg.is_mla else mk(n, cfg.num_kv_heads, cfg.v_head_dim)
    return mk(n, cfg.num_q_heads, cfg.qk_dim), mk(n, cfg.num_kv_heads, cfg.qk_dim), v


def _rel_err(out, ref):
    real = ~ref[:, 0, 0].isnan()
    return float((out.cpu()[real].double() - ref[real]).norm() / ref[real].norm()), real


CASES = [(b, ps, n) for b in ("triton", "triton_mla", "trtllm_mla") for ps in (1, 16) for n in named_batches()]


@pytest.mark.parametrize("backend,ps,name", CASES)
def test_triton_backend_matches_float64(backend, ps, name):
    if backend not in AVAILABLE:
        pytest.skip(f"{backend} unavailable on {DEVICE}")
    cfg, mem, be = _setup(backend, ps)
    m = materialize(named_batches()[name](), mem, be.get_cuda_graph_seq_len_fill_value())
    q, k, v = _qkv(cfg, m.batch.num_tokens, ps)
    be.init_forward_metadata(m.batch)
    out = be.forward(q, k, v, cfg.layer(1), m.batch)
    err, real = _rel_err(out, dense_reference(m.batch, mem, 1, q.cpu(), cfg.layer(1).scaling, cfg.kv_lora_rank))
    assert err < 1e-4, f"relative error {err:.2e}"
    if m.batch.raw_bs < m.batch.batch_size or name.startswith("extend"):
        assert torch.isfinite(out).all()
    if name in ("decode_padded", "verify_tree", "draft_extend", "draft_decode_topk4"):
        # graph metadata path: capture another batch, replay this one: equal to eager bitwise
        cap = materialize(named_batches()[name](), mem, be.get_cuda_graph_seq_len_fill_value())
        be.init_cuda_graph_state(8, 64)
        be.init_forward_metadata_capture_cuda_graph(cap.batch.graph_inputs())
        be.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
        out_graph = be.forward(q, k, v, cfg.layer(1), m.batch, save_kv_cache=False)
        assert torch.equal(out_graph[real.to(out.device)], out[real.to(out.device)])


LEAN = [(b, n) for b in ("triton", "triton_mla") for n in ("decode_padded", "extend_ragged", "verify_tree",
                                                           "draft_extend")]
if DEVICE == "cpu":   # the interpreter replays nothing (every call runs the wrapper): two cases keep the
    LEAN = [("triton", "decode_padded"), ("triton_mla", "verify_tree")]   # bookkeeping checked, at less cost


@pytest.mark.parametrize("backend,name", LEAN)
def test_eager_step_replays_its_recorded_launches(backend, name):
    """The eager path validates once per step: the first call runs the kernel wrapper, later
    calls replay its launches with their own q, layer KV and output (on CUDA; the interpreter
    has no compiled kernel to call, so every call runs the wrapper). Every output against the
    float64 reference: a replay that kept the first call's q or KV fails here. A q of other
    strides is refused by the replay and runs the wrapper again."""
    if backend not in AVAILABLE:
        pytest.skip(f"{backend} unavailable on {DEVICE}")
    cfg, mem, be = _setup(backend, 16)
    m = materialize(named_batches()[name](), mem, be.get_cuda_graph_seq_len_fill_value())
    be.init_forward_metadata(m.batch)
    n, scale = m.batch.num_tokens, cfg.layer(0).scaling
    wide = torch.randn(n, cfg.num_q_heads + 1, cfg.qk_dim, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    calls = [(0, 1), (1, 2), (0, 3), (1, None)]            # (layer, q seed); None: q with other strides
    for layer, seed in calls:
        q, k, v = _qkv(cfg, n, seed if seed is not None else 4)
        if seed is None:
            q = wide[:, :cfg.num_q_heads]
        out = be.forward(q, k, v, cfg.layer(layer), m.batch)
        ref = dense_reference(m.batch, mem, layer, q.cpu(), scale, cfg.kv_lora_rank)
        err, _ = _rel_err(out, ref)
        assert err < 1e-4, f"layer {layer}, q seed {seed}: relative error {err:.2e}"
        if seed == 3:
            first = be.forward_metadata.book[(scale, 1.0, 1.0)]
    rec = be.forward_metadata.book[(scale, 1.0, 1.0)]
    if DEVICE == "cuda":
        assert first.usable and first.replays == 2, f"usable {first.usable}, replays {first.replays} (want 2)"
        assert rec is not first and rec.facts[0][2] == wide[:, :cfg.num_q_heads].stride(), \
            "the strided q was not recorded anew"
    else:
        assert not rec.usable and rec is first


@pytest.mark.parametrize("backend", ["triton", "triton_mla"])
def test_graph_workspace_has_counters_only_where_the_merge_fuses(backend):
    """A graph key's split workspace: (part, lse, counters) for the GQA kernels, which may merge
    their own partials; (part, lse) for the MLA kernels, which never do (counters there would
    be allocated for nothing)."""
    if backend not in AVAILABLE:
        pytest.skip(f"{backend} unavailable on {DEVICE}")
    cfg, mem, be = _setup(backend, 16)
    cap = materialize(named_batches()["decode_padded"](), mem, be.get_cuda_graph_seq_len_fill_value())
    be.init_cuda_graph_state(8, 64)
    be.init_forward_metadata_capture_cuda_graph(cap.batch.graph_inputs())
    ws = be.forward_metadata.workspace
    assert be.forward_metadata.num_kv_splits > 1 and ws is not None
    assert len(ws) == (3 if backend == "triton" else 2), [tuple(t.shape) for t in ws]


@pytest.mark.parametrize("backend", ["triton", "triton_mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("name", ["verify_tree", "decode_padded"])
@pytest.mark.parametrize("latent,rope", [(512, 64), (32, 16)])
def test_graph_workspace_partials_dtype(backend, dtype, page_size, name, latent, rope, monkeypatch):
    """A graph key's split partials, as if on an sm_90 GPU: the KV cache's 16-bit dtype where the
    MLA wrapper's default runs a warp-specialized kernel (64-row tiles: verify of 16 heads; 512 +
    64 dims; pages of whole 32-token tiles), float32 elsewhere (16-head decode tiles, other dims,
    page 16, float32, GQA), as the wrapper allocates its own; the lse always float32."""
    if backend not in AVAILABLE:
        pytest.skip(f"{backend} unavailable on {DEVICE}")
    import attn_backends_kernels.mla.warpspec as warpspec
    monkeypatch.setattr(warpspec, "hopper_device", lambda device: True)
    mla = backend == "triton_mla"
    cfg = ModelConfig(num_layers=1, num_q_heads=16, num_kv_heads=1 if mla else 2, head_dim=16, is_mla=mla,
                      kv_lora_rank=latent, qk_rope_head_dim=rope, page_size=page_size, dtype=dtype)
    mem = make_memory(cfg, num_pages=4096 // page_size, max_reqs=12, max_context_len=128, device=DEVICE,
                      fill=False)
    be = get_backend(backend, cfg, mem)
    cap = materialize(named_batches()[name](), mem, be.get_cuda_graph_seq_len_fill_value())
    be.init_cuda_graph_state(8, 64)
    be.init_forward_metadata_capture_cuda_graph(cap.batch.graph_inputs())
    part, lse = be.forward_metadata.workspace[:2]
    assert be.forward_metadata.num_kv_splits > 1
    half = mla and dtype != torch.float32 and page_size == 64 and name == "verify_tree" and latent == 512
    assert part.dtype == (dtype if half else torch.float32) and lse.dtype == torch.float32
