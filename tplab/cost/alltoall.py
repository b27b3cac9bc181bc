"""What an all-to-all costs: pairwise exchange against Bruck's algorithm (the two in tplab.collectives).

n = the bytes of one rank's whole input, p blocks of n/p (nccl-tests' size for alltoall_perf). Own block
stays home. On the critical path (every rank does the same, so it is also every rank's traffic):

    pairwise   (p-1) α + (p-1)/p · n β                 p-1 messages of one block
    bruck      ⌈lg p⌉ α + B(p)/p · n β                 B(p) = Σ_k |{i < p : i & k}|, k = 1, 2, 4, ... < p
                                                        (p a power of two: B = p/2 · lg p)

Bruck sends fewer messages and more bytes: it wins below the crossover size

    n* = (p - 1 - ⌈lg p⌉) α  /  ((B(p) - (p-1)) / p · β)

and pairwise wins above it (for p ≤ 3 they send the same). A mixture-of-experts layer does two of these per
layer (dispatch and combine), with variable counts (alltoallv): its bytes are the token rows that really
leave the rank, its messages the non-empty blocks for other ranks (tplab.moe.expert_parallel counts them).
"""

from __future__ import annotations

from tplab.collectives.bruck import moved_blocks, rounds
from tplab.cost.formulas import CriticalPath, check_size, unknown

ALGORITHMS = ("pairwise", "bruck")
FORMULAS = {
    ("alltoall", "pairwise"): "(p-1)α + (p-1)/p·nβ",
    ("alltoall", "bruck"): ("⌈lg p⌉α + B(p)/p·nβ,  B(p) = Σ_k |{i < p : i & k}| "
                            "(= p/2·lg p for p a power of two)"),
}


def bruck_blocks(p: int) -> int:
    """B(p): how many blocks of n/p one rank sends in all of Bruck's rounds."""
    return sum(len(moved_blocks(p, k)) for k in rounds(p))


def alltoall_path(algorithm: str, p: int, n: float) -> CriticalPath:
    """Messages and bytes on the critical path of one all-to-all (nothing is reduced)."""
    check_size(p, n)
    if algorithm == "pairwise":
        return CriticalPath(p - 1, (p - 1) * n / p, 0.0)
    if algorithm == "bruck":
        return CriticalPath(len(rounds(p)), bruck_blocks(p) * n / p, 0.0)
    raise unknown("alltoall", algorithm, set(FORMULAS))


def alltoall_traffic(algorithm: str, p: int, n: float) -> dict:
    """Messages and bytes sent, busiest rank and total over ranks (every rank sends the same)."""
    path = alltoall_path(algorithm, p, n)
    return {"max_messages": path.messages, "max_bytes": float(path.wire_bytes),
            "total_messages": p * path.messages, "total_bytes": float(p * path.wire_bytes)}


def crossover_bytes(p: int, machine) -> float | None:
    """The size n below which Bruck beats pairwise exchange on ``machine`` (α, β); None where it never
    does (p ≤ 3: the same messages and bytes) or β = 0 (Bruck always does)."""
    fewer_messages = p - 1 - len(rounds(p))
    extra_blocks = bruck_blocks(p) - (p - 1)
    if fewer_messages <= 0:
        return None
    if machine.beta == 0 or extra_blocks <= 0:
        return float("inf")
    return fewer_messages * machine.alpha / (extra_blocks / p * machine.beta)


def formula_text_alltoall(algorithm: str) -> str:
    """The formula as a student reads it, e.g. "(p-1)α + (p-1)/p·nβ"."""
    if ("alltoall", algorithm) not in FORMULAS:
        raise unknown("alltoall", algorithm, set(FORMULAS))
    return FORMULAS["alltoall", algorithm]


def fit_pairwise(rows, p: int, name: str = "fitted"):
    """α and β from measured pairwise all-to-alls (rows with algorithm, size = n bytes, time_us): a least-squares
    fit of t = (p-1)α + (p-1)/p·nβ (each clipped to stay positive). Returns a Machine (γ = 0)."""
    import numpy as np

    from tplab.cost.formulas import Machine

    pairs = [(r["size"], r["time_us"] * 1e-6) for r in rows if r["algorithm"] == "pairwise"]
    if len(pairs) < 2 or p < 2:
        raise ValueError("fit_pairwise needs pairwise timings at two sizes or more, on 2 ranks or more")
    sizes, seconds = (np.array(v, dtype=float) for v in zip(*pairs))
    design = np.stack([np.full(len(sizes), p - 1.0), (p - 1) / p * sizes], axis=1)
    alpha, beta = np.linalg.lstsq(design, seconds, rcond=None)[0]
    return Machine(alpha=max(float(alpha), 1e-9), beta=max(float(beta), 1e-15), gamma=0.0, name=name)


def measured_crossover(rows) -> float | None:
    """The smallest measured size from which pairwise exchange is faster than Bruck at every larger size
    measured (rows with algorithm, size, time_us); None if Bruck is faster at the largest size."""
    times = {}
    for r in rows:
        times.setdefault(r["size"], {})[r["algorithm"]] = r["time_us"]
    answer = None
    for size in sorted(times, reverse=True):
        if times[size].get("pairwise", float("inf")) < times[size].get("bruck", float("inf")):
            answer = size
        else:
            break
    return answer
