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
