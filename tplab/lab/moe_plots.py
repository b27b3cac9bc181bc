"""Notebook 09's figures (expert parallelism). Each function returns the Figure; the notebook saves it.

    dispatch_figure(record)                    before / dispatch step by step / what each rank computes
    combine_figure(record)                     the way back, step by step
    bytes_per_rank(wire)                       bytes counted on each rank against the formula's three parts
    alltoall_crossover(timings, machine, p)    pairwise vs Bruck measured and modelled; the crossover against p
    imbalance_training(history, p, text_name)  balance while training, and per expert and per rank at the end
    capacity_effects(capacity, p)              what each capacity factor drops, and the makespan that remains
    layer_phases(timeline, title)              a Gantt chart of one MoE layer, its phases named and coloured
    gpu_alltoall(gpu)                          the GPU reference: latency at decode sizes, bus bandwidth at prefill

Figures with several panels share one legend below them (every panel's lines are the same variants or
paths), so no panel is left without one. Router variants and all-to-all paths have their colours from
``tplab.lab.plots.color_of``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from tplab.lab.plots import MAX_WIDTH, color_of, plot_timeline, suptitle
from tplab.moe import imbalance, pictures


def _shared_legend(fig, ax, ncol=4):
    """The panels' one legend, centred under them (``ax``: a panel that has every line)."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=ncol, fontsize=8, frameon=False)


def _home_legend(fig, p):
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=pictures.home_color(r)) for r in range(p)]
    fig.legend(handles, [f"rank {r}" for r in range(p)], loc="outside lower center", ncol=p, fontsize=8,
               title="colour: the rank a token lives on", title_fontsize=8, frameon=False)


def dispatch_figure(record):
    p = record["p"]
    fig, axes = plt.subplots(1, 3, figsize=(MAX_WIDTH, 0.75 * p + 1.9), layout="constrained",
                             gridspec_kw={"width_ratios": [1.3, 2.4, 1.4]})
    pictures.draw_tokens(record, axes[0])
    pictures.draw_steps(record, axes[1], "dispatch")
    pictures.draw_experts(record, axes[2])
    _home_legend(fig, p)
    return fig


def combine_figure(record):
    p = record["p"]
    fig, ax = plt.subplots(figsize=(min(2.0 * p + 1.2, MAX_WIDTH), 0.75 * p + 1.7), layout="constrained")
    pictures.draw_steps(record, ax, "combine")
    _home_legend(fig, p)
    return fig


def bytes_per_rank(wire):
    """At the largest token count: what each rank's communicator counted (gray) next to the formula's
    dispatch, combine and count-exchange bytes, stacked."""
    last = wire[wire.tokens_per_rank == wire.tokens_per_rank.max()]
    fig, ax = plt.subplots(figsize=(8, 3.6), layout="constrained")
    kib = lambda column: last[column] / 1024
    ax.bar(last["rank"] - 0.2, kib("bytes_counted"), 0.4, label="counted", color="tab:gray")
    bottom = 0
    for column, label, color in [("dispatch_bytes", "formula: dispatch", "tab:orange"),
                                 ("combine_bytes", "formula: combine", "tab:blue"),
                                 ("counts_bytes", "formula: counts", "tab:green")]:
        ax.bar(last["rank"] + 0.2, kib(column), 0.4, bottom=bottom, label=label, color=color)
        bottom = bottom + kib(column)
    ax.set(xlabel="rank", ylabel="KiB sent per layer", xticks=sorted(last["rank"]),
           title=f"{last.tokens_per_rank.iloc[0]} tokens per rank, hidden 16, float64, 8 experts, top-2")
    ax.legend(fontsize=8, loc="lower right")
    return fig


def alltoall_crossover(timings, machine, p):
    """Left: pairwise exchange and Bruck on these ranks, measured (dots) and modelled with ``machine``
    (dashed). Right: the model's crossover size against the rank count, here and on an NVLink-like link."""
    from tplab.cost import Machine, crossover_bytes, predict

    fig, (left, right) = plt.subplots(1, 2, figsize=(MAX_WIDTH, 4.2), layout="constrained")
    sizes = np.logspace(np.log10(timings["size"].min()), np.log10(timings["size"].max()), 50)
    for algorithm, group in timings.groupby("algorithm"):
        left.plot(group["size"], group.time_us, "o", color=color_of(algorithm), label=f"{algorithm} (measured)")
        left.plot(sizes, [predict("alltoall", algorithm, p, s, machine) * 1e6 for s in sizes], "--",
                  color=color_of(algorithm), label=f"{algorithm} (model)")
    left.set(xscale="log", yscale="log", xlabel="bytes per rank (n)", ylabel="time (µs)", title=f"all-to-all on {p} ranks")
    left.legend(fontsize=8)
    ranks = np.arange(4, 65)
    for (name, m), style in zip([("these ranks", machine), ("NVLink-like: α = 5 µs, 1/β = 100 GB/s",
                                                            Machine(5e-6, 1e-11, 0.0))], ["-", ":"]):
        right.plot(ranks, [crossover_bytes(int(q), m) / 1024 for q in ranks], style, color="black", label=name)
    right.set(xlabel="ranks p", ylabel="crossover n (KiB per rank)", yscale="log", title="below the line Bruck wins (model)")
    right.legend(fontsize=8)
    return fig


def imbalance_training(history, p, text_name="the text"):
    """Three panels of ``experiments.train_variant`` histories, one colour per router variant: max/mean
    tokens per expert while training; each expert's share of the assignments at the end; each rank's share
    (its experts' together). Dotted: a perfect balance."""
    final = history[history.step == history.step.max()].set_index("variant")
    fig, axes = plt.subplots(1, 3, figsize=(MAX_WIDTH, 4.3), layout="constrained")
    for variant, group in history.groupby("variant", sort=False):
        axes[0].plot(group.step, group.imbalance, marker="o", ms=3, color=color_of(variant), label=variant)
    axes[0].axhline(1, color="black", lw=1, ls=":", label="perfect balance")
    axes[0].set(xlabel="training step", ylabel="max / mean tokens per expert", title="balance while training")
    width = 0.8 / len(final)
    for i, (variant, row) in enumerate(final.iterrows()):
        counts = np.array(row.tokens_per_expert)
        experts = np.arange(len(counts))
        axes[1].bar(experts + (i + 0.5) * width - 0.4, counts / counts.sum(), width, color=color_of(variant))
        per_rank = imbalance.per_rank(counts, p).numpy()
        axes[2].bar(np.arange(p) + (i + 0.5) * width - 0.4, per_rank / counts.sum(), width, color=color_of(variant))
    axes[1].axhline(1 / len(counts), color="black", lw=1, ls=":")
    axes[1].set(xlabel="expert", ylabel="share of the assignments", xticks=experts,
                title=f"per expert, after {history.step.max()} steps")
    axes[2].axhline(1 / p, color="black", lw=1, ls=":")
    axes[2].set(xlabel="rank (its experts together)", ylabel="share of the work", xticks=range(p),
                title=f"per rank, {p} ranks of experts")
    _shared_legend(fig, axes[0], ncol=5)
    suptitle(fig, f"routers trained on {text_name}", fontsize=10)
    return fig


def capacity_effects(capacity, p):
    """Two panels of ``experiments.train_variant`` capacity sweeps, one colour per router variant: the share
    of assignments each capacity factor drops, and the busiest rank's work over the mean that remains."""
    fig, axes = plt.subplots(1, 2, figsize=(MAX_WIDTH, 4.2), layout="constrained")
    for variant, group in capacity.groupby("variant", sort=False):
        finite = group[group.capacity_factor.notna()]
        axes[0].plot(finite.capacity_factor, 100 * finite.dropped_fraction, marker="o", color=color_of(variant),
                     label=variant)
        axes[1].plot(finite.capacity_factor, finite.makespan / finite.balanced, marker="o", color=color_of(variant))
    axes[1].axhline(1, color="black", lw=1, ls=":", label="perfect balance")
    axes[0].set(xlabel="capacity factor", ylabel="assignments dropped (%)", title="what capacity drops")
    axes[1].set(xlabel="capacity factor", ylabel="makespan / balanced", title=f"busiest of {p} ranks vs the mean")
    handles, labels = axes[0].get_legend_handles_labels()
    more, more_labels = axes[1].get_legend_handles_labels()
    fig.legend(handles + more, labels + more_labels, loc="outside lower center", ncol=5, fontsize=8, frameon=False)
    return fig


# One MoE layer's phases (tplab.moe.ExpertParallelMoE's spans), in the order they run: the two all-to-alls in
# the warm colours of communication, the local work in blues.
PHASES = {"route": ("route (router, top-k)", "lightsteelblue"),
          "count": ("count exchange (all-gather)", "gold"),
          "dispatch": ("dispatch (all-to-all-v)", "tab:orange"),
          "experts": ("experts (compute)", "tab:blue"),
          "combine": ("combine (all-to-all-v)", "tab:red")}


def layer_phases(timeline, title=None):
    """A Gantt chart of one traced expert-parallel layer (``experiments.traced_layer``): a row per rank, a
    bar per phase, coloured and named in the legend; bars wide enough also carry their phase's name."""
    df = timeline.assign(kind=[PHASES.get(n, (n, None))[0] for n in timeline["name"]])
    colors = {label: color for label, color in PHASES.values()}
    ranks = df["rank"].nunique()
    fig, ax = plt.subplots(figsize=(10, 0.45 * ranks + 1.9), layout="constrained")
    plot_timeline(df, title=title, ax=ax, colors=colors)
    ax.get_legend().remove()
    span = (df["end"].max() - df["start"].min()) * 1e3
    rows = {r: i for i, r in enumerate(sorted(df["rank"].unique()))}  # plot_timeline's rows: one lane per rank
    for row in df.itertuples():
        width = (row.end - row.start) * 1e3
        if width > 0.09 * span:  # room for the name: write it on the bar
            ax.text((row.start + row.end) / 2 * 1e3, rows[row.rank], row.name, ha="center", va="center", fontsize=8,
                    color="white" if row.name in ("experts", "combine") else "black")
    _shared_legend(fig, ax, ncol=5)
    return fig


def gpu_alltoall(gpu):
    """``scripts/gpu_alltoall.py`` rows: time at decode sizes (left) and bus bandwidth at prefill sizes
    (right), one colour per path."""
    fig, axes = plt.subplots(1, 2, figsize=(MAX_WIDTH, 4.4), layout="constrained")
    for name, group in gpu.groupby("path"):
        decode = group[group.phase == "decode"]
        prefill = group[group.phase == "prefill"]
        axes[0].plot(decode.tokens, decode.time_us, marker="o", color=color_of(name), label=name)
        axes[1].plot(prefill["size"] / 2**20, prefill.busbw, marker="o", color=color_of(name))
    axes[0].set(xscale="log", xlabel="tokens per destination (hidden 4096, bf16)", ylabel="time (µs)",
                title="decode: latency")
    axes[1].set(xscale="log", xlabel="MiB per rank", ylabel="bus bandwidth (GB/s)", title="prefill: bandwidth")
    _shared_legend(fig, axes[0], ncol=5)
    return fig
