import math

import pytest
import torch

from attn_backends_kernels.index_build import build_page_indices

POISON = -(2 ** 31) + 7


def make_req_to_token(seq_lens, rows, page_size, max_context, seed=0):
    """req_to_token with shuffled page-aligned slots; row 0 reserved (zeros)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.zeros(max(rows) + 2, max_context, dtype=torch.int32)
    total_pages = sum(math.ceil(s / page_size) for s in seq_lens) + 4
    perm = (torch.randperm(total_pages - 1, generator=g) + 1).tolist()
    for r, s in zip(rows, seq_lens):
        n = math.ceil(s / page_size)
        pages, perm = perm[:n], perm[n:]
        pos = torch.arange(n * page_size)
        table[r, :n * page_size] = (torch.tensor(pages)[pos // page_size] * page_size
                                    + pos % page_size).int()
    return table


def ref_indices(req_to_token, rows, seq_lens, page_size, max_pages, capacity):
    bs = len(rows)
    pt = torch.zeros(bs, max_pages, dtype=torch.int32)
    indptr = [0]
    flat = []
    for i, (r, s) in enumerate(zip(rows, seq_lens)):
        n = math.ceil(s / page_size)
        pages = [int(req_to_token[r, p * page_size]) // page_size for p in range(n)]
        pt[i, :n] = torch.tensor(pages, dtype=torch.int32)
        flat += pages
        indptr.append(indptr[-1] + n)
    idx = torch.zeros(capacity, dtype=torch.int32)
    idx[:len(flat)] = torch.tensor(flat, dtype=torch.int32)
    return pt, torch.tensor(indptr, dtype=torch.int32), idx


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_build_page_indices(page_size):
    W = 2
    seq_lens = [37, 1, 130, 64]
    rows = [3, 1, 5, 2]
    max_context = 256
    table = make_req_to_token(seq_lens, rows, page_size, max_context)
    # two padding rows: req row 0, seq_len = W
    rows_p, lens_p = rows + [0, 0], seq_lens + [W, W]
    bs = len(rows_p)
    max_pages = max_context // page_size + 1
    capacity = bs * max_pages + 5
    page_table = torch.full((bs + 1, max_pages), POISON, dtype=torch.int32)
    indptr = torch.full((bs + 1,), POISON, dtype=torch.int32)
    indices = torch.full((capacity,), POISON, dtype=torch.int32)
    build_page_indices(table, torch.tensor(rows_p), torch.tensor(lens_p, dtype=torch.int32),
                       page_size, page_table, indptr, indices)
    pt_ref, indptr_ref, idx_ref = ref_indices(table, rows_p, lens_p, page_size, max_pages,
                                              capacity)
    assert torch.equal(page_table[:bs], pt_ref)
    assert (page_table[bs] == POISON).all()  # rows past bs untouched
    assert torch.equal(indptr, indptr_ref)
    assert torch.equal(indices, idx_ref)


def test_build_page_indices_rejects_int64_page_table():
    table = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="page_table"):
        build_page_indices(table, torch.zeros(1, dtype=torch.int64),
                           torch.ones(1, dtype=torch.int32), 1,
                           torch.zeros(1, 8, dtype=torch.int64))


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_build_page_indices_gpu(page_size):
    seq_lens = [1, 4096, 700, 32768, 64]
    rows = [9, 2, 4, 1, 7]
    max_context = 32768 + 64
    table = make_req_to_token(seq_lens, rows, page_size, max_context)
    bs, max_pages = len(rows), max_context // page_size
    capacity = bs * max_pages
    page_table = torch.full((bs, max_pages), POISON, dtype=torch.int32, device="cuda")
    indptr = torch.full((bs + 1,), POISON, dtype=torch.int32, device="cuda")
    indices = torch.full((capacity,), POISON, dtype=torch.int32, device="cuda")
    build_page_indices(table.cuda(), torch.tensor(rows, device="cuda"),
                       torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
                       page_size, page_table, indptr, indices)
    pt_ref, indptr_ref, idx_ref = ref_indices(table, rows, seq_lens, page_size, max_pages,
                                              capacity)
    assert torch.equal(page_table.cpu(), pt_ref)
    assert torch.equal(indptr.cpu(), indptr_ref)
    assert torch.equal(indices.cpu(), idx_ref)
