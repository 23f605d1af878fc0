"""The FP8-cache check the backend tests share (tests/backends/test_fp8_triton*.py): one forward of a
scenario on a pool whose every unused slot holds an FP8 NaN byte, the stored bytes against the
reference quantization, the output against float64 over the dequantized cache, and the graph path
against eager bitwise."""
import torch
from reference import dense_reference

from attn_backends.check.scenarios import materialize
from attn_backends.kv_cache import to_cache


def poison_unread(mem, batch) -> None:
    """NaN (an FP8 NaN byte, 0x7F in both formats) in every slot but the real requests' tokens."""
    pools = mem.pool.kv if mem.is_mla else mem.pool.k + mem.pool.v
    read = torch.zeros(pools[0].shape[0], dtype=torch.bool, device=pools[0].device)
    for i in range(batch.raw_bs):
        read[mem.req_to_token[int(batch.req_pool_indices[i]), :int(batch.seq_lens_cpu[i])].long()] = True
    for b in pools:
        b.view(torch.uint8)[~read] = 0x7F


def check_fp8_forward(be, cfg, mem, scenario, qkv, extend: bool, tol: float, layer_id: int = 1) -> None:
    """``scenario()`` (a new Scenario each call) through ``be`` at layer ``layer_id``; ``qkv(n)`` the
    inputs of ``n`` tokens (v None for MLA); ``extend``: eager only (never captured)."""
    fill = be.get_cuda_graph_seq_len_fill_value()
    m = materialize(scenario(), mem, fill)
    poison_unread(mem, m.batch)
    n = m.batch.num_tokens
    q, k, v = qkv(n)
    layer = cfg.layer(layer_id)
    be.init_forward_metadata(m.batch)
    out = be.forward(q, k, v, layer, m.batch)
    rows = n if extend else m.batch.raw_bs * m.batch.width
    loc = m.batch.out_cache_loc[:rows]
    stored = ([(mem.pool.kv, k, layer.k_scale)] if mem.is_mla else
              [(mem.pool.k, k, layer.k_scale), (mem.pool.v, v, layer.v_scale)])
    for pool, x, scale in stored:
        want = to_cache(x[:rows], cfg.cache_dtype, scale).view(torch.uint8)
        assert torch.equal(pool[layer_id][loc].view(torch.uint8), want), "the store's bits are not the reference's"
    ref = dense_reference(m.batch, mem, layer_id, q.cpu(), layer.scaling, cfg.kv_lora_rank if mem.is_mla else None,
                          layer.k_scale, layer.v_scale)
    ok = ~ref[:, 0, 0].isnan()
    assert int(ok.sum()) == rows, "rows left out of the check"
    err = float((out.cpu()[ok].double() - ref[ok]).norm() / ref[ok].norm())
    assert err < tol, f"relative error {err:.2e}"
    if extend:
        return
    cap = materialize(scenario(), mem, fill)
    be.init_cuda_graph_state(8, 64)
    be.init_forward_metadata_capture_cuda_graph(cap.batch.graph_inputs())
    be.init_forward_metadata_replay_cuda_graph(m.batch.graph_inputs())
    replayed = be.forward(q, k, v, layer, m.batch, save_kv_cache=False)
    assert torch.equal(replayed.cpu()[ok], out.cpu()[ok]), "the graph path differs from eager on the same batch"
