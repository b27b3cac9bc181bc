"""Notebook 01's step pictures: which ranks' contributions every element holds after each step of an
all-reduce, from a real run (``tplab.collectives.snapshots.trace_allreduce`` on every rank).

    draw_allreduce_steps(traces, title)   one panel: a row per step (time runs down), a group of columns per rank
    step_table(traces)                    the steps in order, and every rank's buffer after each

One panel for every algorithm and rank count: a gallery of one panel per step grew to 7 panels for a ring
on 4 ranks (15 on 8), too many to read at JupyterLab's width. Rows keep the steps in order, so what changed
is read downwards, and a rank's group of columns is its vector.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from tplab.lab.plots import MAX_WIDTH, suptitle

_GAP = 0.5          # blank columns between two ranks' groups
_LABELS_IN = 1.9    # inches left of the tiles for the step labels
_TILE_IN = 0.55     # the widest tile (inches); narrower when p elements x p ranks would pass MAX_WIDTH
_ROW_IN = 0.34      # the height of one step's row (inches)
_FONT = 8


def _contributors(mask: int, p: int) -> str:
    """Bit mask -> the ranks it contains, written compactly ("0123", or "all" / "-")."""
    ranks = [r for r in range(p) if mask >> r & 1]
    if not ranks:
        return "-"
    if len(ranks) == p and p > 4:
        return "all"
    return "".join(str(r) for r in ranks) if p <= 10 else f"{len(ranks)}"


def _unique_labels(steps):
    """A label a rank records twice (say, "start" of two phases) becomes "label (2)" the second time."""
    seen: dict[str, int] = {}
    out = []
    for label, buf, at_round in steps:
        seen[label] = seen.get(label, 0) + 1
        out.append((label if seen[label] == 1 else f"{label} ({seen[label]})", buf, at_round))
    return out


def step_table(traces):
    """From per-rank traces build the ordered list of step labels and, for each, every rank's buffer
    (carried forward if the rank did nothing in that step). Steps are ordered by the algorithm's round
    number, which lines the ranks up (wall-clock order would not, when ranks outnumber cores)."""
    traces = sorted((t for t in traces if t is not None), key=lambda t: t["rank"])
    steps_of = [_unique_labels(t["steps"]) for t in traces]
    order: dict[str, tuple] = {}  # label -> (round, where it first appeared): ties keep a rank's own order
    for steps in steps_of:
        for label, _, at_round in steps:
            order.setdefault(label, (at_round, len(order)))
    labels = sorted(order, key=order.get)
    state = [None] * len(traces)
    table = []
    for label in labels:
        for i, steps in enumerate(steps_of):
            for step_label, buf, _ in steps:
                if step_label == label:
                    state[i] = buf
        table.append((label, [list(s) if s is not None else [] for s in state]))
    return labels, table


def _tile_writer(table, p: int, tile_points: float):
    """How tiles are labelled, the same way in every tile of a figure: the ranks an element holds if the
    longest such label fits a tile, else how many (8 ranks' "0124567" does not fit a tile of 64 columns),
    else nothing (the colour still says how full it is). Returns (mask -> text, "ranks" | "count" | None)."""
    fits = lambda chars: chars * 0.62 * _FONT <= tile_points - 2
    longest = max(len(_contributors(m, p)) for _, bufs in table for b in bufs for m in b)
    if fits(longest):
        return (lambda mask: _contributors(mask, p)), "ranks"
    if fits(len(str(p))):
        return (lambda mask: str(int(mask).bit_count())), "count"
    return (lambda mask: ""), None


def draw_allreduce_steps(traces, title: str | None = None):
    """One row per step, top to bottom; in each row a group of columns per rank, the elements of its vector
    (one per block) left to right. Each tile lists the ranks whose contributions that element holds; the
    colour deepens as it fills, and a full tile (all p contributions) is dark with white bold text."""
    traces = [t for t in traces if t is not None]  # ranks outside a sub-communicator return None
    p = len(traces)
    labels, table = step_table(traces)
    count = max(len(b) for _, bufs in table for b in bufs)
    columns = p * count + _GAP * (p - 1)
    tile = min(_TILE_IN, (MAX_WIDTH - _LABELS_IN - 0.2) / columns)  # 0.2: the margins savefig keeps
    fig, ax = plt.subplots(figsize=(_LABELS_IN + tile * columns, _ROW_IN * len(table) + 1.1), constrained_layout=True)
    left_of = lambda r, e: r * (count + _GAP) + e  # x of element e of rank r
    cmap = plt.get_cmap("Blues")
    write, labelled = _tile_writer(table, p, tile * 72)
    for row, (_, bufs) in enumerate(table):
        for r, buf in enumerate(bufs):
            for e in range(count):
                mask = buf[e] if e < len(buf) else 0
                filled = int(mask).bit_count()
                full = filled == p
                # white edges between the tiles: a clean grid with no frame to clip at the axes' border
                ax.add_patch(plt.Rectangle((left_of(r, e), row), 1, 1, facecolor=cmap(filled / (p * 1.35)),
                                           edgecolor="white", lw=1.5))
                text = write(mask) if e < len(buf) else ""
                ax.text(left_of(r, e) + 0.5, row + 0.5, text, ha="center", va="center", fontsize=_FONT,
                        color="white" if full else "black", fontweight="bold" if full else "normal")
    ax.set(xlim=(0, columns), ylim=(len(table), 0))
    ax.set_yticks(np.arange(len(table)) + 0.5, labels, fontsize=_FONT)
    ax.set_xticks([left_of(r, 0) + count / 2 for r in range(p)], [f"rank {r}" for r in range(p)], fontsize=_FONT)
    ax.xaxis.tick_top()
    ax.set_xlabel(f"each rank's vector: its {count} elements (one per block), left to right"
                  + ("; a tile's number: how many ranks' contributions it holds" if labelled == "count" else ""), fontsize=_FONT)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    suptitle(fig, title or "which contributions each element holds, step by step", fontsize=10)
    return fig
