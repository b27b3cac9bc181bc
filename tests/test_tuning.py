"""Tuning tables: built from measurements, looked up by size and rank count, used by algorithm="auto"."""

import pytest

from tplab.collectives import auto, tuning


def rows(ranks, timings):
    """timings: {size: {algorithm: time_us}}"""
    return [{"collective": "allreduce", "algorithm": a, "ranks": ranks, "size": s, "time_us": t, "wrong": 0}
            for s, by_alg in timings.items() for a, t in by_alg.items()]


MEASURED = rows(4, {
    8: {"recursive_doubling": 10, "ring": 30, "builtin": 5},
    2048: {"recursive_doubling": 20, "ring": 35, "builtin": 6},
    32768: {"recursive_doubling": 80, "ring": 60, "rabenseifner": 70},
    1 << 20: {"recursive_doubling": 900, "ring": 400, "rabenseifner": 380},
}) + rows(16, {8: {"tree": 10, "ring": 90}, 1 << 20: {"tree": 2000, "ring": 700}})


def test_table_from_rows_picks_fastest_hand_written_and_merges_ranges():
    table = tuning.table_from_rows(MEASURED, machine="test")
    assert tuning.crossovers(table, "allreduce", 4) == [
        (int((2048 * 32768) ** 0.5), "recursive_doubling"), (int((32768 * (1 << 20)) ** 0.5), "ring"),
        (None, "rabenseifner")]
    assert tuning.crossovers(table, "allreduce", 16) == [(int((8 * (1 << 20)) ** 0.5), "tree"), (None, "ring")]
    assert "builtin" not in str(table["collectives"])


def test_wrong_results_never_win():
    bad = MEASURED + [{"collective": "allreduce", "algorithm": "naive", "ranks": 4, "size": 8, "time_us": 1,
                       "wrong": 3}]
    assert tuning.lookup(tuning.table_from_rows(bad), "allreduce", 8, 4) == "recursive_doubling"


def test_lookup_uses_nearest_rank_count():
    table = tuning.table_from_rows(MEASURED)
    assert tuning.lookup(table, "allreduce", 100, 4) == "recursive_doubling"
    assert tuning.lookup(table, "allreduce", 1 << 30, 4) == "rabenseifner"
    assert tuning.lookup(table, "allreduce", 8, 12) == "tree"      # log2(12) is nearer 16 than 4
    assert tuning.lookup(table, "allreduce", 8, 6) == "recursive_doubling"
    assert tuning.lookup(table, "allgather", 8, 4) is None


def test_auto_follows_the_table_in_use_then_mpich_rules(tmp_path):
    path = tmp_path / "tuning.json"
    tuning.save_table(tuning.table_from_rows(MEASURED), str(path))
    try:
        tuning.use_table(str(path))
        assert auto.choose("allreduce", 1 << 16, 1 << 14, 4) == "ring"
        assert auto.choose("allgather", 1024, 256, 4) == "recursive_doubling"  # not in table: MPICH rule
    finally:
        tuning.use_table(None)
    assert auto.choose("allreduce", 1 << 16, 1 << 14, 4) == "rabenseifner"


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_mpich_rule_without_table(p):
    assert auto.choose("allreduce", 8, 2, p) == "recursive_doubling"


def test_near_ties_do_not_flip_the_winner():
    noisy = rows(4, {8: {"tree": 10.0, "naive": 10.3}, 64: {"tree": 10.2, "naive": 10.0},
                     512: {"tree": 10.1, "naive": 10.4}, 4096: {"tree": 30.0, "naive": 20.0}})
    table = tuning.table_from_rows(noisy)
    assert tuning.crossovers(table, "allreduce", 4) == [(int((512 * 4096) ** 0.5), "tree"), (None, "naive")]


def test_describe_in_words():
    table = tuning.table_from_rows(MEASURED)
    assert tuning.describe(table, "allreduce", 16) == [("up to 2.83 KiB", "tree"), ("above 2.83 KiB", "ring")]
    assert tuning.human_bytes(1536) == "1.5 KiB" and tuning.human_bytes(3 << 30) == "3 GiB"
