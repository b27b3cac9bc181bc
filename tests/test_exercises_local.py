"""The exercises without ranks (02, 03, 05-08: formulas, tables, schedules) and the predict-then-run helper."""

from tplab.lab.exercises import (
    check_busiest_bytes,
    check_crossover,
    check_decision,
    check_gpipe,
    check_lpt,
    check_pipeline_time,
    check_prediction,
    check_ring_time,
    check_sync_count,
    check_zigzag_positions,
    passed,
    solutions,
)


def test_solutions_pass():
    assert passed(check_ring_time(solutions.ring_allreduce_time, progress=False))
    assert passed(check_busiest_bytes(solutions.busiest_rank_bytes, progress=False))
    assert passed(check_crossover(solutions.crossover, progress=False))
    assert passed(check_decision(solutions.decide, progress=False))
    assert passed(check_zigzag_positions(solutions.zigzag_positions, progress=False))
    assert passed(check_pipeline_time(solutions.pipeline_time, progress=False))
    assert passed(check_lpt(solutions.lpt, progress=False))
    assert passed(check_gpipe(solutions.gpipe, progress=False))
    assert passed(check_sync_count(solutions.sync_count, progress=False))


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


def test_zigzag_hints():
    def contiguous(s, p, r):
        return list(range(r * s // p, (r + 1) * s // p))

    def off_by_one(s, p, r):
        n = s // (2 * p)
        return [*range(r * n, (r + 1) * n), *range((2 * p - r) * n, (2 * p - r + 1) * n)]

    def no_check(s, p, r):
        return solutions.zigzag_positions(s - s % (2 * p), p, r)

    assert "that is the contiguous layout" in problems(check_zigzag_positions(contiguous, progress=False))
    assert "rank r's partner chunk is 2p-1-r" in problems(check_zigzag_positions(off_by_one, progress=False))
    assert "raise ValueError" in problems(check_zigzag_positions(no_check, progress=False))


def test_pipeline_time_hints():
    no_overlap = lambda compute, a, b, k: compute + k * a + b
    perfect = lambda compute, a, b, k: max(compute, k * (a + b / k))
    assert "the time without overlap" in problems(check_pipeline_time(no_overlap, progress=False))
    assert "never hidden" in problems(check_pipeline_time(perfect, progress=False))


def test_lpt_hints():
    from tplab.balance import schedulers

    arrival = lambda costs, m: schedulers.list_schedule(costs, m)
    assert "in arrival order: sort longest first" in problems(check_lpt(arrival, progress=False))
    assert "that is round-robin" in problems(check_lpt(schedulers.round_robin, progress=False))
    assert "not every request exactly once" in problems(check_lpt(lambda costs, m: [list(range(len(costs)))] + [[0]] * (m - 1), progress=False))


def test_gpipe_hints():
    equal_formula = lambda costs, p: (sum(costs) + (p - 1) * max(costs), (p - 1) / (len(costs) + p - 1))
    mean = lambda costs, p: (sum(costs) + (p - 1) * sum(costs) / len(costs), 0.0)
    assert "holds for equal micro-batches only" in problems(check_gpipe(equal_formula, progress=False))
    assert "not the mean" in problems(check_gpipe(mean, progress=False))


def test_sync_count_hints():
    per_block = lambda pattern: sum(2 if b == "tp" else 1 for b in pattern)
    with_f = lambda pattern: solutions.sync_count(pattern) + sum(
        1 for i, b in enumerate(pattern) if b == "parallel" and (i == 0 or pattern[i - 1] != "parallel"))
    assert "a run of parallel blocks needs only one" in problems(check_sync_count(per_block, progress=False))
    assert "all-reduces in the backward pass only" in problems(check_sync_count(with_f, progress=False))
