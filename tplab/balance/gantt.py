"""Gantt charts of interval tables (``Timeline`` rows): one lane per rank, one bar per interval.

    plot_gantt(df)                       bars coloured by ``color_by`` (default: the work item)
    plot_gantt(df, label="item")         with each bar's item written on it (when it fits)

Idle time is the white between bars; a dynamic queue's "pull" rows (waiting for the next item) are
drawn as thin grey hatched bars. The makespan is the right edge of the last work bar (a dashed line).
Returns the Figure (or draws into ``ax``).
"""

from __future__ import annotations

import numpy as np


def plot_gantt(df, *, lane="rank", color_by="item", label=None, ax=None, title=None, makespan=True,
               cmap="tab20", legend=False):
    import matplotlib.pyplot as plt  # here, so that the rest of tplab.balance runs without matplotlib

    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 0.45 * max(df[lane].nunique() if len(df) else 1, 2) + 1.2),
                               constrained_layout=True)
    fig = ax.figure
    if not len(df):
        ax.set_title(title or "(no intervals)")
        return fig
    lanes = sorted(df[lane].unique())
    y_of = {name: y for y, name in enumerate(lanes)}
    pulls = (df["what"] == "pull").to_numpy() if "what" in df else np.zeros(len(df), bool)
    work, waits = df[~pulls], df[pulls]
    if len(waits):  # one call per kind of bar: thousands of intervals still draw quickly
        ax.barh(waits[lane].map(y_of), waits["end"] - waits["start"], left=waits["start"], height=0.3,
                color="whitesmoke", hatch="////", edgecolor="gray", linewidth=0.3, label="waiting for the queue")
    if color_by in work:
        keys = sorted(work[color_by].unique(), key=lambda k: (str(type(k)), k))
        palette = plt.get_cmap(cmap)
        color_of = {k: palette(i % palette.N) for i, k in enumerate(keys)}
        colors = [color_of[k] for k in work[color_by]]
    else:
        colors = "tab:blue"
    ax.barh(work[lane].map(y_of), work["end"] - work["start"], left=work["start"], height=0.8, color=colors,
            edgecolor="black", linewidth=0.4)
    if label is not None and label in work and len(work):
        wide = 0.03 * (work["end"].max() - work["start"].min())
        for row in work[(work["end"] - work["start"]) > wide].itertuples(index=False):
            r = row._asdict()
            ax.text((r["start"] + r["end"]) / 2, y_of[r[lane]], str(r[label]), ha="center", va="center", fontsize=8)
    if makespan and len(work):
        ax.axvline(work["end"].max(), color="black", ls="--", lw=0.8)
    ax.set_yticks(np.arange(len(lanes)), [f"{lane} {n}" for n in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
    if legend and len(waits):
        ax.legend(fontsize=8, loc="upper right")
    return fig
