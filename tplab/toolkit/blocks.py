"""How a flat vector is cut into blocks: the way ``numpy.array_split`` cuts it.

    block_counts(10, 4) == [3, 3, 2, 2]        block_bounds(10, 4) == [0, 3, 6, 8, 10]

Block i is ``flat[bounds[i]:bounds[i+1]]``. With fewer elements than blocks, the last blocks are empty.
"""

from __future__ import annotations


def block_counts(count: int, parts: int) -> list[int]:
    base, extra = divmod(count, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def offsets(counts) -> list[int]:
    """Running sums: where each of a sequence of consecutive pieces starts, plus the total at the end."""
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


def block_bounds(count: int, parts: int) -> list[int]:
    return offsets(block_counts(count, parts))
