"""Pictures for notebook 08: loss curves, syncs counted, communication time per pattern."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

PROJECT_LOSS_BAND = (1.45, 1.50)  # the student project's validation loss after 2000 steps, all four configurations
MARKERS = "osv^D"


def _axes(ax, figsize=(6.5, 4)):
    if ax is None:
        _, ax = plt.subplots(figsize=figsize, constrained_layout=True)
    return ax


def plot_loss_curves(curves, ax=None, title="validation loss", claim=False, train=True):
    """Validation loss (solid; training loss dashed if ``train``) against step, one colour per config.
    ``claim`` shades the student project's 1.45-1.50 band."""
    ax = _axes(ax)
    for (name, group), color in zip(curves.groupby("config", sort=False), plt.cm.tab10.colors):
        ax.plot(group["step"], group["val_loss"], "-", marker=MARKERS[len(ax.lines) % 5], ms=3, color=color,
                label=f"{name} ({group['syncs_forward'].iloc[0]} all-reduces per forward)")
        if train:
            ax.plot(group["step"], group["train_loss"], "--", color=color, alpha=0.5, lw=1)
    if claim:
        ax.axhspan(*PROJECT_LOSS_BAND, color="grey", alpha=0.2, label="the project: 1.45-1.50")
    ax.set(xlabel="training step", ylabel="loss (nats per character)", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_sync_counts(checked, ax=None, project_counts=None):
    """Grouped bars per config: all-reduces counted forward and backward, the formula, the project's count."""
    ax = _axes(ax)
    x = np.arange(len(checked))
    bars = [("forward (counted)", checked["forward_allreduces"]), ("backward (counted)", checked["backward_allreduces"]),
            ("weight grads (counted)", checked["weight_grad_allreduces"])]
    if project_counts is not None:
        bars.append(("the project's count", [project_counts.get(c, np.nan) for c in checked["config"]]))
    width = 0.8 / len(bars)
    for i, (label, values) in enumerate(bars):
        ax.bar(x + (i - (len(bars) - 1) / 2) * width, values, width, label=label)
    ax.scatter(x, checked["formula"], marker="_", s=900, color="black", zorder=3, label="formula (forward)")
    ax.set_xticks(x, checked["config"])
    ax.set(ylabel="all-reduces per pass", title=f"synchronisations, p = {checked['p'].iloc[0]} real ranks")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return ax


def plot_comm_time(timed, ax=None, title=None):
    """Stacked bars per config: time inside the all-reduces and the rest, for a forward pass and a step."""
    ax = _axes(ax, figsize=(7.5, 4))
    x = np.arange(len(timed))
    parts = [("forward", "forward"), ("step", "forward + backward")]
    if timed["step_ms"].isna().all():  # forward passes only
        parts = parts[:1]
    offsets = (-0.2, 0.2) if len(parts) == 2 else (0.0,)
    for offset, (what, label) in zip(offsets, parts):
        comm = timed[f"{what}_comm_ms"]
        ax.bar(x + offset, comm, 0.38, color="tab:red" if what == "forward" else "salmon",
               label=f"{label}: in all-reduces")
        ax.bar(x + offset, timed[f"{what}_ms"] - comm, 0.38, bottom=comm,
               color="tab:blue" if what == "forward" else "lightsteelblue", label=f"{label}: the rest")
    ax.set_xticks(x, [f"{c}\n{s} sync{'' if s == 1 else 's'} per forward" for c, s in zip(timed["config"], timed["syncs_forward"])])
    ax.set(ylabel="ms (slowest rank, median)", title=title or timed["network"].iloc[0])
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return ax


def plot_time_per_sync(timed, ax=None):
    """Forward time inside all-reduces against the number of them, with the line through the origin
    fitted to the points: its slope is what one sync costs."""
    ax = _axes(ax, figsize=(5.5, 4))
    for (network, group), marker in zip(timed.groupby("network", sort=False), MARKERS):
        ms, n = group["forward_comm_ms"].to_numpy(), group["syncs_forward"].to_numpy()
        per_sync = float((ms * n).sum() / (n * n).sum())  # least squares through the origin
        points = ax.plot(n, ms, marker, ls="none", label=f"{network}: {per_sync:.2f} ms per sync")
        grid = np.array([0, n.max()])
        ax.plot(grid, per_sync * grid, "-", color=points[0].get_color(), alpha=0.5)
    ax.set(xlabel="all-reduces per forward pass", ylabel="ms inside them (slowest rank)",
           title="time inside all-reduces against their number")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax
