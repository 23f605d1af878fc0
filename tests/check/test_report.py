"""The suites' report: one count per check, the table (100 columns, a legend from INVARIANTS,
``ok N`` / ``FAIL F of N``) and the command that replays a failure's case."""
import pytest

from attn_backends.check import report as rp
from attn_backends.check.report import Failure, SuiteReport, grid, invariant_key

LAYOUT_MODES = ["decode", "extend", "verify_chain", "verify_tree", "draft_extend", "draft_decode"]


def test_a_check_with_several_messages_counts_once_and_keeps_them_all():
    rep = SuiteReport()
    assert rep.check("b", "decode", "I1", [], case="c0", seed=1)
    assert not rep.check("b", "decode", "I1", ["cu_seqlens_q differs", "max_seq_len_q differs"], case="c1", seed=2)
    assert rep.counts[("b", "decode", "I1")] == [1, 1]
    assert len(rep.failures) == 1
    assert rep.failures[0].message == "cu_seqlens_q differs; max_seq_len_q differs"
    assert rep.table().splitlines()[-1].split() == ["I1", "FAIL", "1", "of", "2"]


def test_cells_read_ok_n_and_fail_f_of_n():
    rep = SuiteReport()
    rep.cases[("b", "decode")] = 3
    for ok in (True, True, False):
        rep.record("b", "decode", "I3", ok)
    rep.record("b", "decode", "I2", True)
    rows = {line.split()[0]: line.split(None, 1)[1] for line in rep.table().splitlines()[3:]}
    assert rows == {"cases": "3", "I2": "ok 1", "I3": "FAIL 1 of 3"}


def test_invariant_ids_sort_by_number_and_take_suffixes():
    assert sorted(["I10", "I9n", "I2", "I9", "X"], key=invariant_key) == ["I2", "I9", "I9n", "I10", "X"]


def test_the_widest_table_fits_100_columns_and_keeps_every_cell(monkeypatch):
    monkeypatch.setitem(rp.INVARIANTS, "I9n", "numbers: output == the reference backend's within a dtype tolerance")
    rep = SuiteReport()
    invs = [f"I{i}" for i in range(1, 16)] + ["I9n", "I42"]
    modes = LAYOUT_MODES + ["runner:decode", "runner:verify", "runner:draft_extend", "runner:draft_decode",
                            "runner:piecewise", "runner:breakable"]
    for m in modes:
        rep.cases[("a_backend_with_a_long_name", m)] = 3000
        for inv in invs:
            for _ in range(3000):
                rep.record("a_backend_with_a_long_name", m, inv, False)   # "FAIL 3000 of 3000" everywhere
    table, legend = rep.table(), rep.legend()
    assert max(map(len, (table + "\n" + legend).splitlines())) <= 100
    assert table.count("FAIL 3000 of 3000") == len(modes) * len(invs)
    assert "a_backend_with_a_long_name, layout suite:" in table and "a_backend_with_a_long_name, runner suite:" in table
    for m in modes:
        assert m.split(":")[-1] in table
    lines = legend.splitlines()
    assert lines[0].startswith("cells: ")
    assert [line.split()[0] for line in lines[1:] if not line.startswith(" ")] == sorted(invs, key=invariant_key)
    assert any(line.startswith("I9n") and "dtype tolerance" in line for line in lines)   # new ids need no edit here
    assert any(line.startswith("I42") and "not described" in line for line in lines)


def test_grid_repeats_the_first_column_on_each_band():
    head = ["inv"] + [f"col{i}" for i in range(12)]
    rows = [["I1"] + ["FAIL 10 of 600"] * 12]
    out = grid(head, rows, width=60)
    assert max(map(len, out.splitlines())) <= 60
    assert out.count("FAIL 10 of 600") == 12
    assert sum(1 for line in out.splitlines() if line.startswith("I1 ")) > 1


@pytest.mark.parametrize("suite, mode, expected", [
    ("layout", "verify_tree", "attn-backends check --backend torch_native --device cuda --suite layout "
                              "--mode verify_tree --seed 1000017 --cases 1"),
    ("runner", "runner:decode", "attn-backends check --backend torch_native --device cuda --suite runner "
                                "--seed 1000017 --suite-cases 1"),
])
def test_replay_names_backend_device_suite_mode_and_seed(suite, mode, expected):
    f = Failure("torch_native", mode, "I1", "m", "case", 1000017, suite=suite, device="cuda")
    assert f.replay() == expected
    assert str(f).endswith(f"replay: {expected}")
    assert f.as_dict()["replay"] == expected


def test_replay_quotes_a_backend_path_for_the_shell():
    f = Failure("my dir/attn.py:Backend", "decode", "I3", "m", "c", 5)
    assert "--backend 'my dir/attn.py:Backend' --device cpu" in f.replay()
