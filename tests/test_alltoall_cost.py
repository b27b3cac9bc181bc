"""The α-β cost of all-to-all: pairwise exchange against Bruck (tplab.cost.alltoall)."""

import pytest

from tplab.cost import Machine, alltoall_traffic, crossover_bytes, predict
from tplab.cost.alltoall import bruck_blocks, formula_text_alltoall

M = Machine(alpha=5e-6, beta=1 / 10e9, gamma=0.0)


@pytest.mark.parametrize("p", [2, 4, 8, 16, 64])
def test_bruck_sends_half_the_blocks_lg_p_times_for_powers_of_two(p):
    assert bruck_blocks(p) == p // 2 * (p.bit_length() - 1)


def test_the_formulas():
    n = 1 << 20
    assert predict("alltoall", "pairwise", 8, n, M) == pytest.approx(7 * M.alpha + 7 / 8 * n * M.beta)
    assert predict("alltoall", "bruck", 8, n, M) == pytest.approx(3 * M.alpha + 12 / 8 * n * M.beta)
    assert predict("alltoall", "bruck", 5, n, M) == pytest.approx(3 * M.alpha + (2 + 2 + 1) / 5 * n * M.beta)
    assert alltoall_traffic("pairwise", 1, 100)["max_messages"] == 0
    assert "lg p" in formula_text_alltoall("bruck")
    with pytest.raises(ValueError, match="'alltoall'.*'ring'"):
        predict("alltoall", "ring", 4, 1024, M)


@pytest.mark.parametrize("p", [4, 5, 8, 16])
def test_bruck_wins_below_the_crossover_and_loses_above(p):
    n_star = crossover_bytes(p, M)
    assert predict("alltoall", "bruck", p, n_star / 2, M) < predict("alltoall", "pairwise", p, n_star / 2, M)
    assert predict("alltoall", "bruck", p, n_star * 2, M) > predict("alltoall", "pairwise", p, n_star * 2, M)
    assert predict("alltoall", "bruck", p, n_star, M) == pytest.approx(predict("alltoall", "pairwise", p, n_star, M))


def test_no_crossover_where_both_send_the_same():
    assert crossover_bytes(2, M) is None and crossover_bytes(3, M) is None


def test_fit_and_measured_crossover():
    from tplab.cost.alltoall import fit_pairwise, measured_crossover

    rows = [{"algorithm": a, "size": n, "time_us": predict("alltoall", a, 4, n, M) * 1e6}
            for a in ("pairwise", "bruck") for n in (64, 1 << 14, 1 << 20, 1 << 24)]
    fitted = fit_pairwise(rows, 4)
    assert fitted.alpha == pytest.approx(M.alpha) and fitted.beta == pytest.approx(M.beta)
    crossover = crossover_bytes(4, M)
    assert measured_crossover(rows) == min(n for n in (64, 1 << 14, 1 << 20, 1 << 24) if n > crossover)
    with pytest.raises(ValueError, match="two sizes"):
        fit_pairwise(rows[:1], 4)
