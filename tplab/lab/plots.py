"""Pictures for the notebooks (matplotlib). Each function returns the Figure so a notebook can save it.

    plot_times(df)                 time vs message size, one line per algorithm (log-log)
    plot_timeline(df)              per-rank Gantt chart of traced compute / comm / wait (tplab.overlap)
    plot_overlap_sweep(df)         a layer's time and hidden fraction against the chunk count (tplab.overlap)
    plot_overlap_summary(df)       per path: a layer without overlap vs overlapped at its best (gpu_overlap.py rows)
    setup(output_dir, prefix)      readable figures at JupyterLab's width, and save(fig, name) (each notebook's first cell)
    color_of(name)                 one colour per algorithm or path, the same in every figure

Notebook 01's step pictures are in tplab.lab.step_pictures.
"""

from __future__ import annotations

import zlib

import matplotlib.pyplot as plt
import numpy as np

# One colour per algorithm (and per GPU path), whichever figure it appears in: a reader learns "ring is
# orange" once. Names not listed get a stable colour of their own from the rest of the palette.
COLORS = {
    "builtin": "black", "MPI_Allreduce": "black", "nccl": "black", "NCCL": "black", "torch.distributed": "black",
    "naive": "tab:gray", "ring": "tab:orange", "recursive_doubling": "tab:blue", "recursive_halving": "tab:blue",
    "rabenseifner": "tab:green", "tree": "tab:purple", "binomial": "tab:purple", "hierarchical": "tab:brown",
    "auto": "tab:red", "tplab.allreduce": "tab:red", "persistent kernel": "tab:pink",
    "peer_one_shot": "tab:cyan", "one_shot": "tab:cyan", "peer_two_shot": "tab:olive", "two_shot": "tab:olive",
    "peer_one_shot_ll": "darkcyan", "one_shot_ll": "darkcyan",
    "peer_one_shot_lamport": "navy", "one_shot_lamport": "navy",
    "peer_two_shot_lamport": "mediumvioletred", "two_shot_lamport": "mediumvioletred",
    "peer_ring": "tab:orange", "copy_engine": "tab:brown", "peer_registered": "darkolivegreen",
    # sequence-parallel schemes (notebook 05; allgather_kv and ulysses keep the colours they always had)
    "streamed_kv": "darkgoldenrod", "fused_kv": "crimson",
    # all-to-all (notebook 09): pairwise exchange walks the ranks like the ring, Bruck halves like doubling
    "pairwise": "tab:orange", "bruck": "tab:blue", "tplab_pairwise": "tab:orange", "tplab_bruck": "tab:blue",
    "tplab_alltoallv": "tab:red", "nccl_all_to_all_single": "black", "tplab_peer_memory": "tab:cyan",
    # the anchors a GPU all-reduce is measured against (tplab.lab.anchors)
    "nccl_symmetric": "tab:gray", "symm_mem_one_shot": "tab:purple", "symm_mem_two_shot": "tab:green",
    # notebook 09's router variants (tplab.moe.experiments.VARIANTS): colours its all-to-all paths do not use
    "plain": "tab:gray", "noise": "tab:purple", "aux loss 0.01": "tab:brown", "noise + aux loss 0.05": "tab:green",
}
# The widest figure (inches): at setup()'s 110 dpi, 1265 px, which JupyterLab shows at about 80% or more of its
# size on a laptop-wide notebook, so 9-point text stays at 8 points or more on screen.
MAX_WIDTH = 11.5
_SPARE = ["#1f77b4", "#8c564b", "#17becf", "#bcbd22", "#9467bd", "#e377c2", "#7f7f7f", "#2ca02c", "#d62728"]


def color_of(name) -> str:
    """The colour of an algorithm or path in every tplab figure."""
    name = str(name)
    return COLORS.get(name) or _SPARE[zlib.crc32(name.encode()) % len(_SPARE)]


def suptitle(fig, text: str, fontsize: float = 9) -> None:
    """A figure's title, wrapped to its width: a long title (a machine's description) would otherwise make
    the saved figure wider than its panels (bbox_inches="tight") and JupyterLab shrink it to fit."""
    import textwrap

    chars = max(40, int(fig.get_figwidth() * 72 / (0.55 * fontsize)))
    fig.suptitle("\n".join(textwrap.fill(line, chars) for line in str(text).split("\n")), fontsize=fontsize)


def setup(output_dir=None, prefix: str = "", dpi: int = 110, font_size: float = 9.0):
    """The notebooks' first cell: figures readable at JupyterLab's width (a size that needs no shrinking,
    legends and ticks >= 8 pt), and, given ``output_dir``, the ``save(fig, name)`` that writes
    ``<output_dir>/figures/<prefix>_<name>.png`` (returned; None without an output_dir)."""
    import os

    plt.rcParams.update({"figure.dpi": dpi, "figure.figsize": (7.0, 4.0), "font.size": font_size,
                         "axes.titlesize": font_size + 1, "axes.labelsize": font_size,
                         "legend.fontsize": max(8.0, font_size - 1), "xtick.labelsize": max(8.0, font_size - 1),
                         "ytick.labelsize": max(8.0, font_size - 1)})
    if output_dir is None:
        return None
    figures = os.path.join(os.path.abspath(output_dir), "figures")
    os.makedirs(figures, exist_ok=True)

    def save(fig, name: str) -> None:
        fig.savefig(os.path.join(figures, f"{prefix}_{name}.png" if prefix else f"{name}.png"), dpi=dpi,
                    bbox_inches="tight")
    return save


def plot_times(df, x="size", y="time_us", hue="algorithm", title=None, ax=None):
    """Log-log lines of ``y`` against ``x`` per ``hue`` from a tidy DataFrame."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.5, 4), constrained_layout=True)
    else:
        fig = ax.figure
    for name, group in df.groupby(hue, sort=False):
        group = group.sort_values(x)
        ax.plot(group[x], group[y], marker="o", ms=3, label=name, color=color_of(name))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size per rank (bytes)" if x == "size" else x)
    ax.set_ylabel("time (µs)" if y == "time_us" else y)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return fig


def plot_speedup(df, baseline="builtin", title=None, ax=None):
    """Speed relative to ``baseline`` (its time / each algorithm's time) against size: above 1 is faster
    than the baseline. Shows crossovers that a log-log time plot squeezes together."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.5, 4), constrained_layout=True)
    else:
        fig = ax.figure
    times = df.pivot_table(index="size", columns="algorithm", values="time_us", sort=False)
    for name in times.columns:
        if name != baseline:
            ax.plot(times.index, times[baseline] / times[name], marker="o", ms=3, label=name, color=color_of(name))
    ax.axhline(1.0, color="gray", lw=1, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size per rank (bytes)")
    ax.set_ylabel(f"speed relative to {baseline}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return fig


TIMELINE_COLORS = {"compute": "tab:blue", "comm": "tab:orange", "wait": "tab:red"}


def plot_timeline(df, title=None, ax=None, colors=None):
    """A Gantt chart of traced intervals (``tplab.overlap.Tracer.gather()``: rank, lane, kind, start, end in
    seconds): one row per rank and lane (the main thread, the progress thread or a CUDA stream), bars
    coloured by kind (compute, comm, wait). What overlapped sits one above the other; red is time a
    rank stood still waiting for its communication."""
    colors = {**TIMELINE_COLORS, **(colors or {})}
    rows = sorted({(r, lane) for r, lane in zip(df["rank"], df["lane"])}, key=lambda k: (k[0], k[1] != "main", k[1]))
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.38 * len(rows) + 1.3), constrained_layout=True)
    else:
        fig = ax.figure
    row_of = {key: i for i, key in enumerate(rows)}
    kinds = [k for k in colors if k in set(df["kind"])] + sorted(set(df["kind"]) - set(colors))
    for kind in kinds:
        group = df[df["kind"] == kind]
        y = [row_of[(r, lane)] for r, lane in zip(group["rank"], group["lane"])]
        ax.barh(y, (group["end"] - group["start"]) * 1e3, left=group["start"] * 1e3, height=0.7,
                color=colors.get(kind, "tab:gray"), edgecolor="black", linewidth=0.3, label=kind)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} · {lane}" for r, lane in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    if title:
        ax.set_title(title)
    return fig


def plot_overlap_sweep(df, title=None, axes=None):
    """Two panels from ``tplab.overlap.overlap_sweep`` rows (one layer): left, the layer's time against the
    chunk count k -- overlapped, without overlap, compute alone (unchunked and chunked), and the pipeline
    model's prediction when present; right, the hidden fraction (1: all communication hidden, 0: none)."""
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(MAX_WIDTH, 4), constrained_layout=True)
    fig = axes[0].figure
    df = df.sort_values("chunks")
    k = df["chunks"]
    left, right = axes
    left.plot(k, df["overlapped_ms"], "o-", color="tab:green", label="overlapped (chunked, comm in flight)")
    left.plot(k, df["no_overlap_ms"], "--", color="tab:red", label="no overlap (the layer as it is)")
    left.plot(k, df["compute_ms"], "--", color="tab:blue", label="compute alone (collectives as no-ops)")
    left.plot(k, df["compute_chunked_ms"], ":", marker=".", color="tab:blue", label="compute alone, chunked")
    left.plot(k, df["compute_ms"] + df["comm_ms"], ":", color="gray", label="compute + comm alone")
    if "predicted_ms" in df:
        left.plot(k, df["predicted_ms"], "s", mfc="none", color="tab:green", label="pipeline model")
    left.set(xscale="log", xlabel="chunks k", ylabel="time per forward pass (ms)", ylim=(0, None))
    left.set_xticks(list(k), [str(v) for v in k])
    left.legend(fontsize=8)
    right.plot(k, df["hidden_fraction"], "o-", color="tab:green", label="measured")
    if "predicted_hidden_fraction" in df:
        right.plot(k, df["predicted_hidden_fraction"], "s--", mfc="none", color="tab:green", label="pipeline model")
    right.axhline(1, color="gray", lw=1)
    right.axhline(0, color="gray", lw=1, ls="--")
    right.axhline(0.75, color="tab:orange", lw=1, ls=":", label="goal: 75% hidden")
    right.set(xscale="log", xlabel="chunks k", ylabel="hidden fraction = 1 - exposed / comm alone")
    right.set_xticks(list(k), [str(v) for v in k])
    right.legend(fontsize=8)
    for ax in axes:
        ax.xaxis.set_minor_locator(plt.NullLocator())  # only the chunk counts on the log axis
        ax.grid(True, alpha=0.3)
    if title:
        suptitle(fig, title, fontsize=10)
    return fig


def plot_overlap_summary(df, title=None):
    """One panel per layer of ``scripts/gpu_overlap.py`` rows (e.g. ``block_mb``, ``stack_mb``): for each
    communication path, the time per layer without overlap (red) and overlapped at its best setting (green:
    the median over repeated sweeps of the fastest chunk count / tail / carveout), against the compute alone
    (blue line); each green bar says its k and hidden fraction. A stack's times are divided by its ``layers``."""
    df = df.copy()
    per_layer = df["layers"] if "layers" in df else 1
    for column in ("compute_ms", "no_overlap_ms", "overlapped_ms", "comm_ms"):
        df[column] = df[column] / per_layer
    keys = [c for c in ("path", "chunks", "tail", "gemm_sm_carveout") if c in df]
    layers = list(dict.fromkeys(df["layer"]))
    fig, axes = plt.subplots(1, len(layers), figsize=(min(5.5 * len(layers), MAX_WIDTH), 4), constrained_layout=True, squeeze=False)
    for ax, layer in zip(axes[0], layers):
        rows = df[df["layer"] == layer]
        median = rows.groupby(keys).median(numeric_only=True).reset_index()
        best = median.loc[median.groupby("path")["overlapped_ms"].idxmin()].reset_index(drop=True)
        x = np.arange(len(best))
        ax.bar(x - 0.2, best["no_overlap_ms"], 0.4, color="tab:red", label="no overlap")
        ax.bar(x + 0.2, best["overlapped_ms"], 0.4, color="tab:green", label="overlapped, best setting")
        ax.axhline(rows["compute_ms"].median(), color="tab:blue", ls="--", label="compute alone")
        for xi, row in best.iterrows():
            ax.annotate(f"k={row['chunks']:.0f}\nhidden {row['hidden_fraction']:.2f}", (xi + 0.2, row["overlapped_ms"]),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x, best["path"], fontsize=8)
        top = max(best["no_overlap_ms"].max(), best["overlapped_ms"].max())
        ax.set(ylabel="time per layer (ms)", title=layer, ylim=(0, top * 1.2))
        ax.legend(fontsize=8, loc="lower right")
    if title:
        suptitle(fig, title, fontsize=10)
    return fig
