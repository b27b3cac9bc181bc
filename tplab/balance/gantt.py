"""Gantt charts of interval tables (``Timeline`` rows): one lane per rank, one bar per interval.

    plot_gantt(df)                       bars coloured by ``color_by`` (default: the work item)
    plot_gantt(df, label="item")         with each bar's item written on it (when it fits)
    as_trace(df)                         the same rows for tplab.plots.plot_timeline (the overlap tracer's view)

Idle time is the white between bars; a dynamic queue's "pull" rows (waiting for the next item) are
drawn as thin grey hatched bars. The makespan is the right edge of the last work bar (a dashed line).
Returns the Figure (or draws into ``ax``).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np


def plot_gantt(df, *, lane="rank", color_by="item", label=None, ax=None, title=None, makespan=True,
               cmap="tab20", legend=False):
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 0.45 * max(df[lane].nunique() if len(df) else 1, 2) + 1.2),
                               constrained_layout=True)
    fig = ax.figure
    if not len(df):
        ax.set_title(title or "(no intervals)")
        return fig
    lanes = sorted(df[lane].unique())
    pulls = df["what"] == "pull" if "what" in df else np.zeros(len(df), bool)
    work = df[~pulls]
    keys = sorted(work[color_by].unique(), key=lambda k: (str(type(k)), k)) if color_by in df else [None]
    palette = plt.get_cmap(cmap)
    color_of = {k: palette(i % palette.N) for i, k in enumerate(keys)}
    for y, name in enumerate(lanes):
        rows = df[df[lane] == name]
        for row in rows.itertuples(index=False):
            r = row._asdict()
            if r.get("what") == "pull":
                ax.barh(y, r["end"] - r["start"], left=r["start"], height=0.3, color="whitesmoke", hatch="////",
                        edgecolor="gray", linewidth=0.3, label="waiting for the queue")
                continue
            color = color_of[r[color_by]] if color_by in r else "tab:blue"
            ax.barh(y, r["end"] - r["start"], left=r["start"], height=0.8, color=color, edgecolor="black",
                    linewidth=0.4, label=str(r[color_by]) if color_by in r else None)
            if label is not None and label in r:
                span = r["end"] - r["start"]
                if span > 0.03 * (work["end"].max() - work["start"].min()):
                    ax.text(r["start"] + span / 2, y, str(r[label]), ha="center", va="center", fontsize=7)
    if makespan and len(work):
        ax.axvline(work["end"].max(), color="black", ls="--", lw=0.8)
    ax.set_yticks(np.arange(len(lanes)), [f"{lane} {n}" for n in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title)
    if legend:
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=7, ncol=min(len(unique), 6), loc="upper right")
    return fig


def as_trace(df):
    """The intervals in the columns of tplab.overlap's tracer (rank, lane, kind, start, end), so that
    ``tplab.plots.plot_timeline`` draws them too: work items are "compute", queue pulls "wait"."""
    out = df.copy()
    out["lane"] = "main"
    out["kind"] = out["what"].map({"pull": "wait"}).fillna("compute") if "what" in out else "compute"
    return out
