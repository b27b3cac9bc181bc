"""Bad input to a sequence-parallel scheme: the same clear error on every rank, never a hang.

Before any data moves, every rank publishes its shapes and its local problems (one small uncounted
``allgather_object``) and every rank raises the same ``SequenceParallelError`` if anything is wrong
anywhere: shapes that differ between ranks, a local sequence that does not cut into the layout's chunks,
head counts Ulysses cannot split. ``check=False`` (benchmarks) skips the exchange. (Options that every rank
has alike, such as the all-gather's ``head_groups``, are checked where they are, with no exchange.)
"""

from __future__ import annotations

from tplab.sequence.layout import LAYOUTS, my_chunks


class SequenceParallelError(ValueError):
    """The inputs of a sequence-parallel scheme are invalid or differ between ranks (on every rank)."""


def local_problems(q, k, v, p: int, layout: str, heads_divisible: bool) -> list[str]:
    if layout not in LAYOUTS:
        return [f"unknown layout {layout!r}: choose one of {list(LAYOUTS)}"]
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return [f"q, k, v must be (batch, heads, local tokens, head dim); got {tuple(q.shape)}, "
                f"{tuple(k.shape)}, {tuple(v.shape)}"]
    problems = []
    (b, n, s_local, d), (bk, n_kv, sk, dk) = q.shape, k.shape
    if tuple(k.shape) != tuple(v.shape):
        problems.append(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if (b, s_local, d) != (bk, sk, dk):
        problems.append(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, tokens or head dim")
    if n_kv == 0 or n % n_kv:
        problems.append(f"{n} query heads are not a multiple of {n_kv} key/value heads")
    pieces = len(my_chunks(0, p, layout))
    if s_local % pieces:
        problems.append(f"{s_local} local tokens do not cut into the {pieces} chunks of the {layout} layout")
    if heads_divisible and (n % p or (n_kv and n_kv % p)):
        problems.append(f"Ulysses gives each of the {p} ranks whole heads: {n} query heads and {n_kv} "
                        f"key/value heads must both be divisible by {p}")
    return problems


def check_attention_inputs(q, k, v, comm, layout: str, *, heads_divisible: bool = False) -> None:
    mine = {"shapes": (tuple(q.shape), tuple(k.shape), tuple(v.shape)), "dtype": str(q.dtype), "layout": layout,
            "problems": local_problems(q, k, v, comm.size, layout, heads_divisible)}
    everyone = comm.allgather_object(mine)
    ranks_with: dict[str, list[int]] = {}  # each problem once, with the ranks that have it
    for r, meta in enumerate(everyone):
        for problem in meta["problems"]:
            ranks_with.setdefault(problem, []).append(r)
    messages = [f"{problem} (rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
                for problem, rs in ranks_with.items()]
    for key in ("shapes", "dtype", "layout"):
        values = [meta[key] for meta in everyone]
        if len(set(values)) > 1:
            messages.append(f"ranks disagree on {key}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(values)))
    if messages:
        raise SequenceParallelError("; ".join(messages))


def check_head_groups(head_groups, kv_heads: int) -> None:
    """The all-gather's head groups (allgather_kv.py) must split the K/V heads evenly. Every rank has the
    same layer and options, so every rank raises the same error before any data moves."""
    if isinstance(head_groups, bool) or not isinstance(head_groups, int) or head_groups < 1 or kv_heads % head_groups:
        raise SequenceParallelError(f"head_groups={head_groups!r}: the {kv_heads} key/value heads must split into "
                                    f"equal groups (a whole number >= 1 that divides {kv_heads})")
