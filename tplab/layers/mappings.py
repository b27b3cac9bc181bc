"""The communication of tensor parallelism as autograd functions (after Megatron-LM's mappings.py).

Each op is a pair: what it does in the forward pass, and its conjugate in the backward pass.

    function                                 forward                      backward
    copy_to_tensor_parallel_region     (f)   identity                     all-reduce
    reduce_from_tensor_parallel_region (g)   all-reduce                   identity
    scatter_to_tensor_parallel_region        keep my slice, last dim      all-gather, last dim
    gather_from_tensor_parallel_region       all-gather, last dim         keep my slice, last dim
    scatter_to_sequence_parallel_region      keep my slice, first dim     all-gather, first dim
    gather_from_sequence_parallel_region     all-gather, first dim        reduce-scatter, first dim
    reduce_scatter_to_sequence_parallel_region  reduce-scatter, first dim all-gather, first dim

f sits before a column-parallel layer (its input is replicated; the gradient with respect to it is a sum
over ranks), g after a row-parallel layer (the partial outputs are summed). Sequence parallelism replaces
g by a reduce-scatter along the sequence (first dim) and f by an all-gather.

The collectives are tplab's (``tplab.allreduce`` & co.; ``algorithm`` picks which one, "auto" by default) on
any tplab Communicator: MPI for CPU tensors, NCCL or peer memory for GPU tensors, torch.distributed or the
null communicator (which run their own collectives whatever the name). Slices along a dimension must
divide evenly: a clear error otherwise.
``check_arguments = False`` skips the collectives' cross-rank argument checks (for timing); so does the block
``with argument_checks_off():``, which restores the setting after it.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch

import tplab

# Collectives the layers ran in this process, by kind ("allreduce", "allgather", "reduce_scatter"):
# a TP transformer layer's forward pass should add exactly 2 all-reduces. ``calls.clear()`` resets.
calls: Counter = Counter()
check_arguments = True  # tplab's agreement round before each collective (off while timing)


@contextmanager
def argument_checks_off():
    """No agreement round before the layers' collectives inside the block (they are not TP's cost while
    timing); the setting before it comes back afterwards, also after an error."""
    global check_arguments
    was_checking, check_arguments = check_arguments, False
    try:
        yield
    finally:
        check_arguments = was_checking


def _check_divisible(size: int, parts: int, what: str) -> None:
    if size % parts:
        raise ValueError(f"{what} of size {size} cannot be split evenly over {parts} ranks")


def all_reduce(x: torch.Tensor, comm, algorithm="auto") -> torch.Tensor:
    calls["allreduce"] += 1
    return tplab.allreduce(x.detach().contiguous(), comm, algorithm=algorithm, check=check_arguments)


def all_gather(x: torch.Tensor, comm, dim: int, algorithm="auto") -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (all ranks hold the same shape)."""
    calls["allgather"] += 1
    moved = x.detach().movedim(dim, 0).contiguous()
    flat = tplab.allgather(moved, comm, algorithm=algorithm, check=check_arguments)  # rank 0's block, ...
    gathered = flat.reshape(comm.size * moved.shape[0], *moved.shape[1:])
    return gathered.movedim(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, comm, dim: int, algorithm="auto") -> torch.Tensor:
    """Sum over ranks, keep this rank's slice along ``dim``."""
    _check_divisible(x.shape[dim], comm.size, f"dimension {dim}")
    calls["reduce_scatter"] += 1
    moved = x.detach().movedim(dim, 0).contiguous()
    mine = tplab.reduce_scatter(moved, comm, algorithm=algorithm, check=check_arguments)  # equal blocks
    return mine.reshape(moved.shape[0] // comm.size, *moved.shape[1:]).movedim(0, dim).contiguous()


def my_slice(x: torch.Tensor, comm, dim: int) -> torch.Tensor:
    _check_divisible(x.shape[dim], comm.size, f"dimension {dim}")
    return x.chunk(comm.size, dim=dim)[comm.rank].contiguous()


# ---- the pairs: each op is (what the forward pass does, what the backward pass does) ----------------------
def identity(x, comm, algorithm):
    return x.view_as(x)


def keep_my_slice_of_last_dim(x, comm, algorithm):
    return my_slice(x, comm, dim=-1)


def keep_my_slice_of_first_dim(x, comm, algorithm):
    return my_slice(x, comm, dim=0)


def all_gather_last_dim(x, comm, algorithm):
    return all_gather(x, comm, dim=-1, algorithm=algorithm)


def all_gather_first_dim(x, comm, algorithm):
    return all_gather(x, comm, dim=0, algorithm=algorithm)


def reduce_scatter_first_dim(x, comm, algorithm):
    return reduce_scatter(x, comm, dim=0, algorithm=algorithm)


def conjugate_pair(name: str, forward, backward):
    """An autograd op that runs ``forward`` on the input and ``backward`` on the incoming gradient."""

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, comm, algorithm):
            ctx.comm, ctx.algorithm = comm, algorithm
            return forward(x, comm, algorithm)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad, ctx.comm, ctx.algorithm), None, None

    def apply(x, comm, algorithm="auto"):
        return Op.apply(x, comm, algorithm)

    Op.__name__ = apply.__name__ = apply.__qualname__ = name
    apply.__doc__ = f"forward: {forward.__name__}; backward: {backward.__name__}"
    return apply


copy_to_tensor_parallel_region = conjugate_pair("copy_to_tensor_parallel_region", identity, all_reduce)
reduce_from_tensor_parallel_region = conjugate_pair("reduce_from_tensor_parallel_region", all_reduce, identity)
scatter_to_tensor_parallel_region = conjugate_pair(
    "scatter_to_tensor_parallel_region", keep_my_slice_of_last_dim, all_gather_last_dim)
gather_from_tensor_parallel_region = conjugate_pair(
    "gather_from_tensor_parallel_region", all_gather_last_dim, keep_my_slice_of_last_dim)
scatter_to_sequence_parallel_region = conjugate_pair(
    "scatter_to_sequence_parallel_region", keep_my_slice_of_first_dim, all_gather_first_dim)
gather_from_sequence_parallel_region = conjugate_pair(
    "gather_from_sequence_parallel_region", all_gather_first_dim, reduce_scatter_first_dim)
reduce_scatter_to_sequence_parallel_region = conjugate_pair(
    "reduce_scatter_to_sequence_parallel_region", reduce_scatter_first_dim, all_gather_first_dim)
