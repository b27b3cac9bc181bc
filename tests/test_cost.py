"""tplab.cost in one process: the formulas against the lecture table, tensor_parallel_allreduce_cost against
hand-computed values, the two-level machine, fitting on synthetic data, and compare()'s columns."""

import math
from dataclasses import replace

import numpy as np
import pytest

from tplab.cost import (
    FORMULAS,
    Machine,
    TwoLevelMachine,
    compare,
    critical_path,
    fit_machine,
    fit_reduction,
    fit_step,
    formula_text,
    layer_model,
    predict,
    tensor_parallel_allreduce_cost,
    traffic,
)
from tplab.cost.formulas import PATHS

ALPHA, BETA, GAMMA = Machine(1, 0, 0), Machine(0, 1, 0), Machine(0, 0, 1)  # read off one coefficient each
ALLREDUCE = ["naive", "ring", "recursive_doubling", "rabenseifner", "tree"]


def coefficients(collective, algorithm, p, n, **kw):
    """(messages, bytes, bytes reduced) on the critical path, read off through unit machines."""
    return tuple(predict(collective, algorithm, p, n, m, **kw) for m in (ALPHA, BETA, GAMMA))


# ---- tensor_parallel_allreduce_cost --------------------------------------------------------------------------
def test_tp_allreduce_cost_eight_gpus():
    got = tensor_parallel_allreduce_cost(4096, 2048, 1, 8, 32)
    # M = 1*2048*4096*2 = 16,777,216; per all-reduce 2*7/8*M = 1.75 M; x 2 per layer x 32 layers
    assert got == {"message_size_bytes": 16_777_216, "comm_volume_per_allreduce_bytes": 29_360_128.0,
                   "total_comm_volume_bytes": 1_879_048_192.0, "total_comm_time_ms": 6.2635}
    assert isinstance(got["message_size_bytes"], int)
    assert all(isinstance(got[k], float) for k in got if k != "message_size_bytes")


def test_tp_allreduce_cost_one_and_two_gpus():
    one = tensor_parallel_allreduce_cost(4096, 2048, 1, 1, 32)
    assert one == {"message_size_bytes": 16_777_216, "comm_volume_per_allreduce_bytes": 0.0,
                   "total_comm_volume_bytes": 0.0, "total_comm_time_ms": 0.0}
    two = tensor_parallel_allreduce_cost(4096, 2048, 1, 2, 32)
    # per all-reduce 2*1/2*M = M; total M*64 = 1,073,741,824; / 300e9 s = 3.5791394 ms
    assert two == {"message_size_bytes": 16_777_216, "comm_volume_per_allreduce_bytes": 16_777_216.0,
                   "total_comm_volume_bytes": 1_073_741_824.0, "total_comm_time_ms": 3.5791}


def test_tp_allreduce_cost_other_bandwidth_bytes_and_counts():
    got = tensor_parallel_allreduce_cost(1024, 512, 4, 4, 12, bytes_per_element=4, bandwidth_gb_per_sec=150.0,
                                         allreduces_per_layer=4)
    # M = 4*512*1024*4 = 8,388,608; 1.5 M = 12,582,912; x 4 x 12 = 603,979,776; / 150e9 = 4.02653 ms
    assert got == {"message_size_bytes": 8_388_608, "comm_volume_per_allreduce_bytes": 12_582_912.0,
                   "total_comm_volume_bytes": 603_979_776.0, "total_comm_time_ms": 4.0265}


def test_tp_allreduce_cost_rounds_to_four_decimals():
    got = tensor_parallel_allreduce_cost(1000, 10, 1, 3, 1)  # M = 20,000; 4/3 M = 26,666.666...
    assert got == {"message_size_bytes": 20_000, "comm_volume_per_allreduce_bytes": 26_666.6667,
                   "total_comm_volume_bytes": 53_333.3333, "total_comm_time_ms": 0.0002}


@pytest.mark.parametrize("bad", [
    dict(hidden_size=0), dict(sequence_length=-1), dict(batch_size=1.5), dict(num_gpus=0),
    dict(num_layers=True), dict(bytes_per_element=0), dict(bandwidth_gb_per_sec=0.0),
    dict(bandwidth_gb_per_sec="fast"), dict(allreduces_per_layer=-2)])
def test_tp_allreduce_cost_rejects_bad_input(bad):
    args = dict(hidden_size=4096, sequence_length=2048, batch_size=1, num_gpus=8, num_layers=32) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        tensor_parallel_allreduce_cost(**args)


# ---- the formulas are the lecture table (Thakur, Rabenseifner & Gropp 2005) for powers of two ----------------
@pytest.mark.parametrize("p", [2, 4, 8, 16, 64])
def test_powers_of_two_match_the_table(p):
    n, lg = 1024 * p, int(math.log2(p))
    table = {
        ("allreduce", "naive"): (2 * (p - 1), 2 * (p - 1) * n, (p - 1) * n),
        ("allreduce", "ring"): (2 * (p - 1), 2 * n * (p - 1) / p, n * (p - 1) / p),
        ("allreduce", "recursive_doubling"): (lg, n * lg, n * lg),
        ("allreduce", "rabenseifner"): (2 * lg, 2 * n * (p - 1) / p, n * (p - 1) / p),
        ("allreduce", "tree"): (2 * lg, 2 * n * lg, n * lg),
        ("reduce_scatter", "ring"): (p - 1, n * (p - 1) / p, n * (p - 1) / p),
        ("reduce_scatter", "recursive_halving"): (lg, n * (p - 1) / p, n * (p - 1) / p),
        ("allgather", "ring"): (p - 1, n * (p - 1) / p, 0),
        ("allgather", "recursive_doubling"): (lg, n * (p - 1) / p, 0),
        ("broadcast", "binomial"): (lg, n * lg, 0),
        ("reduce", "binomial"): (lg, n * lg, n * lg),
    }
    assert set(table) == set(PATHS)
    for (collective, algorithm), expected in table.items():
        assert coefficients(collective, algorithm, p, n) == pytest.approx(expected), (collective, algorithm)


def test_predict_is_alpha_beta_gamma_combined():
    m = Machine(alpha=2e-6, beta=1e-10, gamma=3e-11)
    p, n = 8, 1 << 20
    expected = 2 * 7 * m.alpha + 2 * 7 / 8 * n * m.beta + 7 / 8 * n * m.gamma
    assert predict("allreduce", "ring", p, n, m) == pytest.approx(expected, rel=1e-12)
    assert critical_path("allreduce", "ring", p, n).time(m) == pytest.approx(expected, rel=1e-12)
    # tplab's Python on top: once per call (entry), once per step on the critical path (like α)
    python = replace(m, entry=4e-6, entry_per_byte=5e-11, step=1e-6)
    assert predict("allreduce", "ring", p, n, python) == pytest.approx(
        expected + 4e-6 + n * 5e-11 + 2 * 7 * 1e-6, rel=1e-12)
    assert predict("allreduce", "ring", 1, n, python) == pytest.approx(4e-6 + n * 5e-11)  # the copy, no step


# ---- non-powers of two, folded as tplab folds them ------------------------------------------------------------
def test_folded_recursive_doubling_and_rabenseifner():
    n = 4096
    # p = 6 = 4 + 2: fold in (n, reduce n), lg 4 = 2 exchanges of n, fold out (n)
    assert coefficients("allreduce", "recursive_doubling", 6, n) == (4, 4 * n, 3 * n)
    # Thakur, Rabenseifner & Gropp's (2 lg p' + 2) α + (2(p'-1)/p' + 2) n β + (1 + (p'-1)/p') n γ, with p' = 4 blocks
    assert coefficients("allreduce", "rabenseifner", 6, n) == (6, (2 * 3 / 4 + 2) * n, (1 + 3 / 4) * n)
    assert coefficients("allreduce", "tree", 5, n) == (6, 6 * n, 3 * n)  # ⌈lg 5⌉ = 3 rounds each way
    assert coefficients("allreduce", "naive", 3, n) == (4, 4 * n, 2 * n)


def test_folded_reduce_scatter_and_allgather():
    n = 3 * 1024
    # p = 3: fold in the full vector; the active rank for {0, 1} holds 2 blocks, so the one halving step
    # moves 2n/3; fold out returns only rank 0's block (n/3)
    assert coefficients("reduce_scatter", "recursive_halving", 3, n) == pytest.approx((3, 2 * n, 5 * n / 3))
    # allgather: fold in one block, the doubling step moves 2 blocks, fold out the whole vector
    assert coefficients("allgather", "recursive_doubling", 3, n) == pytest.approx((3, 2 * n, 0))
    # p = 6 = 4 + 2: distances 2, 1 carry 2 + 2 and 1 + 1 real blocks at most
    n = 6 * 1024
    assert coefficients("allgather", "recursive_doubling", 6, n) == pytest.approx((4, n / 6 + 6 * n / 6 + n, 0))


def test_uneven_blocks_round_up():
    # 10 float32 on 3 ranks: blocks of 4, 3, 3 elements; every ring step waits for the 16-byte one
    assert coefficients("allreduce", "ring", 3, 40, itemsize=4) == (4, 4 * 16, 2 * 16)
    # 10 bytes on 4 ranks (Rabenseifner: blocks 3, 3, 2, 2): halving moves 6 then 3 bytes at most
    assert coefficients("allreduce", "rabenseifner", 4, 10) == (4, 18, 9)
    assert coefficients("allreduce", "ring", 3, 40, itemsize=4)[1] > coefficients("allreduce", "ring", 3, 40.5)[1]


@pytest.mark.parametrize("key", sorted(PATHS))
def test_one_rank_costs_nothing_and_time_grows_with_n(key):
    m = Machine(alpha=3e-6, beta=1e-10, gamma=5e-11)
    assert predict(*key, 1, 1 << 20, m) == 0.0
    sizes = [0, 1, 7, 8, 100, 1000, 4096, 4097, 1 << 20, 3 << 20]
    for p in range(2, 10):
        times = [predict(*key, p, n, m) for n in sizes]
        assert times == sorted(times), (key, p)


# ---- two kinds of links --------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ALLREDUCE)
def test_two_level_with_equal_links_is_one_level(algorithm):
    m = Machine(alpha=4e-6, beta=2e-10, gamma=7e-11, entry=3e-6, entry_per_byte=1e-11, step=1e-6)
    for p in range(1, 17):
        for q in (1, 2, 3, 4, 8):
            for n in (8, 1000, 4096 * 12, 1 << 20):
                one = predict("allreduce", algorithm, p, n, m, itemsize=8 if n % 8 == 0 else 1)
                two = predict("allreduce", algorithm, p, n, TwoLevelMachine(m, m, q),
                              itemsize=8 if n % 8 == 0 else 1)
                assert two == pytest.approx(one, rel=1e-12), (p, q, n)


FAST, SLOW = Machine(alpha=1e-6, beta=1e-11, gamma=1e-11), Machine(alpha=10e-6, beta=1e-9, gamma=1e-11)


def test_two_level_steps_run_at_their_slowest_link():
    n, cluster = 1 << 20, TwoLevelMachine(FAST, SLOW, ranks_per_node=4)
    # recursive doubling on 8 ranks, 4 per node: distances 1 and 2 stay inside, distance 4 crosses
    expected = 2 * (FAST.alpha + n * FAST.beta) + (SLOW.alpha + n * SLOW.beta) + 3 * n * FAST.gamma
    assert predict("allreduce", "recursive_doubling", 8, n, cluster) == pytest.approx(expected)
    # Rabenseifner on 8 ranks, 2 per node: distances 4 and 2 cross with n/2 and n/4, distance 1 stays in
    cluster = TwoLevelMachine(FAST, SLOW, ranks_per_node=2)
    one_way = (SLOW.alpha + n / 2 * SLOW.beta) + (SLOW.alpha + n / 4 * SLOW.beta) + (FAST.alpha + n / 8 * FAST.beta)
    assert predict("allreduce", "rabenseifner", 8, n, cluster) == pytest.approx(2 * one_way + 7 / 8 * n * FAST.gamma)
    # a ring over more than one node: every step waits for the crossing link
    ring = 2 * 7 * (SLOW.alpha + n / 8 * SLOW.beta) + 7 / 8 * n * FAST.gamma
    assert predict("allreduce", "ring", 8, n, cluster) == pytest.approx(ring)


def test_hierarchical():
    n = 1 << 20
    one_node = TwoLevelMachine(FAST, SLOW, ranks_per_node=8)
    assert predict("allreduce", "hierarchical", 8, n, one_node) == pytest.approx(
        predict("allreduce", "ring", 8, n, FAST))  # one node: just a ring
    q, nodes = 4, 4
    expected = ((q - 1) * (FAST.alpha + n / q * FAST.beta + n / q * FAST.gamma)
                + 2 * (nodes - 1) * (SLOW.alpha + n / 16 * SLOW.beta) + (nodes - 1) * n / 16 * FAST.gamma
                + (q - 1) * (FAST.alpha + n / q * FAST.beta))
    cluster = TwoLevelMachine(FAST, SLOW, ranks_per_node=q)
    assert predict("allreduce", "hierarchical", 16, n, cluster) == pytest.approx(expected)
    for size in (1 << 10, 1 << 16, 1 << 20, 1 << 26):
        hierarchical = predict("allreduce", "hierarchical", 16, size, cluster)
        assert hierarchical < predict("allreduce", "ring", 16, size, cluster)
    # uneven nodes (4 + 2 ranks): tplab reduces to a leader per node, allreduces among leaders, broadcasts
    tree = 2 * (FAST.alpha + n * FAST.beta)  # ⌈lg 4⌉ = 2 rounds inside the fullest node, each way
    leaders = 2 * (SLOW.alpha + n / 2 * SLOW.beta) + n / 2 * FAST.gamma
    assert predict("allreduce", "hierarchical", 6, n, cluster) == pytest.approx(tree + 2 * n * FAST.gamma
                                                                                 + leaders + tree)


def test_shared_link_divides_the_nodes_bandwidth():
    """One link per node (shared_link): k messages leaving a node in one step cost k·m·β₂ each; the ring
    and the leaders have one per node (unchanged), hierarchical q, recursive doubling's crossing step q."""
    n, q = 1 << 20, 4
    own, shared = TwoLevelMachine(FAST, SLOW, q), TwoLevelMachine(FAST, SLOW, q, shared_link=True)
    assert predict("allreduce", "ring", 8, n, shared) == predict("allreduce", "ring", 8, n, own)
    assert predict("allreduce", "hierarchical", 6, n, shared) == predict("allreduce", "hierarchical", 6, n, own)
    extra_hierarchical = 2 * (q - 1) * (n / 8) * SLOW.beta  # 2(N-1) = 2 steps of n/p, now q times the bytes
    assert predict("allreduce", "hierarchical", 8, n, shared) == pytest.approx(
        predict("allreduce", "hierarchical", 8, n, own) + extra_hierarchical)
    extra_doubling = (q - 1) * n * SLOW.beta  # distance 4 crosses: all 4 ranks of a node send n at once
    assert predict("allreduce", "recursive_doubling", 8, n, shared) == pytest.approx(
        predict("allreduce", "recursive_doubling", 8, n, own) + extra_doubling)
    assert TwoLevelMachine(FAST, FAST, q, shared_link=True).step([(0, 1, n), (2, 3, n)]) == FAST.alpha + n * FAST.beta


# ---- error messages and the printed formulas ---------------------------------------------------------------
def test_unknown_names_are_clear_errors():
    m = Machine(1e-6, 1e-10, 1e-11)
    with pytest.raises(ValueError, match="'bogus'.*known: .*allreduce/ring"):
        predict("allreduce", "bogus", 4, 1024, m)
    with pytest.raises(ValueError, match="'alltoall'"):
        predict("alltoall", "ring", 4, 1024, m)
    with pytest.raises(ValueError, match="TwoLevelMachine"):
        predict("allreduce", "hierarchical", 4, 1024, m)
    with pytest.raises(ValueError, match="'bogus'"):
        predict("allreduce", "bogus", 4, 1024, TwoLevelMachine(m, m, 2))
    with pytest.raises(ValueError, match="reduce_scatter"):
        predict("reduce_scatter", "ring", 4, 1024, TwoLevelMachine(m, m, 2))  # only allreduce is two-level
    with pytest.raises(ValueError, match="'bogus'"):
        traffic("allreduce", "bogus", 4, 1024)
    with pytest.raises(ValueError, match="'bogus'"):
        formula_text("allreduce", "bogus")
    with pytest.raises(ValueError, match="positive int"):
        predict("allreduce", "ring", 0, 1024, m)
    with pytest.raises(ValueError, match="ranks_per_node"):
        TwoLevelMachine(m, m, 0)


def test_formula_text():
    assert formula_text("allreduce", "ring") == "2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ"
    assert "p'" in formula_text("allreduce", "rabenseifner", power_of_two=False)
    assert formula_text("allreduce", "ring", power_of_two=False) == formula_text("allreduce", "ring")
    assert set(PATHS) <= set(FORMULAS)


def test_hierarchical_traffic():
    n = 1 << 12
    assert traffic("allreduce", "hierarchical", 8, n, ranks_per_node=8) == traffic("allreduce", "ring", 8, n)
    assert traffic("allreduce", "hierarchical", 8, n, ranks_per_node=1) == traffic("allreduce", "ring", 8, n)
    two_nodes = traffic("allreduce", "hierarchical", 8, n, ranks_per_node=4)
    assert two_nodes["max_messages"] == 2 * 3 + 2 * 1 and two_nodes["max_bytes"] == 2 * 3 / 4 * n + 2 * n / 8
    with pytest.raises(ValueError, match="ranks_per_node"):
        traffic("allreduce", "hierarchical", 8, n)


def test_traffic_totals():
    for p in (2, 3, 5, 8):
        n = 64 * p
        assert traffic("allreduce", "ring", p, n)["total_bytes"] == 2 * (p - 1) * n
        assert traffic("reduce", "binomial", p, n) == {"max_messages": 1, "max_bytes": n,
                                                        "total_messages": p - 1, "total_bytes": (p - 1) * n}


# ---- tensor-parallel layer -----------------------------------------------------------------------------------
@pytest.mark.parametrize("h,s,p,bytes_",
                         [(4096, 2048, 8, 2), (5120, 4096, 4, 2), (1024, 128, 2, 4), (8192, 32768, 16, 2)])
def test_layer_ratio_is_the_closed_form_and_independent_of_batch(h, s, p, bytes_):
    F, B = 989e12, 300e9
    ratios = []
    for b in (1, 3, 16):
        layer = layer_model(h, s, b, p, bytes_per_element=bytes_, peak_flops=F, bus_bandwidth=B)
        assert layer["flops"] == 24 * b * s * h**2 + 4 * b * s**2 * h
        assert layer["comm_bytes_per_rank"] == pytest.approx(2 * 2 * (p - 1) / p * b * s * h * bytes_)
        assert layer["ratio"] == pytest.approx((p - 1) * bytes_ * F / (B * (6 * h + s)), rel=1e-12)
        ratios.append(layer["ratio"])
    assert ratios == pytest.approx([ratios[0]] * 3, rel=1e-12)


def test_sequence_parallel_same_bytes_less_memory():
    tp = layer_model(4096, 2048, 1, 8, num_heads=32)
    sp = layer_model(4096, 2048, 1, 8, num_heads=32, sequence_parallel=True)
    assert tp["collectives"] == {"allreduce": 2} and sp["collectives"] == {"allgather": 2, "reduce_scatter": 2}
    assert sp["comm_bytes_per_rank"] == pytest.approx(tp["comm_bytes_per_rank"])
    assert sp["activation_bytes_per_rank"] < tp["activation_bytes_per_rank"]
    assert layer_model(4096, 2048, 1, 1)["ratio"] == 0.0
    with pytest.raises(ValueError, match="tp"):
        layer_model(4096, 2048, 1, 0)


# ---- fitting and comparing (synthetic numbers; timing itself is tests/mpi/test_fit.py) -------------------------
def test_fit_recovers_known_parameters():
    alpha, beta, gamma, call = 3e-6, 1 / 12e9, 1 / 30e9, 4e-7
    sizes = [8 << i for i in range(20)]
    exchange = [{"size": n, "time_s": alpha + n * beta} for n in sizes]
    reduction = [{"size": n, "time_s": call + n * gamma} for n in sizes]
    m = fit_machine(exchange, reduction, name="synthetic")
    assert (m.alpha, m.beta, m.gamma) == pytest.approx((alpha, beta, gamma), rel=1e-6)
    assert fit_reduction(reduction) == pytest.approx((gamma, call), rel=1e-6)
    assert m.name == "synthetic"
    # timings a plain fit would give a negative intercept still give a positive α
    noisy = [{"size": n, "time_s": n * beta * (1.3 if n < 100 else 1.0)} for n in sizes]
    assert fit_machine(noisy, reduction).alpha > 0


def test_fit_step_calibrates_the_unexplained_per_step_time():
    m = Machine(alpha=3e-6, beta=1e-10, gamma=5e-11, entry=4e-6)
    truth = replace(m, step=1.5e-6)
    rows = [{"collective": "allreduce", "algorithm": a, "ranks": p, "size": n, "type": "float32",
             "time_us": predict("allreduce", a, p, n, truth, itemsize=4) * 1e6}
            for a in ALLREDUCE for p in (2, 3, 4) for n in (8, 256, 1024, 1 << 20)]
    rows.append({"collective": "allreduce", "algorithm": "builtin", "ranks": 2, "size": 8, "time_us": 1.0})
    assert fit_step(rows, m).step == pytest.approx(1.5e-6)
    assert replace(fit_step(rows, m), step=1.5e-6) == truth  # nothing else changes
    with pytest.raises(ValueError, match="no rows"):
        fit_step(rows, m, max_size=4)


def test_compare_adds_prediction_and_error():
    m = Machine(alpha=5e-6, beta=1e-10, gamma=5e-11)
    exact = predict("allreduce", "ring", 4, 4096, m, itemsize=4) * 1e6
    rows = [{"collective": "allreduce", "algorithm": "ring", "ranks": 4, "size": 4096, "type": "float32",
             "time_us": exact},
            {"collective": "allreduce", "algorithm": "builtin", "ranks": 4, "size": 4096, "type": "float32",
             "time_us": 10.0}]
    out = compare(rows, m)
    assert out[0]["predicted_us"] == pytest.approx(exact) and out[0]["error"] == pytest.approx(0.0)
    assert math.isnan(out[1]["predicted_us"]) and math.isnan(out[1]["error"])
    pd = pytest.importorskip("pandas")
    frame = compare(pd.DataFrame(rows), m)
    assert list(frame.columns)[-2:] == ["predicted_us", "error"] and len(frame) == 2
    assert np.isclose(frame["error"][0], 0.0)


def test_two_protocol_fit_finds_the_bend():
    """Synthetic exchange times: an eager line up to 16 KiB, a rendezvous line (higher latency) above."""
    from tplab.cost.fit import fit_machine, fit_two_lines

    sizes = [8 << (2 * i) for i in range(11)]
    def t(n):
        return 2e-6 + n / 10e9 if n <= 16384 else 9e-6 + n / 12e9
    rows = [{"size": n, "time_s": t(n)} for n in sizes]
    switch, (a1, b1), (a2, b2) = fit_two_lines(rows)
    assert 8192 < switch < 32768
    assert a1 == pytest.approx(2e-6, rel=0.05) and a2 == pytest.approx(9e-6, rel=0.05)
    m = fit_machine(rows, [{"size": n, "time_s": n / 20e9} for n in sizes])
    assert m.link(1024) == pytest.approx((a1, b1)) and m.link(1 << 20) == pytest.approx((a2, b2))
    straight = [{"size": n, "time_s": 2e-6 + n / 10e9} for n in sizes]
    assert fit_two_lines(straight) is None and fit_machine(straight, rows).alpha_large is None


def test_fit_on_timings_recovers_a_machine():
    from tplab.cost import Machine, compare, fit_on_timings, predict

    truth = Machine(alpha=4e-6, beta=1 / 12e9, gamma=1 / 25e9, entry=5e-6, entry_per_byte=1 / 30e9)
    rows = [{"collective": "allreduce", "algorithm": a, "ranks": p, "size": n, "type": "float32",
             "time_us": predict("allreduce", a, p, n, truth, itemsize=4) * 1e6}
            for a in ["ring", "recursive_doubling", "rabenseifner", "naive"] for p in [2, 4, 8]
            for n in [8 << (2 * i) for i in range(11)]]
    fitted = fit_on_timings(rows)
    assert all(abs(r["error"]) < 0.01 for r in compare(rows, fitted))
    with pytest.raises(ValueError, match="at least five"):
        fit_on_timings(rows[:3])
