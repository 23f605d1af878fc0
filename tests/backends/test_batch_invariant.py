"""The ``triton`` backend's batch-invariant option (issue #40): a request's attention output is the
same bits alone, inside other batches and padded to another bucket; the default balanced schedule,
which cuts a request by what else is in the batch, is not (so the comparison can fail). Its chunks
have a floor (``MIN_CHUNK_TOKENS``) that a small batch on a GPU of many SMs never outgrows: there
request 3 is long enough that its batch's chunks do."""
import pytest
import torch

from attn_backends import ForwardBatch, ForwardMode, ModelConfig
from attn_backends.backends.triton_backend import BatchInvariantTritonBackend, TritonBackend
from attn_backends.check.scenarios import Scenario, make_memory, materialize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter on the CPU; on a GPU these are GPU tests (`pytest -m cuda` picks them)
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []
LENS = [2500, 40, 300, 120000 if DEVICE == "cuda" else 3100, 7]  # request 0: three invariant chunks
BATCHES = [((0,), 0), ((0, 1, 2), 0), ((3, 1, 0, 4), 0), ((0, 1, 2), 2)]     # alone, 3 batches, a bucket of 5


def _sub_batch(b: ForwardBatch, rows: tuple, pad: int, fill: int) -> ForwardBatch:
    idx = torch.tensor(rows, device=b.seq_lens.device)
    n = len(rows)
    z = lambda t, v=0: torch.cat([t[idx], torch.full((pad,), v, dtype=t.dtype, device=t.device)])  # noqa: E731
    return ForwardBatch(ForwardMode.DECODE, n + pad, z(b.req_pool_indices), z(b.seq_lens, fill),
                        z(b.seq_lens_cpu.to(b.seq_lens.device), fill).cpu(), z(b.out_cache_loc), z(b.positions),
                        raw_bs=n)


def _outputs(backend_cls, dtype):
    cfg = ModelConfig(num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16, page_size=16, dtype=dtype)
    mem = make_memory(cfg, num_pages=sum(LENS) // 16 + 16, max_reqs=8, max_context_len=-(-max(LENS) // 4096) * 4096,
                      page_order="shuffled", seed=0, device=DEVICE)
    be = backend_cls(cfg, mem)
    fill = be.get_cuda_graph_seq_len_fill_value()
    whole = materialize(Scenario(ForwardMode.DECODE, len(LENS), [n - 1 for n in LENS]), mem, fill).batch
    q_all = torch.randn(len(LENS), cfg.num_q_heads, cfg.qk_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = []
    for rows, pad in BATCHES:
        batch = _sub_batch(whole, rows, pad, fill)
        q = torch.cat([q_all[list(rows)], torch.zeros(pad, cfg.num_q_heads, cfg.qk_dim, dtype=dtype)]).to(DEVICE)
        be.init_forward_metadata(batch)
        out = be.forward(q, None, None, cfg.layer(0), batch, save_kv_cache=False)
        got.append(out[rows.index(0)].cpu())
    return got


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_batch_invariant_option_gives_one_output_in_any_batch_and_bucket(dtype):
    got = _outputs(BatchInvariantTritonBackend, dtype)
    assert all(torch.equal(got[0], o) for o in got[1:]), "request 0's output depends on its batch or bucket"
    default = _outputs(TritonBackend, dtype)
    assert not all(torch.equal(default[0], o) for o in default[1:]), \
        "the balanced default gave the same bits in every batch: this comparison cannot see a difference"
    bf16 = dtype == torch.bfloat16      # other chunks round otherwise: about one ulp of outputs near 0.02
    torch.testing.assert_close(got[0], default[0], rtol=1e-2 if bf16 else 1e-5, atol=5e-4 if bf16 else 1e-5)
