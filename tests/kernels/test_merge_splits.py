"""``merge_splits``: split-KV partials merged by their log2-sum-exp, against a float64 reference,
with head counts that leave a program's head block partly empty and empty splits (lse = -inf)."""
import pytest
import torch

from attn_backends_kernels.attention_core import merge_splits


def reference(part, lse):
    """out[t, h] = sum_s 2^lse[t, h, s] part[t, h, s] / sum_s 2^lse[t, h, s]; zeros for a row
    whose every split is empty."""
    w = torch.exp2(lse.double() - lse.double().amax(-1, keepdim=True).clamp(min=-1e300).nan_to_num(neginf=0.0))
    w = torch.where(torch.isinf(lse), torch.zeros_like(w), w)
    den = w.sum(-1, keepdim=True)
    return (w[..., None] * part.double()).sum(-2) / torch.where(den > 0, den, torch.ones_like(den))


def make(T, H, S, Dv, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    part = torch.randn(T, H, S, Dv, generator=g)
    lse = torch.randn(T, H, S, generator=g) * 4
    empty = torch.rand(T, H, S, generator=g) < 0.3      # empty splits: zeros, lse = -inf
    empty[0, 0] = True                                   # a row that saw nothing: zeros
    lse[empty] = float("-inf")
    part[empty] = 0.0
    return part.to(device), lse.to(device)


# (120, 5, 3, 16): T * H = 600 gives programs of two heads, three per row, the third half empty;
# the others run one head per program (at most 8192 values a program, about 256 programs)
# (1, 3, 64, 512): 64 splits of MLA's 512-wide output, the widest merge (bs 1 takes 64 splits)
@pytest.mark.parametrize("T,H,S,Dv", [(3, 6, 3, 16), (2, 5, 2, 32), (4, 3, 7, 24), (2, 5, 19, 128), (120, 5, 3, 16),
                                      (1, 3, 64, 512)])
def test_merge_splits_cpu(T, H, S, Dv):
    part, lse = make(T, H, S, Dv, "cpu")
    out = torch.full((T, H, Dv), float("nan"))
    merge_splits(part, lse, out)
    ref = reference(part, lse)
    assert torch.equal(out[0, 0], torch.zeros(Dv))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("T,H,S,Dv", [(1, 32, 32, 128), (256, 64, 4, 128), (64, 16, 32, 512), (37, 80, 2, 512),
                                      (1, 16, 64, 512), (1, 32, 64, 128)])
def test_merge_splits_gpu(T, H, S, Dv):
    part, lse = make(T, H, S, Dv, "cuda")
    out = torch.full((T, H, Dv), float("nan"), device="cuda", dtype=torch.bfloat16)
    merge_splits(part, lse, out)
    torch.testing.assert_close(out.double(), reference(part, lse), rtol=1e-2, atol=1e-2)
