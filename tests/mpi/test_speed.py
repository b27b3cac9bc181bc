"""The speed harness runs under every rank count: rows identical on every rank, one per TP degree that
splits, times positive. (What the times are is for benchmarks, not tests.)"""

import pytest
from mpitest import COMM, agree, same_on_every_rank

torch = pytest.importorskip("torch")

from tplab.comm import world  # noqa: E402
from tplab.models import GPTConfig  # noqa: E402
from tplab.models.speed import forward_time_vs_tp, tp_degrees  # noqa: E402

P = COMM.size
C = world(timeout=10)


def test_forward_time_and_tokens_per_second_for_every_degree():
    config = GPTConfig(vocab_size=16, block_size=16, n_layer=1, n_head=4, n_kv_head=2, n_embd=16, ffn_size=24,
                       mlp="swiglu", norm="rmsnorm", position="rope", bias=False)
    degrees = tp_degrees(config, P)
    agree(degrees == [t for t in (1, 2, 4) if P % t == 0], f"degrees {degrees} for p={P}")  # 4 heads, 2 KV heads
    rows = forward_time_vs_tp(config, C, batch=1, seq=4, iters=2, warmup=1, new_tokens=2)
    agree([r["tp"] for r in rows] == degrees, str(rows))
    agree(all(r["forward_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows), str(rows))
    agree(same_on_every_rank(rows), "ranks returned different rows")
