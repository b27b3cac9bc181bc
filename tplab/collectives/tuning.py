"""Tuning tables: which algorithm ``algorithm="auto"`` picks, by collective, rank count and size.

MPI libraries ship such tables (MPICH's JSON tuning files, Open MPI's coll_tuned decision rules); tplab
builds its own from measurements on the machine at hand (or from a fitted cost model) and saves them in
data/. The format is plain JSON:

    {"machine": "...", "source": "measured 2026-11-26",
     "collectives": {"allreduce": {"4": [[2048, "recursive_doubling"], [null, "rabenseifner"]]}}}

reads: with 4 ranks, up to 2048 bytes use recursive doubling, above that Rabenseifner. A rank count
missing from the table uses the nearest one present (on a log scale); a collective missing from it
falls back to MPICH's rules (auto.py).

    table = table_from_rows(rows)              # rows from tplab.lab.bench.sweep
    save_table(table, "data/tuning_mymachine.json")
    use_table("data/tuning_mymachine.json")    # on every rank (cluster.run(use_table, path) in a notebook)
"""

from __future__ import annotations

import json
import math
import os

NOT_CANDIDATES = {"builtin", "auto"}  # auto chooses among the hand-written algorithms: they are the subject

_active: dict | None = None


def table_from_rows(rows, machine: str = "", source: str = "measured", tolerance: float = 0.05) -> dict:
    """The fastest hand-written algorithm for each (collective, ranks, size) of timing rows, merged into
    size ranges. A range ends halfway (geometrically) between the last size one algorithm won and the
    first size the next one won. Timings are noisy: going up in size, the previous winner keeps a size
    unless the fastest beats it by more than ``tolerance`` (5%), so near-ties do not flip back and forth."""
    times: dict[tuple, dict] = {}  # (collective, ranks, size) -> {algorithm: time}
    for r in rows:
        if r["algorithm"] in NOT_CANDIDATES or int(r.get("wrong", 0)) > 0:
            continue
        times.setdefault((r["collective"], int(r["ranks"]), int(r["size"])), {})[r["algorithm"]] = float(r["time_us"])
    winners: dict[tuple, list] = {}  # (collective, ranks) -> [(size, algorithm), ...] by size
    for (collective, ranks, size), by_algorithm in sorted(times.items()):
        points = winners.setdefault((collective, ranks), [])
        fastest = min(by_algorithm, key=by_algorithm.get)
        previous = points[-1][1] if points else None
        if previous in by_algorithm and by_algorithm[previous] <= (1 + tolerance) * by_algorithm[fastest]:
            fastest = previous
        points.append((size, fastest))
    collectives: dict = {}
    for (collective, ranks), points in winners.items():
        ranges = []
        for (size, algorithm), following in zip(points, points[1:] + [None]):
            if following is None:
                ranges.append([None, algorithm])  # the last winner holds for anything larger
            elif following[1] != algorithm:
                ranges.append([int(math.sqrt(size * following[0])), algorithm])
        collectives.setdefault(collective, {})[str(ranks)] = ranges
    return {"machine": machine, "source": source, "collectives": collectives}


def crossovers(table: dict, collective: str, ranks: int) -> list[tuple]:
    """[(up_to_bytes or None, algorithm), ...] for one collective and rank count."""
    return [tuple(r) for r in table["collectives"].get(collective, {}).get(str(ranks), [])]


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"


def describe(table: dict, collective: str, ranks: int) -> list[tuple[str, str]]:
    """The ranges of one rank count in words: [('up to 2.83 KiB', 'naive'), ('2.83 KiB - 362 KiB', ...),
    ('above 362 KiB', 'ring')]."""
    out, previous = [], None
    for up_to, algorithm in crossovers(table, collective, ranks):
        if up_to is None:
            span = f"above {human_bytes(previous)}" if previous is not None else "any size"
        elif previous is None:
            span = f"up to {human_bytes(up_to)}"
        else:
            span = f"{human_bytes(previous)} - {human_bytes(up_to)}"
        out.append((span, algorithm))
        previous = up_to
    return out


def lookup(table: dict, collective: str, nbytes: int, p: int) -> str | None:
    by_ranks = table.get("collectives", {}).get(collective)
    if not by_ranks:
        return None
    nearest = min(by_ranks, key=lambda k: (abs(math.log2(int(k)) - math.log2(max(p, 1))), int(k)))
    for up_to, algorithm in by_ranks[nearest]:
        if up_to is None or nbytes <= up_to:
            return algorithm
    return by_ranks[nearest][-1][1]


def save_table(table: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")


def load_table(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def use_table(table: dict | str | None) -> None:
    """Make ``algorithm="auto"`` follow this table (a dict or a JSON path) on this rank; None: MPICH's
    rules again. Call it on every rank: ranks that chose differently would deadlock."""
    global _active
    _active = load_table(table) if isinstance(table, (str, os.PathLike)) else table


def active_table() -> dict | None:
    return _active


if os.environ.get("TPLAB_TUNING"):  # the same file for every rank of a job
    use_table(os.environ["TPLAB_TUNING"])
