"""Argument agreement: bad input becomes the same clear error on every rank, never a hang.

A collective is a contract between all ranks: if rank 2 passes 1000 float32 while the others pass
1024 float64, a hand-written ring would block forever or return garbage. So before moving any data
every rank publishes a small description of its arguments (one ``allgather_object``, tens of
microseconds) and every rank checks all of them, so they all raise the same ``CollectiveArgumentError``.

Benchmarks switch it off (``check=False``); then only local problems (an unknown algorithm, say) are
caught, on the ranks that have them.
"""

from __future__ import annotations

from tplab.comm.base import CollectiveArgumentError
from tplab.toolkit.ops import OPS

SUPPORTED_KINDS = "iuf"  # signed and unsigned integers, floating point


def local_problems(comm, x, *, algorithm, algorithms, op=None, root=None) -> list[str]:
    problems = []
    if algorithm not in algorithms:
        problems.append(f"unknown algorithm {algorithm!r}; choose one of {list(algorithms)}")
    if op is not None and (not isinstance(op, str) or op not in OPS):
        problems.append(f"unknown op {op!r}; choose one of {sorted(OPS)}")
    if root is not None and (isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < comm.size):
        problems.append(f"root {root!r} is not a rank of this communicator (0..{comm.size - 1})")
    if x.dtype.kind not in SUPPORTED_KINDS:
        problems.append(f"dtype {x.dtype} is not supported (integers and floating point only)")
    refusal = comm.cannot_take(x)
    if refusal:
        problems.append(refusal)
    return problems


def agree_on_arguments(comm, collective, x, *, algorithm, algorithms, op=None, root=None,
                       same_shape=True, check=True, bfloat16=False, problems=()) -> None:
    """``x``: the numpy or CuPy view of the input (tplab.toolkit.arrays.as_array); ``bfloat16``: it holds
    bfloat16 bits as int16 (then the ranks must agree on bfloat16, not int16); ``problems``: found before."""
    problems = list(problems) + local_problems(comm, x, algorithm=algorithm, algorithms=algorithms, op=op, root=root)
    if not check:
        if problems:
            raise CollectiveArgumentError(f"{collective} on rank {comm.rank}: " + "; ".join(problems))
        return
    mine = {
        "collective": collective,
        "shape": tuple(x.shape) if same_shape else None,
        "dtype": "bfloat16" if bfloat16 else x.dtype.name,
        "op": op,
        "algorithm": algorithm,
        "root": root,
        "problems": problems,
    }
    message = comm.agree(mine)
    if message:
        raise CollectiveArgumentError(f"{collective}: {message}")
