"""Notebook 09's exercises: the dispatch permutation of a mixture-of-experts layer, and a pairwise all-to-all.

    report = check_dispatch_order(my_dispatch_order)                 # in the notebook (no communication)
    report = cluster.run(check_alltoall, my_alltoall)[0]             # on every rank: values, bytes, deadlocks
    print(format_report(report))

Dispatch: ``fn(experts, num_experts) -> (order, counts)``, with ``experts`` the router's (n, k) choice (int64
tensor); ``order`` lists the n·k assignments (indices into ``experts.reshape(-1)``) grouped by expert, 0 first,
each expert's assignments in token order; ``counts[e]`` how many went to expert e.
All-to-all: ``fn(x, comm) -> out`` with ``x`` of shape (p, m), ``x[j]`` meant for rank j; ``out[j]`` must be what
rank j meant for me, bitwise, having sent p-1 messages of one block each (pairwise exchange: my own block
stays home).
"""

from __future__ import annotations

import numpy as np

from tplab.comm import world
from tplab.lab.exercises.runner import Case, run_cases, run_local


def _dispatch_cases():
    import torch

    g = torch.Generator().manual_seed(9)
    cases = [("2 tokens, top-1", torch.tensor([[1], [0]]), 2),
             ("4 tokens, top-2", torch.tensor([[0, 1], [1, 0], [1, 2], [1, 0]]), 3),
             ("the last experts unchosen", torch.tensor([[1, 0], [0, 1]]), 4),
             ("no tokens", torch.zeros((0, 2), dtype=torch.int64), 3)]
    scores = torch.rand(50, 8, generator=g)
    cases.append(("50 tokens, top-2 of 8", torch.topk(scores, 2, dim=-1).indices, 8))
    return cases


def _diagnose_dispatch(result, case, _p):
    import torch

    experts, num_experts = case.args
    flat = experts.reshape(-1)
    want_order = torch.sort(flat, stable=True).indices
    want_counts = torch.bincount(flat, minlength=num_experts)
    if not isinstance(result, tuple) or len(result) != 2:
        return "return a pair (order, counts)"
    order, counts = (torch.as_tensor(r).reshape(-1) for r in result)
    if order.dtype.is_floating_point or order.dtype.is_complex or order.dtype == torch.bool:
        return (f"order holds {order.dtype} values: it must hold integer positions (torch.long) into "
                "experts.reshape(-1) (an empty list becomes a float tensor: give torch.tensor(..., dtype=torch.long))")
    if counts.tolist() != want_counts.tolist():
        return f"counts {counts.tolist()}, expected {want_counts.tolist()} (assignments per expert, all {num_experts})"
    if order.numel() != flat.numel() or sorted(order.tolist()) != list(range(flat.numel())):
        if order.tolist() == sorted(flat.tolist()):
            return ("order holds the experts' ids, sorted; it must hold the positions of the assignments "
                    "(indices into experts.reshape(-1)), grouped by expert")
        return f"order must list each of the {flat.numel()} assignments once (indices into experts.reshape(-1))"
    if not torch.equal(flat[order], flat[want_order]):
        return "order is not grouped by expert (expert 0's assignments first, then expert 1's, ...)"
    if not torch.equal(order, want_order):
        return "grouped by expert, but not in token order inside each expert: sort stably"
    return None


def check_dispatch_order(fn, *, progress=True):
    cases = [Case(name, (experts, e), None, {"tokens": experts.shape[0], "experts": e})
             for name, experts, e in _dispatch_cases()]
    return run_local(fn, cases, _diagnose_dispatch, title="dispatch: ", progress=progress)


def _diagnose_alltoall(result, case, p):
    expected = case.expected
    if result is None:
        return "returned None (return the received blocks)"
    result = np.asarray(result)
    if result.shape != expected.shape or result.dtype != expected.dtype:
        return f"returned {result.shape} {result.dtype}, expected {expected.shape} {expected.dtype}"
    if np.array_equal(result, expected):
        return None
    (x,) = case.args
    if np.array_equal(result, x):
        return "your result equals your input: nothing was exchanged"
    wrong = [j for j in range(p) if not np.array_equal(result[j], expected[j])]
    return f"blocks {wrong} are wrong: out[j] must be the block rank j meant for me (its x[my rank])"


def check_alltoall(fn, comm=None, *, timeout: float = 5.0, progress=True, stop_at_first_failure=False):
    """Run ``fn(x, comm)`` on every rank: values bitwise, p-1 messages of one block each, no deadlock."""
    base = comm or world()
    p, rank = base.size, base.rank
    built = []
    for name, m, dtype in [("empty blocks", 0, "int64"), ("one element each", 1, "int64"), ("odd blocks", 7, "float64"),
                           ("large blocks (2^15)", 1 << 15, "float64")]:
        blocks_of = lambda r: (np.arange(p * m) + 10**6 * r).astype(dtype).reshape(p, m)  # rank r's input
        x = blocks_of(rank)
        expected = np.stack([blocks_of(j)[rank] for j in range(p)]) if p else x  # rank j's block for me
        wire = {"bytes": (p - 1) * m * x.itemsize, "messages": p - 1 if m else None,  # (empty: optional)
                "hint": "Pairwise exchange: step k = 1 .. p-1 sends x[r+k] to rank r+k and receives from rank r-k."}
        built.append(Case(name, (x,), expected, {"block": m, "dtype": dtype}, wire))
    return run_cases(fn, built, _diagnose_alltoall, comm=base, timeout=timeout, title="alltoall: ",
                     progress=progress, stop_at_first_failure=stop_at_first_failure)
