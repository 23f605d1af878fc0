"""``merge_splits``: split-KV partials merged by their log2-sum-exp, against a float64 reference,
with head counts that leave a program's head block partly empty and empty splits (lse = -inf)."""
import pytest
import torch

from attn_backends_kernels.attention_core import merge_splits
from attn_backends_kernels.launch_record import recording


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


@pytest.mark.parametrize("Dv", [512, 200, 96])
@pytest.mark.parametrize("block_dv", [None, 64, 128, 1024])
@pytest.mark.parametrize("part_dtype", [torch.float32, torch.float16])
def test_merge_splits_column_blocks_cpu(Dv, block_dv, part_dtype):
    """Output columns cut into blocks (None: the default, 64 columns for 3 heads of one row of
    16-bit partials, whole rows of float32 ones; 1024: wider than the columns; 200 and 96: a last
    block partly past them), float32 and 16-bit partials, against the float64 reference."""
    part, lse = make(1, 3, 5, Dv, "cpu", seed=1)
    part = part.to(part_dtype)
    wide = torch.full((1, 3, Dv + 8), float("nan"))
    out = wide[..., :Dv]                                           # columns past Dv must stay NaN
    with recording() as launches:
        merge_splits(part, lse, out, block_dv=block_dv)
    torch.testing.assert_close(out.double(), reference(part, lse), rtol=1e-5, atol=1e-5)
    assert wide[..., Dv:].isnan().all()
    width = block_dv or (64 if part_dtype == torch.float16 else 1 << (Dv - 1).bit_length())
    assert launches[0][2] == (1, 3, -(-Dv // width))    # (rows, head blocks, column blocks)


@pytest.mark.parametrize("T,H,S,Dv,width", [(1, 8, 256, 128, 32), (2, 3, 128, 128, 32), (1, 4, 64, 128, 32),
                                            (1, 2, 64, 512, 512), (1, 4, 32, 128, 128), (64, 8, 64, 128, 128)])
def test_merge_splits_tile_bound_cpu(T, H, S, Dv, width):
    """Float32 partials of at most 128 columns whose head holds MERGE_TILE_VALUES (8192) splits x columns
    or more: 32-column blocks where rows x heads leave fewer than MERGE_PROGRAMS (the deep decode's 256
    splits); MLA's 512 columns, 32 splits and 512 rows x heads stay whole; against the float64 reference."""
    part, lse = make(T, H, S, Dv, "cpu", seed=2)
    out = torch.full((T, H, Dv), float("nan"))
    with recording() as launches:
        merge_splits(part, lse, out)
    torch.testing.assert_close(out.double(), reference(part, lse), rtol=1e-5, atol=1e-5)
    assert launches[0][2] == (T, H, Dv // width)


def test_merge_splits_does_not_read_empty_partials_cpu():
    """An empty split (lse = -inf) weighs 0 and its partial is not read: NaN bytes there (a workspace
    no split wrote) leave the output the reference's."""
    part, lse = make(2, 3, 40, 64, "cpu", seed=3)
    poisoned = part.clone()
    poisoned[torch.isinf(lse)] = float("nan")
    out = torch.full((2, 3, 64), float("nan"))
    merge_splits(poisoned, lse, out)
    torch.testing.assert_close(out.double(), reference(part, lse), rtol=1e-5, atol=1e-5)


def test_merge_splits_block_dv_error():
    part, lse = make(1, 2, 2, 64, "cpu")
    with pytest.raises(ValueError, match="block_dv=48 must be a power of two"):
        merge_splits(part, lse, torch.empty(1, 2, 64), block_dv=48)


@pytest.mark.cuda
@pytest.mark.parametrize("T,H,S,Dv", [(1, 32, 32, 128), (256, 64, 4, 128), (64, 16, 32, 512), (37, 80, 2, 512),
                                      (1, 16, 64, 512), (1, 32, 64, 128), (1, 8, 256, 128), (3, 8, 128, 128)])
@pytest.mark.parametrize("part_dtype", [torch.float32, torch.bfloat16])
def test_merge_splits_gpu(T, H, S, Dv, part_dtype):
    part, lse = make(T, H, S, Dv, "cuda")
    part = part.to(part_dtype)
    out = torch.full((T, H, Dv), float("nan"), device="cuda", dtype=torch.bfloat16)
    merge_splits(part, lse, out)
    torch.testing.assert_close(out.double(), reference(part, lse), rtol=1e-2, atol=1e-2)
