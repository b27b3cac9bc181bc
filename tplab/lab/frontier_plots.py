"""Figures of notebook 03's last GPU sections: a small all-reduce waiting for its agreement and its data
together, two_shot agreeing in its first barrier, the data as its own flag (one-shot and two-shot), and what the
links carry at most
next to what the large all-reduces get. Same conventions as ``reference_plots`` (one question per figure, the
algorithms in their ``color_of`` colours).

    waiting_together(parts[, runs])      one_shot_ll before and after, A/B runs on 4 GPUs, and its floor
    first_barrier_agrees(ab, frontier)   two_shot agreeing first against agreeing in its first barrier, and torch's
    data_as_its_own_flag(parts, frontier)  one_shot_lamport against one_shot_ll, then against the others
    two_shot_without_barriers(frontier)  two_shot_lamport against two_shot, one_shot_lamport and torch's two-shot
    link_ceiling(ceiling, allreduces)    GB/s out of each GPU: the wire alone, and three all-reduces' bus bandwidth
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from tplab.lab.plots import MAX_WIDTH, color_of

# (stage prefix in gpu_allreduce_time_parts_*.csv, title, ((stage key, label, line style), ...)): each panel
# is one run, its rounds interleaved
RUNS = (
    ("4 GPUs, run 1", "run 1: blocks of 128 threads", (
        ("agreement first, then the data", "the agreement first, then the data", "--"),
        ("agreement and first lines in the same trips", "everything in the same trips", "-"))),
    ("4 GPUs, run 4", "run 4: blocks of 64 threads", (
        ("agreement and first lines in the same trips", "everything in the same trips", "--"),
        ("and block 0 reads the outcomes itself", "and no thread-0 verdict step", "-"))),
)
# a later A/B (one panel): the blocks other than 0 waiting for block 0's verdict, or reading the signatures
BLOCKS_ALONE = (
    ("2026-11-27 A/B", "A/B: who reads the agreement", (
        ("before (", "the other blocks wait for block 0's verdict", "--"),
        ("after (", "every block reads the signatures itself", "-"))),
)
SIZES = (1 << 10, 16 << 10, 64 << 10, 256 << 10)


def _median_by_size(rows):
    return rows.groupby("size").graph_us.median()


def _by_size(ax, sizes, legend_size=7.5):
    """Every panel's finish: the sizes as ticks (KiB, MiB), no minor ticks, a grid, the legend."""
    ax.set_xticks(sizes, [f"{s >> 10} KiB" if s < 1 << 20 else f"{s >> 20} MiB" for s in sizes])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


def waiting_together(parts, runs=RUNS):
    """one_shot_ll on 4 GPUs from CUDA graphs, per call, the median over interleaved rounds of one run per
    panel (each panel its own scale). ``RUNS``: waiting for the agreement and then the data, against everything
    in the same trips (left), and against block 0 deciding without thread 0's verdict step (right);
    ``BLOCKS_ALONE``: the other blocks waiting for block 0's verdict, against every block reading the peers'
    signatures itself. Teal: with the agreement; grey: the same kernel with no agreement at all (the ranks
    agreed beforehand)."""
    fig, axes = plt.subplots(1, len(runs), figsize=(min(5.5 * len(runs), MAX_WIDTH), 4.2), squeeze=False,
                             constrained_layout=True)
    ll = color_of("one_shot_ll")
    for ax, (run, title, stages) in zip(axes[0], runs):
        in_run = parts[(parts.ranks == 4) & parts.stage.str.startswith(run) & (parts.kernel == "one_shot_ll")]
        for key, label, style in stages:
            rows = in_run[in_run.stage.str.contains(key, regex=False)]
            for agreed, color, what in ((True, ll, label), (False, "0.55", f"{label}, no agreement")):
                line = _median_by_size(rows[rows.agreement == agreed])
                ax.plot(line.index, line.values, style, marker="o" if agreed else ".", color=color, label=what)
        ax.set(xscale="log", xlabel="bytes per rank", title=title, ylim=(0, None))
        _by_size(ax, SIZES)
    axes[0][0].set_ylabel("µs per all-reduce (CUDA graph)")
    fig.suptitle("one_shot_ll on 4x H100, per call", fontsize=10)
    return fig


def first_barrier_agrees(ab, frontier):
    """two_shot on 4 GPUs from CUDA graphs, per call (``ab``: gpu_two_shot_early_*.csv, the median over its
    interleaved rounds): the kernel that agrees before it pushes (dashed) against the one that pushes first
    and takes the agreement in its first barrier (solid), up to 4 MiB, with tplab on an input already in its
    shared buffer (peer_registered, where a frontier run has it), torch's symmetric-memory two-shot and NCCL's
    symmetric kernels from a frontier run (``frontier``: tplab bench rows, another machine of the kind)."""
    fig, ax = plt.subplots(figsize=(min(7.5, MAX_WIDTH), 4.0), constrained_layout=True)
    ab = ab[ab["size"] <= 4 << 20]
    for key, label, style in (("before", "tplab two_shot: agree, then push", "--"),
                              ("after", "tplab two_shot: push, agree in the first barrier", "-")):
        line = _median_by_size(ab[ab.variant.str.startswith(key)])
        ax.plot(line.index, line.values, style, marker="o", ms=4, color=color_of("two_shot"), label=label)
    graph = frontier[(frontier["mode"] == "graph") & frontier["size"].between(ab["size"].min(), ab["size"].max())]
    for anchor, label in (("peer_registered", "tplab auto, input already in the shared buffer (frontier run)"),
                          ("symm_mem_two_shot", "torch symm_mem two-shot (frontier run)"),
                          ("nccl_symmetric", "NCCL symmetric kernels (frontier run)")):
        rows = graph[graph.algorithm == anchor].groupby("size").time_us.median()
        ax.plot(rows.index, rows.values, ":", marker=".", color=color_of(anchor), label=label)
    sizes = sorted(ab["size"].unique())
    ax.set(xscale="log", xlabel="bytes per rank", ylabel="µs per all-reduce (CUDA graph)", ylim=(0, None),
           title="two_shot on 4x H100: one meeting fewer")
    _by_size(ax, sizes, legend_size=8)
    return fig


LAMPORT_STAGE = "2026-11-27: one_shot_lamport added, 4 GPUs, 64 threads"


def data_as_its_own_flag(parts, frontier):
    """Left: one_shot_ll and one_shot_lamport on 4 GPUs, the kernel alone from CUDA graphs (``parts``:
    gpu_allreduce_time_parts_*.csv, the LAMPORT_STAGE run), with the agreement (solid) and without it (dotted).
    Right: tplab's kernels next to torch's symmetric-memory two-shot and NCCL's symmetric kernels up to 1 MiB
    (``frontier``: one start of a frontier run, tplab bench rows from CUDA graphs)."""
    fig, axes = plt.subplots(1, 2, figsize=(MAX_WIDTH, 4.2), constrained_layout=True)
    ax = axes[0]
    run = parts[(parts.stage == LAMPORT_STAGE)]
    for kernel, label in (("one_shot_ll", "one_shot_ll: tagged lines, 2x the bytes"),
                          ("one_shot_lamport", "one_shot_lamport: the data is its flag")):
        for agreed, style, what in ((True, "-", label), (False, ":", f"{kernel}, no agreement")):
            line = _median_by_size(run[(run.kernel == kernel) & (run.agreement == agreed)])
            ax.plot(line.index, line.values, style, marker="o" if agreed else ".", color=color_of(kernel), label=what)
    ax.set(xscale="log", xlabel="bytes per rank", ylabel="µs per all-reduce (CUDA graph)", ylim=(0, None),
           title="the kernel alone, one machine")
    _by_size(ax, SIZES)
    ax = axes[1]
    graph = frontier[(frontier["mode"] == "graph") & (frontier["size"] <= 1 << 20)]
    for name, label in (("peer_one_shot_lamport", "tplab one_shot_lamport"), ("peer_one_shot_ll", "tplab one_shot_ll"),
                        ("peer_two_shot", "tplab two_shot"), ("symm_mem_two_shot", "torch symm_mem two-shot"),
                        ("nccl_symmetric", "NCCL symmetric kernels")):
        rows = graph[graph.algorithm == name].groupby("size").time_us.median()
        ax.plot(rows.index, rows.values, "-" if name.startswith("peer_") else "--", marker=".",
                color=color_of(name), label=label)
    sizes = sorted(graph["size"].unique())[::2]
    ax.set(xscale="log", xlabel="bytes per rank", ylabel="µs per all-reduce (CUDA graph)", ylim=(0, None),
           title="next to the others, another machine")
    _by_size(ax, sizes)
    fig.suptitle("small all-reduces on 4x H100: the data as its own flag", fontsize=10)
    return fig



def two_shot_without_barriers(frontier):
    """One frontier run on 4 GPUs (``frontier``: tplab bench rows, CUDA graphs), 64 KiB to 4 MiB: tplab's
    two_shot_lamport (the two-shot's pushes, each half waiting for its data) against its two_shot (two barriers)
    and one_shot_lamport (the data as its flag, 3x the input out of each GPU at p = 4), solid, with torch's
    symmetric-memory two-shot and NCCL's symmetric kernels dashed; where a Lamport kernel's area ends, its line
    ends with a note."""
    fig, ax = plt.subplots(figsize=(min(8.0, MAX_WIDTH), 4.4), constrained_layout=True)
    graph = frontier[(frontier["mode"] == "graph") & frontier["size"].between(64 << 10, 4 << 20)]
    for name, label, marker in (("peer_two_shot_lamport", "tplab two_shot_lamport: no barrier", "o"),
                                ("peer_two_shot", "tplab two_shot: two barriers", "^"),
                                ("peer_one_shot_lamport", "tplab one_shot_lamport: 3x the input out", "."),
                                ("symm_mem_two_shot", "torch symm_mem two-shot", "s"),
                                ("nccl_symmetric", "NCCL symmetric kernels", ".")):
        rows = graph[graph.algorithm == name].groupby("size").time_us.median()
        ax.plot(rows.index, rows.values, "-" if name.startswith("peer_") else "--", marker=marker, ms=5,
                color=color_of(name), label=label)
        if name.endswith("_lamport") and not rows.empty and rows.index.max() < graph["size"].max():
            offset = (-75, 8) if name == "peer_one_shot_lamport" else (6, -12)   # (clear of the other lines)
            ax.annotate("its area ends", (rows.index.max(), rows.values[-1]), xytext=offset,
                        textcoords="offset points", fontsize=8, color=color_of(name))
    sizes = sorted(graph["size"].unique())
    ax.set(xscale="log", xlabel="bytes per rank", ylabel="µs per all-reduce (CUDA graph)", ylim=(0, None),
           title="4x H200, one frontier run: solid tplab, dashed the other libraries")
    _by_size(ax, sizes, legend_size=8)
    return fig

def link_ceiling(ceiling, allreduces):
    """GB/s out of each GPU while every GPU sends to every peer at once (gpu_link_ceiling_*.csv: copy engines,
    SM loads, SM stores; the best grid of each, the median of the rounds) and to one peer only, next to the
    bus bandwidth of the 256 MiB all-reduces timed on the same machine (``allreduces``: tplab bench rows)."""
    fig, ax = plt.subplots(figsize=(min(8.0, MAX_WIDTH), 3.8), constrained_layout=True)
    labels, values, colors = [], [], []
    names = {("copy_engine", "push"): "copy engines, writes", ("copy_engine", "pull"): "copy engines, reads",
             ("sm", "push"): "SM stores", ("sm", "pull"): "SM loads", ("sm_4_per_thread", "push"): "SM stores, 4 in flight"}
    shades = {"to all peers at once": "0.3", "to one peer": "0.6"}
    for peers, where in ((ceiling.peers_at_once.max(), "to all peers at once"), (1, "to one peer")):
        rows = ceiling[ceiling.peers_at_once == peers]
        best = rows.groupby(["method", "direction", "blocks"]).GBps_per_gpu.median().groupby(level=[0, 1]).max()
        for (method, direction), gbps in best.sort_values().items():
            labels.append(f"{names.get((method, direction), method)}, {where}")
            values.append(gbps)
            colors.append(shades[where])
    names_of = {"peer_ring": "tplab's ring", "peer_two_shot": "tplab's two_shot", "nccl": "NCCL"}
    for algorithm, rows in allreduces.groupby("algorithm"):
        labels.append(f"all-reduce of 256 MiB, {names_of.get(algorithm, algorithm)}: bus bandwidth")
        values.append(rows.busbw.median())
        colors.append(color_of(algorithm))
    ax.barh(range(len(values)), values, color=colors)
    ax.set_yticks(range(len(values)), labels, fontsize=8)
    ax.invert_yaxis()
    top = max(v for v, label in zip(values, labels) if "all peers" in label)
    ax.axvline(top, color="0.3", ls="--", lw=1)
    ax.legend(handles=[Patch(color=shade, label=f"the wire alone, {where}") for where, shade in shades.items()],
              fontsize=8, loc="upper center", bbox_to_anchor=(0.4, -0.16), ncol=2)
    ax.set(xlabel="GB/s out of each GPU (4x H100)",
           title=f"the wire's ceiling ({top:.0f} GB/s, dashed) and the all-reduces")
    ax.grid(alpha=0.3, axis="x")
    return fig
