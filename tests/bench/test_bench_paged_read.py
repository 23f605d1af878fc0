"""bench/probes/paged_read.py on the CPU: its paged read sums every K and V value of a request's split
once (against torch's gather on ragged lengths and shuffled pages, in both grid orders), its splits
hold the tokens the decode kernel's do (the decode's log2-sum-exp of zero scores counts them), and
the tool runs end to end on smoke rows."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "probes"
sys.path.insert(0, str(ROOT / "tests" / "kernels"))
from kernel_refs import make_paged_batch  # noqa: E402


@pytest.mark.parametrize("page_size,seq_lens,splits,block_n", [
    (1, [5, 37, 1, 64], 3, 32),
    (16, [70, 3, 16, 129], 2, 64),
    (16, [(i * 37) % 90 + 1 for i in range(64)], 2, 32),     # 64 requests: the heads-first grid
])
def test_the_paged_read_sums_every_value_of_its_split_once(monkeypatch, page_size, seq_lens, splits, block_n):
    monkeypatch.syspath_prepend(str(BENCH))
    import paged_read as R
    pt, lens, num_pages = make_paged_batch(seq_lens, page_size, pad_rows=1, seed=3)
    g = torch.Generator().manual_seed(4)
    k = torch.randn(num_pages * page_size, 2, 16, generator=g)
    v = torch.randn(num_pages * page_size, 2, 16, generator=g)
    call, out = R.paged_read(k, v, pt, lens, page_size, splits, block_n)
    out.fill_(float("nan"))
    call()
    ref = R.paged_reference(k, v, pt, lens, page_size, splits, block_n)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("page_size,seq_lens,splits", [(16, [70, 3, 16, 129, 1], 3), (1, [40, 64, 65], 2)])
def test_the_paged_read_splits_the_tokens_as_the_decode_kernel_does(monkeypatch, page_size, seq_lens, splits):
    """With q = 0 every score is 0, so the decode kernel's log2-sum-exp of a split is log2 of the
    tokens it holds (-inf for none); with K = 0 and V = 1 the read's sum of a split is D x those
    tokens. A change to either walk's split bounds fails here."""
    monkeypatch.syspath_prepend(str(BENCH))
    import paged_read as R

    from attn_backends_kernels.attention_core import decode_workspace
    from attn_backends_kernels.decode_attention import decode_attention_fwd
    pt, lens, num_pages = make_paged_batch(seq_lens, page_size, pad_rows=1, seed=5)
    bs, hkv, group, d = lens.shape[0], 2, 4, 16
    k = torch.zeros(num_pages * page_size, hkv, d)
    v = torch.ones(num_pages * page_size, hkv, d)
    ws = decode_workspace(bs, hkv * group, d, splits, "cpu")
    out = torch.empty(bs, hkv * group, d)
    decode_attention_fwd(torch.zeros(bs, hkv * group, d), k, v, pt, lens, page_size, 1.0, splits, out, ws)
    call, sums = R.paged_read(k, v, pt, lens, page_size, splits, 32)
    call()
    tokens = torch.exp2(ws[1].view(bs, hkv, group, splits))          # [bs, Hkv, group, splits]
    assert tokens.sum((1, 2, 3)).tolist() == [n * hkv * group for n in lens.tolist()]
    torch.testing.assert_close(tokens, (sums / d)[:, :, None, :].expand_as(tokens), rtol=1e-5, atol=1e-5)


def test_paged_read_smoke(tmp_path):
    env = dict(os.environ, BENCH_DEVICE="cpu", TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = tmp_path / "paged_read.md"
    run = subprocess.run([sys.executable, str(BENCH / "paged_read.py"), "--points", "2x40",
                          "--workloads", "gqa32_decode", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| gqa32_decode")]
    assert [(r[1], r[2], r[3]) for r in rows] == [("2", "40", "2")]
    bad = subprocess.run([sys.executable, str(BENCH / "paged_read.py"), "--points", "2x40", "--workloads",
                          "gqa32_verify4"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "gqa*_decode only" in bad.stderr
