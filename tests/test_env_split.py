"""tests.env_split's decision, on a made-up measurement: which lines count for whom, the greedy cover,
and the check of a default-only list (the measurement itself runs the whole suite: docs/running.md#tests)."""
import textwrap

import pytest

from tests.env_split import Split, greedy_cover, measured_lines

coverage = pytest.importorskip("coverage")


def test_greedy_cover_takes_the_most_new_lines_per_second_until_nothing_is_new():
    lines = {"a": {1, 2, 3}, "b": {3, 4}, "c": {1, 2, 3, 4}, "d": {4}, "e": {2}}
    cost = {"a": 1.0, "b": 1.0, "c": 10.0, "d": 0.5, "e": 0.1}
    # e first (10 new lines a second); then a, b and d tie at 2 a second: the last name, d; then a
    kept = greedy_cover(sorted(lines), lines, cost, covered=set())
    assert set().union(*(lines[t] for t in kept)) == {1, 2, 3, 4}
    assert kept == ["e", "d", "a"]
    assert greedy_cover(sorted(lines), lines, cost, covered={1, 2, 3, 4}) == []


def test_a_checks_lines_count_for_the_check_and_import_time_lines_for_nobody(tmp_path):
    source = tmp_path / "lib.py"
    source.write_text(textwrap.dedent("""\
        X = 1
        def f():
            return 2
        def g():
            return 3
    """))
    data = coverage.CoverageData(str(tmp_path / "coverage"))
    path = str(source)
    for context, numbers in [("|tests/test_a.py::t", [1, 3]),            # pytest's process
                             ("tests/distributed/test_d.py::t", [5]),     # a worker, before its checks
                             ("tests/distributed/test_d.py::t|check:grpo_tp2", [3, 5])]:
        data.set_context(context)
        data.add_lines({path: numbers})
    data.write()
    tests, checks = measured_lines(str(tmp_path / "coverage"))
    assert tests == {"tests/test_a.py::t": {(path, 3)}, "tests/distributed/test_d.py::t": {(path, 5)}}
    assert checks == {"grpo_tp2": {(path, 3), (path, 5)}}


def _split(listed=None):
    seconds = {"tests/test_a.py::cheap": 1.0, "tests/test_a.py::dear": 9.0, "tests/test_a.py::unique": 5.0,
               "tests/test_c.py::contract": 3.0, "tests/distributed/test_d.py::ppo": 2.0,
               "tests/distributed/test_d.py::awm": 0.1, "tests/distributed/test_d.py::nft": 0.1}
    tests = {"tests/test_a.py::cheap": {1, 2}, "tests/test_a.py::dear": {1, 2}, "tests/test_a.py::unique": {7},
             "tests/test_c.py::contract": {8}, "tests/distributed/test_d.py::ppo": {9}}
    checks = {"ppo_tp2": {3}, "awm_tp2": {3, 4}, "nft_tp2": {3, 2}}
    reads = {"tests/distributed/test_d.py::ppo": {"ppo_tp2": 10.0}, "tests/distributed/test_d.py::awm": {"awm_tp2": 10.0},
             "tests/distributed/test_d.py::nft": {"nft_tp2": 10.0}}
    return Split(seconds, tests, checks, reads, always={"tests/test_c.py::contract"}, listed=listed)


def test_the_split_keeps_contracts_and_a_cheapest_cover_of_every_line_checks_counted_with_their_tests():
    split = _split()
    assert split.fixed == {"tests/test_c.py::contract"}
    # awm's check alone runs line 4; nft's lines run in cheaper tests; ppo's test alone runs line 9
    assert split.kept == {"tests/test_a.py::cheap", "tests/test_a.py::unique", "tests/distributed/test_d.py::ppo",
                          "tests/distributed/test_d.py::awm"}
    assert split.listed == ["tests/distributed/test_d.py::nft", "tests/test_a.py::dear"]
    assert split.skipped_checks == {"nft_tp2"}
    assert not split.missed and not split.orphans


def test_a_default_only_list_fails_when_what_it_leaves_out_ran_a_line_nothing_kept_runs():
    ok = {"tests/test_a.py::dear", "tests/distributed/test_d.py::nft", "check:nft_tp2"}
    assert not _split(listed=ok).missed and not _split(listed=ok).orphans
    split = _split(listed=ok | {"tests/test_a.py::unique", "tests/test_c.py::contract",
                                "tests/distributed/test_d.py::awm", "check:awm_tp2"})
    assert "tests/test_c.py::contract" not in split.listed  # never a contract
    assert split.missed == {4, 7}
    assert split.holders() == ["check:awm_tp2", "tests/test_a.py::unique"]
    # a check left out while a test that runs there reads it
    assert _split(listed={"check:ppo_tp2"}).orphans == {"ppo_tp2"}
