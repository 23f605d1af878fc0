"""KV memory layout: reserved row 0 and page 0, page alignment, pool shapes, free/truncate,
allocation orders."""
import pytest
import torch

from attn_backends import ForwardMode, KVMemory, ModelConfig
from attn_backends.check.scenarios import Scenario, make_memory, materialize
from attn_backends.kv_cache import MHAPool, MLAPool, PageAllocator, ReqToTokenPool

PAGE_SIZES = (1, 16, 64)
ORDERS = ("contiguous", "shuffled", "reversed")


def memory(page_size, order="shuffled", num_pages=40, max_reqs=4, max_context_len=256, mla=False, seed=0):
    kw = dict(kv_lora_rank=512, rope_dim=64) if mla else dict(num_kv_heads=2, head_dim=8, v_head_dim=4)
    return KVMemory(num_layers=2, num_pages=num_pages, page_size=page_size, max_reqs=max_reqs,
                    max_context_len=max_context_len, is_mla=mla, page_order=order, seed=seed, **kw)


def pages_of(mem, row):
    """Page ids of a request, read from req_to_token (the contract, not private state)."""
    n = mem.seq_len(row)
    return mem.req_to_token[row, :n:mem.page_size].long() // mem.page_size


def assert_page_aligned(mem, row):
    n, ps = mem.seq_len(row), mem.page_size
    slots = mem.req_to_token[row, :n].long()
    t = torch.arange(n)
    pages = pages_of(mem, row)
    assert torch.equal(slots, pages[t // ps] * ps + t % ps), slots


def test_request_row_0_is_reserved():
    pool = ReqToTokenPool(max_reqs=3, max_context_len=8)
    assert sorted(pool.alloc() for _ in range(3)) == [1, 2, 3]
    pool.free(2)
    assert pool.alloc() == 2
    with pytest.raises(ValueError, match="request row 0 is not allocated"):
        pool.free(0)


@pytest.mark.parametrize("order", ORDERS)
def test_page_0_is_never_handed_out(order):
    alloc = PageAllocator(num_pages=17, order=order, seed=5)
    got = alloc.alloc(16)
    assert sorted(got) == list(range(1, 17)) and alloc.num_free == 0


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("order", ORDERS)
def test_slots_are_page_aligned_and_avoid_the_reserved_page(page_size, order):
    mem = memory(page_size, order, num_pages=24 if page_size > 1 else 400)
    rows = [mem.new_request() for _ in range(3)]
    # ragged chunks that start and end mid-page, requests interleaved
    for chunk in ([5, 37, 1], [page_size, 3, page_size + 1], [1, 1, 70]):
        for row, n in zip(rows, chunk):
            slots = mem.extend(row, n)
            assert slots.dtype == torch.int64 and slots.shape == (n,)
            assert int(slots.min()) >= page_size            # never page 0
    for row in rows:
        assert_page_aligned(mem, row)
        assert pages_of(mem, row).unique().numel() == pages_of(mem, row).numel()
    used = torch.cat([pages_of(mem, r) for r in rows])
    assert used.unique().numel() == used.numel()             # no page shared by two requests
    assert not mem.req_to_token[0].any()                     # row 0 untouched


def test_extend_continues_the_last_page():
    mem = memory(16, "shuffled")
    row = mem.new_request()
    a = mem.extend(row, 5)
    b = mem.extend(row, 3)
    assert torch.equal(b, a[0] + torch.arange(5, 8))          # same page, next offsets
    assert mem.pages.num_free == 40 - 1 - 1


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_mha_pool_shapes(page_size):
    mem = memory(page_size, num_pages=6)
    assert mem.num_slots == 6 * page_size
    assert isinstance(mem.pool, MHAPool) and len(mem.pool.k) == len(mem.pool.v) == 2
    assert mem.pool.k[0].shape == (6 * page_size, 2, 8)
    assert mem.pool.v[1].shape == (6 * page_size, 2, 4)
    assert mem.req_to_token.shape == (5, 256) and mem.req_to_token.dtype == torch.int32


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_mla_pool_holds_latent_and_rope_in_one_buffer(page_size):
    mem = memory(page_size, num_pages=6, mla=True)
    assert isinstance(mem.pool, MLAPool) and len(mem.pool.kv) == 2
    assert mem.pool.kv[0].shape == (6 * page_size, 1, 512 + 64)
    row = mem.new_request()
    loc = mem.extend(row, 3)
    kv = torch.randn(3, 1, 576)
    mem.pool.store(1, loc, kv)
    assert torch.equal(mem.pool.kv[1][loc], kv)
    assert not mem.pool.kv[0].any() and not mem.pool.kv[1][:page_size].any()


def test_mha_store_writes_only_the_given_slots():
    mem = memory(16)
    loc = mem.extend(mem.new_request(), 4)
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 4)
    mem.pool.store(0, loc, k, v)
    assert torch.equal(mem.pool.k[0][loc], k) and torch.equal(mem.pool.v[0][loc], v)
    assert int((mem.pool.k[0] != 0).any(-1).any(-1).sum()) == 4


def test_make_memory_builds_the_pool_the_config_asks_for():
    mla = ModelConfig(num_layers=3, num_q_heads=4, num_kv_heads=1, is_mla=True, page_size=16)
    mem = make_memory(mla, num_pages=4, max_reqs=2, max_context_len=64)
    assert mem.pool.kv[2].shape == (64, 1, 576) and mem.pool.kv[2].abs().sum() > 0  # random, not zeros
    gqa = ModelConfig(num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=32, page_size=64)
    mem = make_memory(gqa, num_pages=3, max_reqs=2, max_context_len=128)
    assert mem.pool.k[0].shape == (192, 2, 32) and mem.pool.v[0].shape == (192, 2, 32)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_truncate_frees_whole_pages_only(page_size):
    mem = memory(page_size, num_pages=40 if page_size > 1 else 400)
    row = mem.new_request()
    mem.extend(row, 2 * page_size + 3)                        # 3 pages (or 2*1+3 for ps 1)
    free0 = mem.pages.num_free
    kept_slots = mem.req_to_token[row, :page_size + 1].clone()
    mem.truncate(row, page_size + 1)                          # keeps 2 pages
    n_before = -(-(2 * page_size + 3) // page_size)
    assert mem.pages.num_free == free0 + n_before - -(-(page_size + 1) // page_size)
    assert mem.seq_len(row) == page_size + 1
    assert torch.equal(mem.req_to_token[row, :page_size + 1], kept_slots)
    assert not mem.req_to_token[row, page_size + 1:].any()
    mem.extend(row, page_size)                                # grows again, still aligned
    assert_page_aligned(mem, row)
    with pytest.raises(ValueError, match=r"new_len=99999 outside 0\.\."):
        mem.truncate(row, 99999)


def test_free_request_returns_its_pages_and_row():
    mem = memory(16)
    row = mem.new_request()
    mem.extend(row, 40)
    assert mem.pages.num_free == 39 - 3
    mem.free_request(row)
    assert mem.pages.num_free == 39
    assert not mem.req_to_token[row].any()
    with pytest.raises(ValueError, match=rf"request row {row} is not allocated"):
        mem.req_pool.free(row)                                # double free
    assert mem.new_request() in range(1, 5)


def first_pages(order, n=6, seed=0):
    mem = memory(1, order, num_pages=20, seed=seed)
    row = mem.new_request()
    mem.extend(row, n)
    return pages_of(mem, row).tolist()


def test_allocation_orders():
    assert first_pages("contiguous") == [1, 2, 3, 4, 5, 6]
    assert first_pages("reversed") == [19, 18, 17, 16, 15, 14]
    shuffled = first_pages("shuffled")
    assert shuffled != sorted(shuffled) and shuffled != sorted(shuffled, reverse=True)
    assert shuffled == first_pages("shuffled")               # seeded: reproducible
    assert shuffled != first_pages("shuffled", seed=1)
    with pytest.raises(ValueError, match=r"order='random' is not one of contiguous, shuffled, reversed"):
        PageAllocator(8, order="random")


def test_interleaved_scenario_pages_alternate_between_requests():
    cfg = ModelConfig(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=16)
    mem = make_memory(cfg, num_pages=16, max_reqs=4, max_context_len=128, page_order="interleaved", seed=2)
    m = materialize(Scenario(ForwardMode.DECODE, bs=2, prefix_lens=[40, 40]), mem, fill=1)
    a, b = (pages_of(mem, r).tolist() for r in m.rows)
    assert len(set(a) & set(b)) == 0 and len(a) == len(b) == 3
    # allocation went a0, b0, a1, b1, ...: positions of a's pages in the allocator's order interleave
    alloc = PageAllocator(16, "shuffled", seed=2).alloc(6)
    assert [p in a for p in alloc[:4]] == [True, False, True, False], (alloc, a, b)


@pytest.mark.parametrize("bad", [2, 8, 32, 128])
def test_only_page_sizes_1_16_64(bad):
    with pytest.raises(ValueError, match=rf"page_size={bad} is not one of \(1, 16, 64\)"):
        memory(bad)
