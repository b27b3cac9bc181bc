"""Tensor-parallel layers equal the unsplit computation (float64, ~1e-12), forward and backward."""

import pytest
from mpitest import COMM, agree

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from tplab.comm import world  # noqa: E402
from tplab.layers import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

P = COMM.size
C = world(timeout=10)
TOL = dict(rtol=1e-12, atol=1e-12)


def close(a, b) -> bool:
    return torch.allclose(a, b, **TOL)


def replicated(*shape, seed=0):
    """The same random tensor on every rank (float64)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("algorithm", ["auto", "ring", "recursive_doubling"])
def test_mlp_column_then_row_equals_unsplit(algorithm):
    h, ffn, tokens = 8, 4 * P * 3, 5
    torch.manual_seed(1)
    full_up, full_down = nn.Linear(h, ffn, dtype=torch.float64), nn.Linear(ffn, h, dtype=torch.float64)
    up = ColumnParallelLinear.from_linear(full_up, C, algorithm=algorithm)
    down = RowParallelLinear.from_linear(full_down, C, algorithm=algorithm)

    x_full = replicated(tokens, h, seed=2).requires_grad_()
    x = x_full.detach().clone().requires_grad_()
    y_full = full_down(torch.nn.functional.gelu(full_up(x_full)))
    y = down(torch.nn.functional.gelu(up(x)))
    agree(close(y, y_full), f"forward differs by {(y - y_full).abs().max()}")

    y_full.square().sum().backward()
    y.square().sum().backward()
    agree(close(x.grad, x_full.grad), "dX differs")  # f's backward all-reduce
    up_rows = full_up.weight.grad.chunk(P, dim=0)[COMM.rank]
    down_cols = full_down.weight.grad.chunk(P, dim=1)[COMM.rank]
    agree(close(up.weight.grad, up_rows) and close(up.bias.grad, full_up.bias.grad.chunk(P)[COMM.rank]),
          "column-parallel weight/bias gradients are not the matching slices")
    agree(close(down.weight.grad, down_cols) and close(down.bias.grad, full_down.bias.grad),
          "row-parallel weight/bias gradients are not the matching slices")


def test_column_parallel_gather_output_and_row_parallel_unsplit_input():
    torch.manual_seed(3)
    full = nn.Linear(6, 2 * P, dtype=torch.float64)
    x = replicated(3, 6, seed=4)
    agree(close(ColumnParallelLinear.from_linear(full, C, gather_output=True)(x), full(x)), "gather_output")
    full_row = nn.Linear(2 * P, 5, dtype=torch.float64)
    z = replicated(3, 2 * P, seed=5)
    agree(close(RowParallelLinear.from_linear(full_row, C, input_is_parallel=False)(z), full_row(z)),
          "input_is_parallel=False")


def test_sequence_parallel_pair_round_trips():
    """scatter -> gather is the identity; reduce-scatter -> gather equals an all-reduce; gradients flow."""
    x = replicated(2 * P, 3, seed=6).requires_grad_()
    part = scatter_to_sequence_parallel_region(x, C)
    back = gather_from_sequence_parallel_region(part, C)
    agree(close(back, x), "scatter/gather along the sequence is not the identity")
    mine = replicated(2 * P, 3, seed=7 + COMM.rank)
    summed = sum(replicated(2 * P, 3, seed=7 + r) for r in range(P))
    rs = reduce_scatter_to_sequence_parallel_region(mine, C)
    agree(close(gather_from_sequence_parallel_region(rs, C), summed), "reduce-scatter then all-gather != sum")
    back.sum().backward()
    agree(close(x.grad, torch.full_like(x, float(P))), f"gradient through scatter/gather: {x.grad.flatten()[:4]}")


@pytest.mark.skipif(P < 2, reason="any size divides by one rank")
def test_indivisible_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
        ColumnParallelLinear(4, 2 * P + 1, C)
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
        RowParallelLinear(2 * P + 1, 4, C)
    with pytest.raises(ValueError, match="cannot be split evenly"):
        scatter_to_sequence_parallel_region(replicated(2 * P + 1, 2), C)
    agree(True)


# ---- MLP and attention ----------------------------------------------------------------------------------
from tplab.layers.attention import ParallelAttention, heads_per_rank  # noqa: E402
from tplab.layers.mlp import ParallelMLP  # noqa: E402


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_parallel_mlp_equals_unsplit(activation, sequence_parallel):
    h, ffn, s, b = 6, 4 * P, 2 * P, 3
    torch.manual_seed(10)
    up, down = nn.Linear(h, ffn, dtype=torch.float64), nn.Linear(ffn, h, dtype=torch.float64)
    gate = nn.Linear(h, ffn, dtype=torch.float64) if activation == "swiglu" else None
    mlp = ParallelMLP.from_dense(up, down, C, gate=gate, activation=activation, sequence_parallel=sequence_parallel)

    x_full = replicated(s, b, h, seed=11).requires_grad_()  # (seq, batch, hidden)
    hidden = nn.functional.gelu(up(x_full)) if gate is None else nn.functional.silu(gate(x_full)) * up(x_full)
    y_full = down(hidden)
    if sequence_parallel:  # each rank holds its slice of the sequence, in and out
        x = x_full.detach().chunk(P, dim=0)[COMM.rank].clone().requires_grad_()
        expected = y_full.chunk(P, dim=0)[COMM.rank]
    else:
        x = x_full.detach().clone().requires_grad_()
        expected = y_full
    y = mlp(x)
    agree(close(y, expected), f"forward differs by {(y - expected).abs().max()}")
    y_full.square().sum().backward()
    y.square().sum().backward()  # under SP each rank's loss is its slice's: they add up to the full loss
    want_dx = x_full.grad.chunk(P, dim=0)[COMM.rank] if sequence_parallel else x_full.grad
    agree(close(x.grad, want_dx), "dX differs")
    agree(close(mlp.up.weight.grad, up.weight.grad.chunk(P, dim=0)[COMM.rank]),
          "up-projection gradient is not the matching slice")
    agree(close(mlp.down.weight.grad, down.weight.grad.chunk(P, dim=1)[COMM.rank]),
          "down-projection gradient is not the matching slice")


def reference_attention(x, q, k, v, o, n, kv):
    b, s, h = x.shape
    d = h // n
    Q = q(x).view(b, s, n, d).transpose(1, 2)
    K = k(x).view(b, s, kv, d).transpose(1, 2).repeat_interleave(n // kv, dim=1)
    V = v(x).view(b, s, kv, d).transpose(1, 2).repeat_interleave(n // kv, dim=1)
    out = nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=True)
    return o(out.transpose(1, 2).reshape(b, s, h))


@pytest.mark.parametrize("local_heads,kv_heads", [(2, "mha"), (4, "half"), (8, "one"), (1, "mha")])
def test_parallel_attention_equals_unsplit(local_heads, kv_heads):
    """MHA; GQA with 2 query heads per KV head; GQA with a single KV head (replicated when p > 1)."""
    n = local_heads * P
    kv = {"mha": n, "half": n // 2, "one": 1}[kv_heads]
    d, b, s = 3, 2, 5
    h = n * d
    torch.manual_seed(20)
    q, o = nn.Linear(h, n * d, dtype=torch.float64), nn.Linear(n * d, h, dtype=torch.float64)
    k, v = nn.Linear(h, kv * d, dtype=torch.float64), nn.Linear(h, kv * d, dtype=torch.float64)
    attention = ParallelAttention.from_dense(q, k, v, o, n, C, num_kv_heads=kv)
    x_full = replicated(b, s, h, seed=21).requires_grad_()
    x = x_full.detach().clone().requires_grad_()
    y_full, y = reference_attention(x_full, q, k, v, o, n, kv), attention(x)
    agree(close(y, y_full), f"forward differs by {(y - y_full).abs().max()} (n={n}, kv={kv})")
    y_full.square().sum().backward()
    y.square().sum().backward()
    agree(close(x.grad, x_full.grad), "dX differs")
    q_rows = slice(COMM.rank * (n // P) * d, (COMM.rank + 1) * (n // P) * d)
    agree(close(attention.q_proj.weight.grad, q.weight.grad[q_rows]), "Wq gradient is not the matching slice")


@pytest.mark.skipif(P < 2, reason="any head count splits over one rank")
def test_heads_that_cannot_be_split():
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
        heads_per_rank(2 * P + 1, 2 * P + 1, P)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        heads_per_rank(4 * P, 4 * P - 1, P)
    with pytest.raises(ValueError, match="is not divisible by num_heads"):
        ParallelAttention(4 * P + 1, 4 * P, C)
    agree(True)


def test_a_tensor_parallel_block_runs_two_allreduces_forward():
    from tplab.layers import mappings

    n, d, h = 2 * P, 2, 4 * P
    torch.manual_seed(30)
    lin = lambda i, o: nn.Linear(i, o, dtype=torch.float64)  # noqa: E731
    attention = ParallelAttention.from_dense(lin(h, n * d), lin(h, n * d), lin(h, n * d), lin(n * d, h), n, C)
    mlp = ParallelMLP.from_dense(lin(h, 4 * h), lin(4 * h, h), C)
    x = replicated(1, 3, h, seed=31)
    mappings.calls.clear()
    with torch.no_grad():
        mlp(x + attention(x))
    agree(dict(mappings.calls) == {"allreduce": 2}, f"counted {dict(mappings.calls)}")
    sp = ParallelMLP.from_dense(lin(h, 4 * h), lin(4 * h, h), C, sequence_parallel=True)
    mappings.calls.clear()
    with torch.no_grad():
        sp(replicated(P, 2, h, seed=32))
    agree(dict(mappings.calls) == {"allgather": 1, "reduce_scatter": 1}, f"counted {dict(mappings.calls)}")


def test_vocabulary_parallel_embedding_and_lm_head():
    from tplab.layers.embedding import ParallelLMHead, VocabParallelEmbedding

    vocab, h = 5 * P, 4
    torch.manual_seed(40)
    table = nn.Embedding(vocab, h, dtype=torch.float64)
    head = nn.Linear(h, vocab, bias=False, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(41))
    embed = VocabParallelEmbedding.from_embedding(table, C)
    lm_head = ParallelLMHead.from_linear(head, C, gather_output=True)
    x = embed(tokens)
    agree(close(x, table(tokens)), "embedding lookup differs")
    agree(close(lm_head(x), head(table(tokens))), "logits differ")
    full = replicated(2, 7, h, seed=42).requires_grad_()
    mine = full.detach().clone().requires_grad_()
    head(full).logsumexp(-1).sum().backward()
    lm_head(mine).logsumexp(-1).sum().backward()
    agree(close(mine.grad, full.grad) and close(lm_head.weight.grad, head.weight.grad.chunk(P, dim=0)[COMM.rank]),
          "LM head gradients differ")


# ---- rotary positions and sequence-parallel attention ---------------------------------------------------
from tplab.layers.rotary import RotaryEmbedding  # noqa: E402


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("kv_heads", ["mha", "one"])
def test_rotary_attention_tensor_and_sequence_parallel_equals_unsplit(sequence_parallel, kv_heads):
    n, d, b, s = 2 * P, 4, 2, 2 * P
    kv = n if kv_heads == "mha" else 1
    h = n * d
    torch.manual_seed(50)
    q, o = nn.Linear(h, n * d, dtype=torch.float64), nn.Linear(n * d, h, dtype=torch.float64)
    k, v = nn.Linear(h, kv * d, dtype=torch.float64), nn.Linear(h, kv * d, dtype=torch.float64)
    rotary = RotaryEmbedding(d, theta=100.0)
    attention = ParallelAttention.from_dense(q, k, v, o, n, C, num_kv_heads=kv, rotary=rotary,
                                             sequence_parallel=sequence_parallel)

    x_full = replicated(b, s, h, seed=51).requires_grad_()
    Q = q(x_full).view(b, s, n, d).transpose(1, 2)  # the unsplit reference, rotary included
    K = k(x_full).view(b, s, kv, d).transpose(1, 2)
    Q, K = rotary(Q, K)
    V = v(x_full).view(b, s, kv, d).transpose(1, 2)
    K, V = K.repeat_interleave(n // kv, dim=1), V.repeat_interleave(n // kv, dim=1)
    y_full = o(nn.functional.scaled_dot_product_attention(Q, K, V, is_causal=True).transpose(1, 2).reshape(b, s, h))

    if sequence_parallel:  # (s/p, b, h): my slice of the sequence, in and out
        x = x_full.detach().transpose(0, 1).chunk(P, dim=0)[COMM.rank].clone().requires_grad_()
        expected = y_full.transpose(0, 1).chunk(P, dim=0)[COMM.rank]
    else:
        x, expected = x_full.detach().clone().requires_grad_(), y_full
    from tplab.layers import mappings

    mappings.calls.clear()
    y = attention(x)
    agree(close(y, expected), f"forward differs by {(y - expected).abs().max()}")
    want = {"allgather": 1, "reduce_scatter": 1} if sequence_parallel else {"allreduce": 1}
    agree(dict(mappings.calls) == want, f"counted {dict(mappings.calls)}")
    y_full.square().sum().backward()
    y.square().sum().backward()
    want_dx = x_full.grad.transpose(0, 1).chunk(P, dim=0)[COMM.rank] if sequence_parallel else x_full.grad
    agree(close(x.grad, want_dx), "dX differs")
    q_rows = slice(COMM.rank * (n // P) * d, (COMM.rank + 1) * (n // P) * d)
    agree(close(attention.q_proj.weight.grad, q.weight.grad[q_rows]), "Wq gradient is not the matching slice")
    agree(close(attention.o_proj.weight.grad, o.weight.grad[:, q_rows]), "Wo gradient is not the matching slice")

