"""All-gather along the sequence, with its backward, and the course project's CPU-staged way of doing it.

    gather_sequence(x, comm, dim)     every rank's x concatenated along ``dim`` (rank 0's tokens first)
                                      backward: reduce-scatter of the gradient along ``dim``

The backward is a reduce-scatter because every rank's queries used every rank's keys: the gradient
with respect to my K shard is the sum, over all ranks, of what their attention sent back to my tokens.

How the bytes travel is a function ``gather(x, comm) -> (p·m, ...)`` taking blocks along the first
dimension; ``gather_sequence`` moves ``dim`` to the front, calls it, and moves it back:

    allgather_first_dim      tplab.allgather (the hand-written ring by default) on whatever Communicator
                             is given; the tensor passes through as it is (CPU today, GPU tensors on a
                             GPU transport such as tplab.comm.nccl)
    staged_allgather_first_dim   the course project's path for a GPU without CUDA-aware MPI:
                             device -> host (tensor.cpu()) -> tplab.allgather over host MPI -> device
    exchange_allgather_first_dim   through a shard exchange (tplab.comm.shard_exchange): on the GPUs of one
                             node ``CopyEngineExchange``, whose copy engines pull every peer's block over
                             NVLink without any SM, so that with ``head_groups`` the gathers run next to the
                             attention without taking its multiprocessors
    anything else            e.g. the vendor's all-gather (scripts/gpu_sequence_parallel.py passes
                             torch.distributed's NCCL all_gather_into_tensor)
"""

from __future__ import annotations

from functools import partial

import torch

import tplab


def allgather_first_dim(x: torch.Tensor, comm, algorithm: str = "ring", check: bool = True) -> torch.Tensor:
    """(m, ...) on each rank -> (p·m, ...), rank 0's block first, through tplab's own all-gather.
    bfloat16 travels as its int16 bits (a view, no copy): an all-gather moves bits, it never adds them."""
    bits = x.contiguous()
    bits = bits.view(torch.int16) if bits.dtype == torch.bfloat16 else bits
    flat = tplab.allgather(bits, comm, algorithm=algorithm, check=check)
    gathered = flat.reshape(comm.size * x.shape[0], *x.shape[1:])
    return gathered.view(torch.bfloat16) if x.dtype == torch.bfloat16 else gathered


def exchange_allgather_first_dim(x: torch.Tensor, comm, exchange) -> torch.Tensor:
    """(m, ...) on each rank -> (p·m, ...) through ``exchange`` (a shard exchange): every rank's block
    lands in place in one tensor; on a GPU the caller's stream waits for the copies, the host does not.
    Pass it as ``gather=functools.partial(exchange_allgather_first_dim, exchange=...)``. With a
    CopyEngineExchange every call must come from one stream: the side stream (head_groups > 1, or
    side_stream=True) or the compute stream, not both."""
    out = torch.empty((comm.size, *x.shape), dtype=x.dtype, device=x.device)
    exchange.start_gather(x, out=out).done()
    return out.view(comm.size * x.shape[0], *x.shape[1:])


def to_host(x: torch.Tensor) -> torch.Tensor:
    """The one conversion the CPU transport needs: a host copy of x, bf16 seen as int16 (numpy, under
    MPI, has no bfloat16; an all-gather only moves bytes, so the bits come through unchanged)."""
    host = x.detach().to("cpu")
    return host.view(torch.int16) if host.dtype == torch.bfloat16 else host


def from_host(host: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return (host.view(like.dtype) if like.dtype == torch.bfloat16 else host).to(like.device)


def staged_allgather_first_dim(x, comm, algorithm: str = "ring", check: bool = True) -> torch.Tensor:
    """The course project's CPU staging: GPU -> host -> MPI all-gather on host memory -> GPU (two PCIe copies)."""
    gathered = allgather_first_dim(to_host(x), comm, algorithm=algorithm, check=check)
    return from_host(gathered, like=x)


def _reduce_scatter_first_dim(grad: torch.Tensor, comm, algorithm: str) -> torch.Tensor:
    """(p·m, ...) on each rank -> the sum over ranks of block ``rank``: (m, ...)."""
    if algorithm not in tplab.ALGORITHMS["reduce_scatter"]:
        algorithm = "ring"
    mine = tplab.reduce_scatter(grad.contiguous(), comm, algorithm=algorithm)
    return mine.reshape(grad.shape[0] // comm.size, *grad.shape[1:])


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim, gather, algorithm):
        ctx.comm, ctx.dim, ctx.algorithm = comm, dim, algorithm
        gathered = gather(x.detach().movedim(dim, 0).contiguous(), comm)  # (p·m, ...)
        return gathered.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        moved = grad.movedim(ctx.dim, 0).contiguous()
        return _reduce_scatter_first_dim(moved, ctx.comm, ctx.algorithm).movedim(0, ctx.dim), None, None, None, None


def gather_sequence(x: torch.Tensor, comm, dim: int, *, algorithm: str = "ring", gather=None,
                    check: bool = True) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order; differentiable (reduce-scatter back).
    ``gather``: how to move the bytes (default: tplab's all-gather with ``algorithm``)."""
    if comm.size == 1:
        return x
    if gather is None:
        gather = partial(allgather_first_dim, algorithm=algorithm, check=check)
    return _GatherSequence.apply(x, comm, dim % x.dim(), gather, algorithm)
