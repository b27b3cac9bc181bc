"""All-to-all with variable counts (MPI_Alltoallv): rank i sends ``send_counts[j]`` rows to rank j.

Mixture-of-experts layers need it twice per layer: *dispatch* sends each token to the ranks that hold its
experts (how many go where depends on the router, so the counts differ per pair of ranks) and *combine*
sends the results back with the counts swapped. The input is the rows for rank 0, then for rank 1, ...;
the output is the rows from rank 0, then from rank 1, ...:

    x   = [ rows for 0 | rows for 1 | ... ]        send_counts[j] rows for rank j
    out = [ rows from 0 | rows from 1 | ... ]      recv_counts[j] rows from rank j

Pairwise exchange as in alltoall.py: in step k = 1 .. p-1 rank r sends to r+k and receives from r-k.
An empty block is not sent at all (both sides know its count), so a rank sends one message per non-empty
block for another rank: with few tokens and many ranks most pairs have nothing to say. The sends and
receives of a step are nonblocking, so a step where only one side has rows cannot deadlock.

Rows may have any trailing shape (a token's hidden vector); the ranks must agree on it and on the dtype,
and rank i's send_counts[j] must equal rank j's recv_counts[i]: otherwise the same clear error on every rank
(``check=True``, one ``allgather_object``). ``recv_counts=None`` takes them from that same round.
"""

from __future__ import annotations

import numpy as np

from tplab.collectives.checks import CollectiveArgumentError
from tplab.toolkit.arrays import array_module, is_torch
from tplab.toolkit.blocks import offsets


def _empty_rows(x, rows: int):
    if is_torch(x):
        import torch

        return torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return array_module(x).empty((rows, *x.shape[1:]), dtype=x.dtype)  # numpy, or CuPy on x's GPU


def _counts(counts, p, what) -> tuple[list[int] | None, str | None]:
    try:
        counts = [int(c) for c in counts]
    except (TypeError, ValueError):
        return None, f"{what} must be a sequence of {p} integers, got {counts!r}"
    if len(counts) != p or any(c < 0 for c in counts):
        return None, f"{what} must be {p} non-negative integers (one per rank), got {counts}"
    return counts, None


def _agree(x, send_counts, recv_counts, comm) -> list[int]:
    """Check every rank's arguments against every other's; return this rank's receive counts."""
    p = comm.size
    problems = []
    sends, problem = _counts(send_counts, p, "send_counts")
    problems += [problem] if problem else []
    recvs = None
    if recv_counts is not None:
        recvs, problem = _counts(recv_counts, p, "recv_counts")
        problems += [problem] if problem else []
    if len(x.shape) == 0:
        problems.append("x must have a first dimension (rows)")
    elif sends is not None and sum(sends) != x.shape[0]:
        problems.append(f"send_counts add up to {sum(sends)} rows but x has {x.shape[0]}")
    mine = (sends, recvs, tuple(x.shape[1:]), str(x.dtype), problems)
    everyone = comm.allgather_object(mine)
    messages = [f"rank {i}: {m}" for i, (*_, probs) in enumerate(everyone) for m in probs]
    if not messages:
        rows = {(shape, dtype) for _, _, shape, dtype, _ in everyone}
        if len(rows) > 1:
            listed = ", ".join(f"rank {i} {shape} {dtype}" for i, (_, _, shape, dtype, _) in enumerate(everyone))
            messages.append(f"ranks disagree on the rows' trailing shape and dtype: {listed}")
        for i, (_, theirs, _, _, _) in enumerate(everyone):
            if theirs is None:
                continue
            wrong = [(j, everyone[j][0][i], theirs[j]) for j in range(p) if everyone[j][0][i] != theirs[j]]
            messages += [f"rank {j} sends {s} rows to rank {i}, which expects {e}" for j, s, e in wrong]
    if messages:
        raise CollectiveArgumentError("alltoallv: " + "; ".join(messages))
    return [everyone[j][0][comm.rank] for j in range(p)]


def alltoallv(x, send_counts, comm, recv_counts=None, *, check: bool = True):
    """Rows of x for every rank (send_counts[j] for rank j, in rank order) -> rows from every rank
    (recv_counts[j] from rank j, in rank order). numpy arrays or torch tensors; the output is of x's kind."""
    p, r = comm.size, comm.rank
    if check or recv_counts is None:
        if check:
            recv_counts = _agree(x, send_counts, recv_counts, comm)
        else:  # only the counts, no checks (benchmarks that cannot know them in advance)
            everyone = comm.allgather_object([int(c) for c in send_counts])
            recv_counts = [everyone[j][r] for j in range(p)]
    send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    x = x.contiguous() if is_torch(x) else array_module(x).ascontiguousarray(x)
    out = _empty_rows(x, sum(recv_counts))
    row = int(np.prod(x.shape[1:], dtype=np.int64))  # elements per row: messages are 1-D slices of the flat
    so, ro = [row * o for o in offsets(send_counts)], [row * o for o in offsets(recv_counts)]
    flat_x, flat_out = x.reshape(-1), out.reshape(-1)
    flat_out[ro[r]:ro[r + 1]] = flat_x[so[r]:so[r + 1]]  # my rows for myself: a local copy, not a message
    for step in range(1, p):
        to, frm = (r + step) % p, (r - step) % p
        pending = []
        if recv_counts[frm]:
            pending.append(comm.irecv(flat_out[ro[frm]:ro[frm + 1]], frm, tag=step))
        if send_counts[to]:
            pending.append(comm.isend(flat_x[so[to]:so[to + 1]], to, tag=step))
        comm.waitall(pending)
    return out
