"""Pictures of one real dispatch and combine (``experiments.exchange_record``), drawn step by step.

    draw_tokens(record, ax)             before: each rank's tokens and the experts its router chose
    draw_steps(record, ax, "dispatch")  step k of pairwise exchange: what rank r receives from rank r-k
    draw_steps(record, ax, "combine")   the way back: each row returns to the rank its token lives on
    draw_experts(record, ax)            after dispatch: each rank's rows grouped by its experts
    home_color(rank)                    the colour of the tokens that live on a rank (for a legend)

Cells are coloured by the rank a token lives on (its home), so a row's colour says where it came from; a
light gray cell holds nothing (a message that is not sent). tplab.lab.moe_plots puts the panels together.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

_EMPTY = (0.96, 0.96, 0.96, 1.0)   # a cell with no tokens in it: a message not sent, an expert with no rows
_NEUTRAL = (0.90, 0.92, 0.95, 1.0)  # a cell that is not about tokens (the experts a rank holds)
_INSET = 0.04                       # the white gap around each cell, in cell widths


def home_color(rank: int, alpha: float = 0.3):
    """The colour of the tokens that live on ``rank`` (a legend uses the same)."""
    return (*plt.get_cmap("tab10")(rank % 10)[:3], alpha)


def _grid(ax, cells, row_labels, col_labels, title):
    """A table of text cells, each (text, home rank, None for a neutral cell, or "empty"). Cells are
    filled tiles with white gaps between them and no frame: a frame drawn on the axes' edge would be cut
    in half there (the look of a broken border)."""
    rows, cols = len(cells), len(col_labels)
    for i in range(rows):
        for j in range(cols):
            text, home = cells[i][j]
            face = _EMPTY if home == "empty" else _NEUTRAL if home is None else home_color(home)
            ax.add_patch(plt.Rectangle((j + _INSET, i + _INSET), 1 - 2 * _INSET, 1 - 2 * _INSET, facecolor=face,
                                       edgecolor="none"))
            ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=8,
                    color="gray" if home == "empty" else "black")
    ax.set(xlim=(0, cols), ylim=(rows, 0))
    ax.set_title(title, fontsize=9)
    ax.xaxis.tick_top()  # column headings above the table, under its title
    ax.set_xticks([j + 0.5 for j in range(cols)], col_labels, fontsize=8)
    ax.set_yticks([i + 0.5 for i in range(rows)], row_labels, fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)


def _experts_of(record, rank):
    return range(record["bounds"][rank], record["bounds"][rank + 1])


def draw_tokens(record, ax):
    p = record["p"]
    choices = lambda r: "\n".join(f"t{t} → E{','.join(map(str, e))}" for t, e in zip(r["tokens"], r["chosen"]))
    cells = [[(choices(r) or "-", r["rank"]),
              (", ".join(f"E{e}" for e in _experts_of(record, r["rank"])) or "none", None)] for r in record["ranks"]]
    _grid(ax, cells, [f"rank {r}" for r in range(p)], ["tokens → experts", "holds experts"],
          "before: tokens on their ranks")


def draw_steps(record, ax, phase: str = "dispatch"):
    """Rows: the receiving rank; columns: the step (0: the rows a rank keeps for itself, no message)."""
    p = record["p"]
    cells = [[[] for _ in range(p)] for _ in range(p)]
    for r in record["ranks"]:
        for token, expert, source, step in r["received"]:
            if phase == "dispatch":  # rank r got (token, expert) from ``source`` in ``step``
                cells[r["rank"]][step].append((f"t{token}·E{expert}", source))
            else:  # the result goes back from r to ``source``: at combine step (source - r) mod p
                cells[source][(source - r["rank"]) % p].append((f"t{token}·E{expert}", source))
    nothing = lambda step: ("none kept", "empty") if step == 0 else ("no message", "empty")
    grid = [[("\n".join(text for text, _ in cell), cell[0][1]) if cell else nothing(step) for step, cell in enumerate(row)]
            for row in cells]
    arrow = "from" if phase == "dispatch" else "back from"
    _grid(ax, grid, [f"rank {r}" for r in range(p)],
          ["step 0 (kept)"] + [f"step {k}: {arrow} r−{k}" for k in range(1, p)], f"{phase}: rows received per step")


def draw_experts(record, ax):
    p = record["p"]
    cells = []
    for r in record["ranks"]:
        by_expert = {e: [t for t, ex, _, _ in r["received"] if ex == e] for e in _experts_of(record, r["rank"])}
        text = "\n".join(f"E{e}: " + (" ".join(f"t{t}" for t in ts) or "-") for e, ts in by_expert.items()) or "none"
        cells.append([(text, None if by_expert else "empty")])
    _grid(ax, cells, [f"rank {r}" for r in range(p)], ["rows per expert (token order)"], "after dispatch: compute")
