"""The merge pass as a programmatic dependent launch (``pdl.MERGE_PASS_PDL``, sm_90+): its programs
may start while the chunk pass still runs (from the chunk programs' start: ``CHUNK_PDL_TRIGGER``) and must
read the partials only after ``gdc_wait``. The workspace is poisoned (NaN) inside the graph before every step,
so a merge program that read a partial before its chunk program wrote it reads NaN: every replay, on lengths
other than the capture's, must equal the same step launched without the dependent launch bitwise, and the
float64 reference. Small batches leave SMs idle for early merge programs."""
import random

import pytest
import torch
from kernel_refs import assert_close, make_paged_batch, ref_paged_attention

from attn_backends_kernels import pdl
from attn_backends_kernels.decode_attention import decode_attention_fwd
from attn_backends_kernels.extend_attention import extend_attention_fwd
from attn_backends_kernels.schedule import chunk_workspace

pytestmark = pytest.mark.cuda
PAGE = 16


def _lengths(bs: int, seed: int) -> list:
    """A long tail (one request of 32768 among 256-2048), ragged (256-16384) and near-uniform lengths."""
    rng = random.Random(seed)
    short = [rng.randint(256, 2048) for _ in range(bs)]
    short[rng.randrange(bs)] = 32768
    return [short, [rng.randint(256, 16384) for _ in range(bs)], [8192 + rng.randint(0, 64) for _ in range(bs)]]


def _attend(q, k_buf, v_buf, page_table, seq_lens, cu_q, W, per_request, out, ws):
    """Decode (``W`` 1) or verify of ``W`` causal rows a request, chunk schedule, merged by the pass."""
    D = q.shape[2]
    if W == 1:
        decode_attention_fwd(q, k_buf, v_buf, page_table, seq_lens, PAGE, D ** -0.5, per_request, out, ws,
                             schedule="chunks", merge="pass")
    else:
        extend_attention_fwd(q, k_buf, v_buf, page_table, seq_lens, cu_q, PAGE, D ** -0.5, W, out,
                             num_kv_splits=per_request, workspace=ws, schedule="chunks", merge="pass")


@pytest.mark.parametrize("H,Hkv,D,bs,per_request,W", [(8, 1, 128, 5, 8, 1), (8, 1, 128, 48, 16, 1),
                                                      (28, 4, 128, 13, 4, 1), (32, 8, 64, 3, 16, 1),
                                                      (8, 1, 128, 5, 8, 4), (32, 8, 128, 6, 4, 4)])
def test_dependent_merge_reads_the_partials_after_the_chunk_pass(monkeypatch, H, Hkv, D, bs, per_request, W):
    """Decode (``W`` 1) and verify (``W`` query rows a request, causal)."""
    if not pdl.pdl_device(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU")
    assert pdl.MERGE_PASS_PDL and pdl.CHUNK_PDL_TRIGGER     # the default this test guards
    batches = _lengths(bs, bs)
    made = [make_paged_batch(lens, PAGE, device="cuda", seed=i) for i, lens in enumerate(batches)]
    page_table = torch.zeros(bs, max(m[0].shape[1] for m in made), dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(bs, dtype=torch.int32, device="cuda")
    num_slots = max(m[2] for m in made) * PAGE
    cu_q_dev = torch.arange(0, bs * W + 1, W, dtype=torch.int32, device="cuda")
    k_buf, v_buf = (torch.randn(num_slots, Hkv, D, device="cuda").to(torch.bfloat16) for _ in range(2))
    q = torch.randn(bs * W, H, D, device="cuda").to(torch.bfloat16)
    out = torch.empty(bs * W, H, D, device="cuda", dtype=torch.bfloat16)
    ws = chunk_workspace(bs, per_request, W, H, Hkv, D, "cuda")
    cu_q = torch.arange(0, bs * W + 1, W, dtype=torch.int32)

    def step():
        ws[0].fill_(float("nan"))
        ws[1].fill_(float("nan"))
        _attend(q, k_buf, v_buf, page_table, seq_lens, cu_q_dev, W, per_request, out, ws)

    def load(m):
        page_table.zero_()
        page_table[:, :m[0].shape[1]] = m[0]
        seq_lens.copy_(m[1])

    load(made[-1])
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for m in made:
        load(m)
        out.fill_(float("nan"))
        graph.replay()
        replayed = out.clone()
        step()                                       # eager, dependent launch too
        eager = out.clone()
        with monkeypatch.context() as mp:
            mp.setattr(pdl, "MERGE_PASS_PDL", False)
            step()                                   # the merge after the chunk pass has ended
        assert torch.equal(replayed, out), f"replay with a dependent merge differs, lengths {m[1].tolist()}"
        assert torch.equal(eager, out), f"eager dependent merge differs, lengths {m[1].tolist()}"
        ref = ref_paged_attention(q, k_buf, v_buf, page_table, seq_lens, cu_q, PAGE, D ** -0.5)
        assert_close(replayed, ref, 1e-2)
