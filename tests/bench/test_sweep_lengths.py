"""The sweep's KV-length distributions and ragged rows (bench/sweep/sweep_rows.py, sweep_matrix.py),
on the CPU without launching a kernel: each distribution's shape, a ragged group's pool and
per-request query tokens, a row's recorded bytes over the sum of its lengths, the selection flags."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "sweep"))

import sweep_matrix as M  # noqa: E402
import sweep_rows as R  # noqa: E402

SIZES = (1, 3, 8, 24, 31, 32, 48, 100, 128)


def test_each_distribution_has_its_shape_and_is_a_function_of_name_bs_seed():
    long_first = []
    for bs in SIZES:
        for seed in range(4):
            rag = R.lengths("ragged", bs, seed)
            assert len(rag) == bs and all(256 <= n <= 16384 for n in rag)
            lt = R.lengths("longtail", bs, seed)
            longs = [i for i, n in enumerate(lt) if n == 32768]
            assert len(longs) == (2 if bs >= 32 else 1), (bs, lt)
            assert all(256 <= n <= 2048 for i, n in enumerate(lt) if i not in longs)
            long_first.append(longs[0] == 0)
            bi = R.lengths("bimodal", bs, seed)
            assert sum(256 <= n <= 1024 for n in bi) == (bs + 1) // 2
            assert sum(8192 <= n <= 16384 for n in bi) == bs // 2
            assert R.lengths("uniform", bs, seed, kv=777) == [777] * bs
            for d in ("ragged", "longtail", "bimodal"):
                assert R.lengths(d, bs, seed) == R.lengths(d, bs, seed), f"{d} not deterministic"
    assert not all(long_first), "the long request is always first"
    assert R.lengths("ragged", 48, 0) != R.lengths("ragged", 48, 1), "the seed draws nothing"
    assert R.lengths("bimodal", 48, 0) != sorted(R.lengths("bimodal", 48, 0)), "bimodal not shuffled"
    with pytest.raises(ValueError, match="dist='zipf'"):
        R.lengths("zipf", 4)
    with pytest.raises(ValueError, match="kv=None"):
        R.lengths("uniform", 4)


def test_a_ragged_group_holds_exactly_its_pages_and_each_request_its_last_w_tokens():
    wl = R.smoke_workload(R.BY_NAME["gqa28_4_d64_verify4"])
    lens = [17, 40, 9, 16]                                    # page 16: 2, 3, 1, 1 pages
    group = R.build_group(wl, len(lens), round(sum(lens) / 4), "cpu", lens=lens, dist="ragged")
    assert group.mem.pool.k[0].shape[0] == (2 + 3 + 1 + 1 + 1) * wl.page_size, "pool not sized by the lengths"
    assert group.base.seq_lens.tolist() == lens
    row = R.build_row(group, wl)
    w, r2t, req = wl.width, group.mem.req_to_token, group.base.req_pool_indices.tolist()
    want_pos = [p for n in lens for p in range(n - w, n)]
    want_loc = [int(r2t[r, p]) for r, n in zip(req, lens) for p in range(n - w, n)]
    assert row.batch.positions.tolist() == want_pos and row.batch.out_cache_loc.tolist() == want_loc
    assert row.lens == tuple(lens) and row.dist == "ragged"
    pages = {int(s) // wl.page_size for s in r2t[req[1], :40]}
    assert len(pages) == 3 and 0 not in pages
    with pytest.raises(ValueError, match="shorter than W=8"):
        R.build_row(R.build_group(wl, 2, 5, "cpu", lens=[5, 30]), R.smoke_workload(R.BY_NAME["gqa28_4_d64_tree8"]))


def test_a_non_uniform_rows_recorded_bytes_and_flops_use_the_sum_of_its_lengths():
    from types import SimpleNamespace

    import sweep
    wl = R.smoke_workload(R.BY_NAME["gqa8_1_d64_decode"])
    lens = [9, 40, 100]
    row = R.build_row(R.build_group(wl, 3, 50, "cpu", lens=lens, dist="longtail"), wl)
    ctx = SimpleNamespace(env={}, mismatches=[])
    rec = sweep.finish(ctx, row, sweep.base_record(row, "ours", status="ok"))
    q_out = 3 * wl.width * wl.heads * (wl.qk_dim + wl.v_dim) * 2
    assert rec["bytes"] == sum(lens) * wl.kv_heads * (wl.qk_dim + wl.v_dim) * 2 + q_out != wl.nbytes(3, 50)
    assert rec["flops"] == 2 * wl.width * wl.heads * sum(lens) * (wl.qk_dim + wl.v_dim)
    assert (rec["dist"], rec["kv"], rec["kv_min"], rec["kv_max"], rec["kv_sum"], rec["lens"]) == (
        "longtail", 50, 9, 100, 149, lens)


def test_the_selection_flags_pick_a_subset_and_bad_ones_are_refused():
    pts = M.points(dists=["ragged", "longtail", "uniform"], batches=[24, 48], kvs=[16384],
                   workloads=["gqa28_4_d128_decode", "gqa32_8_d64_decode", "gqa8_1_d128_decode", "mla16_decode"])
    assert len(pts) == 3 * 2 * 4 and {p.bs for p in pts} == {24, 48}
    assert {(p.dist, p.kv) for p in pts if p.dist == "uniform"} == {("uniform", 16384)}
    assert all(p.lens == tuple(R.lengths(p.dist, p.bs, 0, 16384 if p.dist == "uniform" else None)) for p in pts)
    assert all(len({w.geometry for w in p.wls}) == 1 for p in pts), "a point mixes KV geometries"
    assert [w.name for w in M.select_workloads(["gqa*_d64_tree8"], R.WORKLOADS)] == [
        "gqa8_1_d64_tree8", "gqa28_4_d64_tree8", "gqa32_8_d64_tree8", "gqa64_8_d64_tree8"]
    assert M.select_workloads(["gqa32_8_d128_decode"], R.WORKLOADS)[0].name == "gqa32_decode"
    assert [len(p.wls) for p in M.points("issue10", quick=True)] == [6, 6, 6, 4, 4, 4]
    for kw, msg in ((dict(dists=["zipf"]), "--dist zipf"), (dict(workloads=["nope*"]), "--workloads nope"),
                    (dict(dists=["ragged"], kvs=[16384]), "--kv 16384"), (dict(kvs=[4]), "--kv 4"),
                    (dict(batches=[0]), "--bs 0"), (dict(grid="issue9"), "--grid issue9")):
        with pytest.raises(ValueError, match=msg):
            M.points(**kw)
    import sweep
    assert sweep.main(["--dist", "ragged", "--kv", "16384", "--no-flashinfer"]) == 2


def test_an_mla_rows_balanced_form_is_taken_by_exact_name_only():
    """``mla16_decode_balanced``: the MLA row with ours on the chunk schedule, in no grid, taken
    where named exactly; patterns match the grid's workloads only."""
    got = M.select_workloads(["mla16_decode", "mla16_decode_balanced", "mla16_decode_split"], R.WORKLOADS)
    assert [w.name for w in got] == ["mla16_decode", "mla16_decode_balanced", "mla16_decode_split"]
    assert got[1].backend.endswith(":BalancedTritonMLABackend") and got[0].backend == "triton_mla"
    assert got[2].backend.endswith(":SplitTritonMLABackend")
    assert got[1].geometry == got[0].geometry == got[2].geometry, "a form would not share the row's KV pool"
    assert not any(w.balanced or w.split for w in M.select_workloads(["mla*"], R.WORKLOADS))
    assert not any(w.balanced for w in M.select_workloads(None, R.WORKLOADS))
    with pytest.raises(ValueError, match="gqa8_1_d128_decode_balanced"):
        M.select_workloads(["gqa8_1_d128_decode_balanced"], R.WORKLOADS)


def test_every_rows_pow2_form_is_taken_by_exact_name_only():
    """``*_pow2``: ours at power-of-two counts (``EXACT_CHUNK_SPLITS`` off, the rule before it), GQA and
    MLA, in no grid, taken where named exactly, on the row's KV pool."""
    got = M.select_workloads(["gqa28_4_d64_decode", "gqa28_4_d64_decode_pow2", "mla128_decode_pow2"], R.WORKLOADS)
    assert [w.name for w in got] == ["gqa28_4_d64_decode", "gqa28_4_d64_decode_pow2", "mla128_decode_pow2"]
    assert got[1].backend.endswith(":Pow2SplitsTritonBackend") and got[0].backend == "triton"
    assert got[2].backend.endswith(":Pow2SplitsTritonMLABackend")
    assert got[1].geometry == got[0].geometry
    assert not any(w.pow2 for w in M.select_workloads(["gqa*", "mla*"], R.WORKLOADS))
