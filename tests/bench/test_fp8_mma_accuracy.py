"""bench/probes/fp8_mma_accuracy.py's emulation is the attention it claims: unquantized and in float32 its
tiled online softmax equals the float64 reference, so the errors it reports for FP8 are the formats', not the
emulation's; each rounding it applies moves the output."""
import torch


def _probe(monkeypatch):
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench" / "probes"))
    import fp8_mma_accuracy as P
    return P


def test_the_emulation_unquantized_is_the_reference(monkeypatch):
    P = _probe(monkeypatch)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g) for s in ((4, 8, 32), (300, 8, 32), (300, 8, 16)))   # 300: a partial tile
    s = torch.einsum("whd,shd->whs", q.double(), k.double()) * 0.7
    ref = torch.einsum("whs,shd->whd", torch.softmax(s, -1), v.double())
    got = P.attend(q, k, v, 0.7, torch.float32, q_fp8=False, p_scale=None)
    assert float((got.double() - ref).abs().max()) < 1e-5
    for qf, pf in ((True, None), (False, 1.0), (False, 256.0)):          # each rounding shows
        assert float((P.attend(q, k, v, 0.7, torch.float32, qf, pf).double() - ref).abs().max()) > 1e-4


def test_a_row_reports_every_mode(monkeypatch):
    P = _probe(monkeypatch)
    r = P.row(P.SHAPES[3], 128, 1.0, torch.bfloat16, torch.Generator().manual_seed(1))    # MLA: V inside the cache
    assert list(r) == [m[0] for m in P.MODES]
    assert r["16-bit MMA"] < 2e-2 < r["FP8 MMA"]
