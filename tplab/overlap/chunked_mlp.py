"""Chunked pipelining of the row-parallel GEMM and its all-reduce (MLP, any row-parallel linear).

Without overlap a TP MLP computes, then communicates; the GPU (or core) idles while the all-reduce runs:

    compute  [============ GEMMs ============]
    comm                                      [======= all-reduce =======]

Split the tokens into k chunks. Every token's output depends only on its own row, so chunk i's partial
sums can be all-reduced while chunk i+1 is computed:

    compute  [chunk 0][chunk 1][chunk 2][chunk 3]
    comm              [ar 0]   [ar 1]   [ar 2]   [ar 3]          only the last all-reduce is exposed

With k too small nothing is hidden (k = 1 is the layer without overlap); with k too large each chunk's
all-reduce pays its latency (2(p-1) α for a ring) on a smaller message, and small GEMMs run less
efficiently: the sweep in metrics.py finds the best k.

Sequence parallelism (``mlp.sequence_parallel``): the input is this rank's slice of the sequence; it is
all-gathered before the MLP and the output reduce-scattered after it. Chunked, the all-gather of chunk
i+1 runs while chunk i is computed, and the reduce-scatter of chunk i while chunk i+1 is:

    compute           [chunk 0][chunk 1][chunk 2]
    comm     [ag 0][ag 1]  [rs 0][ag 2]  [rs 1]  [rs 2]

(chunk j of every rank's slice is gathered together; the MLP works token by token, so which tokens share
a chunk does not matter, and the reduce-scatter gives each rank back its own rows.)

The results equal the non-overlapped layer's to rounding, not bit for bit: chunk i's all-reduce cuts its
*chunk* into p ring blocks, not the whole tensor, so an element can land in a different block, which
meets the ranks' contributions in a different order, and floating-point sums depend on the order.
"""

from __future__ import annotations

import torch
from torch import nn

from tplab.layers import mappings
from tplab.layers.mappings import (
    copy_to_tensor_parallel_region,
    reduce_scatter,
    all_gather,
    scatter_to_tensor_parallel_region,
)
from tplab.overlap import trace
from tplab.overlap.nonblocking import iallgather, iallreduce, ireduce_scatter
from tplab.overlap.pipeline import arrived, chunk_bounds, count, identity


def overlapped_reduce(rows, comm, algorithm, chunks, compute, name="chunk"):
    """Compute ``compute(rows[a:b])`` chunk by chunk, all-reducing each result while the next is computed.
    rows: (n, ...) -> (n, out), the all-reduced partial products in row order."""
    handles, partials = [], []
    for i, (a, b) in enumerate(chunk_bounds(rows.shape[0], chunks)):
        with trace.span(f"{name} {i}"):
            partial = compute(rows[a:b])  # (b - a, out): this rank's share of the sum
        count("allreduce")
        handles.append(iallreduce(partial.detach(), comm, algorithm=algorithm, check=mappings.check_arguments))
        partials.append(partial)
    return torch.cat([arrived(part, h.wait(), identity) for part, h in zip(partials, handles)])


class OverlappedRowParallelLinear(nn.Module):
    """A RowParallelLinear whose GEMM and all-reduce are pipelined over ``chunks`` chunks of tokens."""

    def __init__(self, row, chunks: int = 4):
        super().__init__()
        self.row, self.chunks = row, chunks

    @property
    def comm(self):
        return self.row.comm

    def forward(self, x):  # (..., in/p) if input_is_parallel, else (..., in) replicated
        row = self.row
        if not row.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, row.comm, row.algorithm)  # (..., in/p)
        rows = x.reshape(-1, x.shape[-1])  # (tokens, in/p)
        y = overlapped_reduce(rows, row.comm, row.algorithm, self.chunks, row.local, "row-parallel GEMM")
        y = y.reshape(*x.shape[:-1], row.out_features)
        return y + row.bias if row.bias is not None else y


class OverlappedMLP(nn.Module):
    """A ParallelMLP (tensor- or sequence-parallel) with its communication pipelined over ``chunks``."""

    def __init__(self, mlp, chunks: int = 4):
        super().__init__()
        self.mlp, self.chunks = mlp, chunks

    @property
    def comm(self):
        return self.mlp.comm

    def partial(self, x):
        """This rank's share of the MLP output for tokens x (..., h): no communication."""
        return self.mlp.down.local(self.mlp.hidden(x))

    def forward(self, x):
        y = self._sequence_parallel(x) if self.mlp.sequence_parallel else self._tensor_parallel(x)
        return y + self.mlp.down.bias if self.mlp.down.bias is not None else y

    def _tensor_parallel(self, x):  # x: (..., h), the same on every rank
        mlp = self.mlp
        x = copy_to_tensor_parallel_region(x, mlp.comm, mlp.algorithm)  # f (backward: all-reduce of dX)
        rows = x.reshape(-1, x.shape[-1])  # (tokens, h)
        return overlapped_reduce(rows, mlp.comm, mlp.algorithm, self.chunks, self.partial, "MLP").reshape(x.shape)

    def _sequence_parallel(self, x):  # x: (s/p, b, h), my slice of the sequence
        comm, algorithm = self.mlp.comm, self.mlp.algorithm
        check = mappings.check_arguments
        pieces = [x[a:b] for a, b in chunk_bounds(x.shape[0], self.chunks)]  # (n_j, b, h) each

        def gather(j):
            count("allgather")
            return iallgather(pieces[j].detach().contiguous(), comm, algorithm=algorithm, check=check)

        def regather(grad):  # conjugate of the reduce-scatter: all-gather along the sequence
            return all_gather(grad, comm, dim=0, algorithm=algorithm)

        def rescatter(grad):  # conjugate of the all-gather: reduce-scatter along the sequence
            return reduce_scatter(grad, comm, dim=0, algorithm=algorithm)

        gathers, scatters, partials = [gather(0)], [], []
        for j, piece in enumerate(pieces):
            if j + 1 < len(pieces):
                gathers.append(gather(j + 1))  # prefetch: runs while chunk j is computed
            whole = gathers[j].wait().reshape(comm.size * piece.shape[0], *piece.shape[1:])  # (p·n_j, b, h)
            whole = arrived(piece, whole, rescatter)
            with trace.span(f"MLP chunk {j}"):
                partial = self.partial(whole)  # (p·n_j, b, h): my share of every rank's chunk j
            count("reduce_scatter")
            scatters.append(ireduce_scatter(partial.detach(), comm, algorithm=algorithm, check=check))
            partials.append(partial)
        mine = [arrived(part, h.wait().reshape(piece.shape), regather)
                for part, h, piece in zip(partials, scatters, pieces)]
        return torch.cat(mine)  # (s/p, b, h)
