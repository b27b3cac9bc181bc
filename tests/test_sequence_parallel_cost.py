"""tplab.cost.sequence_parallel in one process: the formulas against hand-computed values (the counters of
real runs are checked in tests/mpi/test_sequence_attention.py), causal work, SP vs TP, staged vs direct."""

import pytest

from tplab.cost import attention_bytes, attention_messages, causal_work, sp_vs_tp, staged_vs_direct
from tplab.cost.sequence_parallel import kv_memory

LAYER = dict(batch=4, seq_len=4096, hidden=5120)  # the course project's layer


def test_bytes_by_hand():
    tokens_bytes = 4 * 4096 * 5120 * 4  # b·s·h·e, fp32
    assert attention_bytes("allgather_kv", p=4, **LAYER) == 2 * 3 / 4 * tokens_bytes
    assert attention_bytes("ring", p=4, **LAYER) == attention_bytes("allgather_kv", p=4, **LAYER)
    assert attention_bytes("ulysses", p=4, **LAYER) == 3 / 16 * 4 * tokens_bytes  # ≈ 4Nh/p
    assert attention_bytes("allgather_kv", p=4, kv_hidden=1280, **LAYER) == 2 * 3 / 4 * tokens_bytes / 4  # GQA
    assert all(attention_bytes(s, p=1, **LAYER) == 0 for s in ("allgather_kv", "ring", "ulysses"))
    assert [attention_messages(s, 5) for s in ("allgather_kv", "ring", "ulysses")] == [8, 4, 16]
    with pytest.raises(ValueError, match="unknown scheme"):
        attention_bytes("tree", p=4, **LAYER)
    with pytest.raises(ValueError, match="positive int"):
        attention_bytes("ring", p=0, **LAYER)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 7, 8])
def test_causal_work_adds_up_to_the_triangle(p):
    s = 2 * p * 6
    for layout in ("contiguous", "zigzag"):
        assert sum(causal_work(s, p, layout)) == pytest.approx(s * s / 2)
    contiguous = causal_work(s, p, "contiguous")
    assert contiguous == sorted(contiguous) and contiguous[-1] == pytest.approx((2 * p - 1) * contiguous[0])
    assert len(set(causal_work(s, p, "zigzag"))) == 1


def test_memory_and_sp_vs_tp():
    full = 2 * 4 * 4096 * 5120 * 4
    assert kv_memory("allgather_kv", p=4, **LAYER) == full
    assert kv_memory("ring", p=4, **LAYER) == 3 * full / 4
    assert kv_memory("ulysses", p=4, **LAYER) == full / 4
    rows = {r["scheme"]: r for r in sp_vs_tp(4, 4096, 5120, 4, num_heads=40)}
    assert rows["tensor_parallel"]["bytes_per_rank"] == 2 * rows["allgather_kv"]["bytes_per_rank"]
    assert rows["tensor_parallel"]["weights_per_rank"] * 4 == rows["ring"]["weights_per_rank"]
    assert all(r["memory_per_rank"] == r["weights_per_rank"] + r["activations_per_rank"] for r in rows.values())


def test_staged_vs_direct_explains_course_project():
    one = {r["path"]: r for r in staged_vs_direct(4, 4096, 5120, 1, compute_time_1=0.236)}
    assert one["staged"]["speedup"] == one["direct"]["speedup"] == 1.0
    four = {r["path"]: r for r in staged_vs_direct(4, 4096, 5120, 4, compute_time_1=0.236)}
    assert four["direct"]["speedup"] > 3.8 and four["staged"]["speedup"] < 1.0  # course project: 0.94x
    m = 4 * 1024 * 5120 * 4  # one rank's shard of K
    assert four["staged"]["pcie_copies_s"] == pytest.approx(2 * (m + 4 * m) / 12e9)
    assert four["direct"]["wire_s"] == pytest.approx(2 * (3 * 20e-6 + 3 * m / 300e9))
