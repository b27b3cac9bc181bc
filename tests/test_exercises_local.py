"""Notebooks 02 and 03's exercises (formulas and tables, no ranks) and the predict-then-run helper."""

from tplab.lab.exercises import (
    check_busiest_bytes,
    check_crossover,
    check_decision,
    check_prediction,
    check_ring_time,
    passed,
    solutions,
)


def test_solutions_pass():
    assert passed(check_ring_time(solutions.ring_allreduce_time, progress=False))
    assert passed(check_busiest_bytes(solutions.busiest_rank_bytes, progress=False))
    assert passed(check_crossover(solutions.crossover, progress=False))
    assert passed(check_decision(solutions.decide, progress=False))


def problems(report):
    return " | ".join(r["problem"] for r in report if not r["ok"])


def test_ring_time_hints():
    whole_vector = lambda p, n, a, b, g: 2 * (p - 1) * a + 2 * (p - 1) * n * b + (p - 1) * n * g
    assert "each ring step moves one block of n/p bytes" in problems(check_ring_time(whole_vector, progress=False))
    no_gamma = lambda p, n, a, b, g: 2 * (p - 1) * a + 2 * (p - 1) / p * n * b
    assert "no γ term" in problems(check_ring_time(no_gamma, progress=False))


def test_skeleton_is_reported_with_its_line():
    def skeleton(p, n, alpha, beta, gamma):
        raise NotImplementedError

    text = problems(check_ring_time(skeleton, progress=False))
    assert "not written yet" in text and "in skeleton, line 2 of the function (test_exercises_local.py:" in text


def test_busiest_bytes_hint():
    assert "rank 0 sends the whole reduced vector" in problems(
        check_busiest_bytes(lambda algorithm, p, n: 2 * (p - 1) / p * n, progress=False))


def test_crossover_and_decision_hints():
    def first_win(df, small, large):
        t = df.pivot_table(index="size", columns="algorithm", values="time_us")
        return next((int(s) for s in t.index if t.loc[s, large] < t.loc[s, small]), None)

    assert "wins by luck" in problems(check_crossover(first_win, progress=False))
    fastest_anywhere = lambda df, n: df.loc[df.time_us.idxmin(), "algorithm"]
    assert "builtin" in problems(check_decision(fastest_anywhere, progress=False))


def test_check_prediction(capsys):
    assert check_prediction("bytes", None, 1536) is None
    assert check_prediction("bytes", 1500, 1536) is True
    assert check_prediction("bytes", 3000, 1536) is False
    assert check_prediction("winner", "Ring", "ring") is True
    assert check_prediction("size", 1000, 1800, factor=2) is True
    out = capsys.readouterr().out
    assert "1536" in out and "within 10%" in out and "Why?" in out
