"""Pictures for notebook 04: how the weights of a block are cut between ranks, from the real shards."""

from __future__ import annotations

import matplotlib.patches as patches
import matplotlib.pyplot as plt

MAX_WIDTH = 11.5  # inches, as tplab.lab.plots.MAX_WIDTH: readable at JupyterLab's width (models sit below lab)


def draw_weight_split(shards, title: str | None = None, max_columns: int = 3, only: str | None = None):
    """One panel per weight: the full (out, in) matrix (width = in, height = out, each panel to its own
    scale), each rank's shard in its colour, labelled with the shape it holds. ``shards``: the rows of
    ``experiments.weight_shards`` from every rank (a DataFrame or a list of dicts); ``only``: the weights
    whose name starts with it ("attention", "MLP"), so that one figure answers one question."""
    rows = shards.to_dict("records") if hasattr(shards, "to_dict") else list(shards)
    if only is not None:
        rows = [r for r in rows if str(r["weight"]).startswith(only)]
    weights = list(dict.fromkeys(r["weight"] for r in rows))
    colors = plt.cm.tab10.colors
    n = min(len(weights), max_columns)
    fig, axes = plt.subplots(1, n, figsize=(min(3.6 * n, MAX_WIDTH), 3.9), constrained_layout=True, squeeze=False)
    for ax, weight in zip(axes[0], weights):
        mine = [r for r in rows if r["weight"] == weight]
        out_features, in_features = mine[0]["full"]
        biggest = max(out_features, in_features)
        w, h = in_features / biggest, out_features / biggest  # to scale, the largest side = 1
        for r in mine:
            rows_, cols = r["shard"]
            dim, first = r["split_dim"], r["first"] / biggest
            x, y = (0, first) if dim == 0 else (first, 0)  # column-parallel: rows of W (output features)
            ax.add_patch(patches.Rectangle((x, h - y - rows_ / biggest), cols / biggest, rows_ / biggest,
                                           facecolor=colors[r["rank"] % 10], alpha=0.75, edgecolor="white"))
            cx, cy = x + cols / biggest / 2, h - y - rows_ / biggest / 2
            narrow = dim == 1 and cols / biggest < 0.3  # a thin vertical band: write along it
            flat = dim == 0 and rows_ / biggest < 0.1  # a thin horizontal band: one line
            ax.text(cx, cy, f"rank {r['rank']}" + (": " if flat else "\n") + f"{rows_}×{cols}", ha="center",
                    va="center", fontsize=8, rotation=90 if narrow else 0)
        ax.add_patch(patches.Rectangle((0, 0), w, h, fill=False, edgecolor="black"))
        ax.set(xlim=(-0.02, 1.02), ylim=(-0.02, 1.02), aspect="equal", xticks=[], yticks=[],
               title=f"{weight}\nW: {out_features}×{in_features} (out×in)")
        ax.title.set_fontsize(9)
    for ax in axes[0][len(weights):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, y=1.06)
    return fig
