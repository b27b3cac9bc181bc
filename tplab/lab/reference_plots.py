"""Figures of the notebooks' reference sections (measurements in ``data/``): one question per figure, at most
three panels, the algorithms and paths in their colours from ``tplab.lab.plots.color_of``. Each function
returns the Figure; the notebook saves and shows it.

    allreduce_at(group, ranks, vendor)        01/03: at p ranks, time and speed relative to the library's all-reduce
    models_at(d, dtype)                       04: a Llama-shaped model's forward pass and generation against TP degree
    sp_strong_scaling(strong, project, dtypes) 05: the layer's speedup on p GPUs, per path and scheme
    sp_components(parts)                      05: one all-gather's pieces (staged vs direct)
    sp_before_after(before, after, dtype)     05: the layer's speedup per scheme and path, two runs
    speedup_over_round_robin(speedup, ranks)  07: each strategy's makespan gain, one panel per TP degree
    pipeline_bubbles(ref, ranks)              07: the measured bubble against the two formulas, per layout
    strategies_gantt(intervals, names, p)     07: what every rank ran under each of up to three strategies
    allreduce_time_parts(parts, after, before) 03: a small GPU all-reduce's time, the agreement's share, the anchors
    two_shot_pushes(parts)                    03: two_shot pulling its results against pushing them
    async_tp_layer(rows)                      06: a layer of a stack: plain, sequence-parallel, async TP
    frontier_before_after(before, after)      03: small all-reduces from graphs, tplab's best in two runs, the anchors
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from tplab.lab.plots import MAX_WIDTH, color_of, plot_speedup, plot_times
from tplab.lab.plots import suptitle as set_suptitle


def _row(n, width=5.5, height=4.0):
    fig, axes = plt.subplots(1, n, figsize=(min(width * n, MAX_WIDTH), height), constrained_layout=True, squeeze=False)
    return fig, list(axes[0])


def allreduce_at(group, ranks, vendor, suptitle=None):
    """At ``ranks`` ranks: which algorithm is fastest at each size (left), and by how much it beats the
    library's own all-reduce (right, above 1: faster)."""
    fig, (left, right) = _row(2)
    plot_times(group, ax=left, title=f"{ranks} ranks: time")
    plot_speedup(group, ax=right, title=f"{ranks} ranks: speed relative to {vendor}")
    if suptitle:
        set_suptitle(fig, suptitle)
    return fig


def models_at(d, dtype, suptitle=None):
    """One dtype: does the forward pass get faster with more GPUs (left), and does generation (right)?"""
    fig, (forward, generation) = _row(2, width=6.0)
    gpus = sorted(d["gpus"].unique())
    for setting, g in d.groupby("setting"):
        g = g.sort_values("gpus")
        forward.plot(g["gpus"], g["forward_ms"], "o-", color=color_of(setting), label=setting)
        if g["tokens_per_s"].notna().any():
            generation.plot(g["gpus"], g["tokens_per_s"], "o-", color=color_of(setting), label=setting)
    one = d[d["gpus"] == 1]["unsplit_forward_ms"].dropna()
    if len(one):
        forward.axhline(one.iloc[0], color="gray", ls=":", label="unsplit, 1 GPU")
    first = d.iloc[0]
    forward.set(title=f"{dtype}: forward, batch {first.batch} × {first.seq} tokens, {first.layers} blocks",
                xlabel="GPUs (TP degree)", ylabel="ms", xticks=gpus)
    generation.set(title=f"{dtype}: greedy generation", xlabel="GPUs (TP degree)", ylabel="tokens / s", xticks=gpus)
    for ax in (forward, generation):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
    if suptitle:
        set_suptitle(fig, suptitle)
    return fig


def sp_strong_scaling(strong, project, dtypes, suptitle=None):
    """Per dtype (at most three): the layer's speedup over one GPU, a colour per scheme, staged paths dashed,
    direct ones solid, next to the mpi4py project's measurement."""
    dtypes = list(dtypes)[:3]
    fig, axes = _row(len(dtypes), width=6.0, height=4.2)
    top = strong.p.max()
    for ax, dtype in zip(axes, dtypes):
        for (path, scheme), group in strong[strong.dtype == dtype].groupby(["path", "scheme"]):
            group = group.sort_values("p")  # colour: the scheme; line: staged dashed; marker: the transport
            ax.plot(group.p, group.speedup, marker="s" if "nccl" in path else "^" if "mpi" in path else "o",
                    ls="--" if path.startswith("staged") else "-", color=color_of(scheme), label=f"{path} / {scheme}")
        ax.plot(project.p, project.speedup, "k*:", ms=10, label="mpi4py project (staged)")
        ax.plot([1, top], [1, top], color="gray", lw=1)
        ax.set(xlabel="GPUs p", ylabel="speedup vs the layer on 1 GPU", title=f"strong scaling, {dtype}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if suptitle:
        set_suptitle(fig, suptitle)
    return fig


def sp_components(parts, suptitle=None):
    """Where the time of one staged all-gather goes, piece by piece, next to the direct one."""
    fig, (ax,) = _row(1, width=7.5, height=4.2)
    pivot = parts.pivot_table(index=["p", "dtype"], columns="component", values="time_s") * 1e3
    pivot.plot.bar(ax=ax, color=[color_of(c) for c in pivot.columns], rot=0)
    ax.set(ylabel="ms", yscale="log", title="one all-gather of K (or V), in pieces")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    if suptitle:
        set_suptitle(fig, suptitle)
    return fig


def sp_before_after(before, after, dtype="bfloat16"):
    """Strong scaling at the largest p of each run, in ``dtype``: the layer's speedup over one GPU per scheme
    and path, in a run ``before`` a change (faint) and one ``after`` it (rows of gpu_sequence_parallel.py's
    CSV, each with its own one-GPU time); the grey line is p, every GPU busy and nothing exposed."""
    fig, (ax,) = _row(1, width=8.5, height=4.6)
    labels, p = [], 1
    for when, frame, alpha in (("before", before, 0.45), ("after", after, 1.0)):
        layer = frame[(frame.kind == "layer") & (frame.dtype == dtype) & (frame["mode"] == "strong")]
        layer = layer[layer.p == layer.p.max()].drop_duplicates(["scheme", "path"], keep="last")
        layer = layer[~layer.path.str.startswith("staged")].sort_values(["scheme", "path"])
        p = max(p, int(layer.p.max()))
        for row in layer.itertuples():
            ax.barh(len(labels), row.speedup, color=color_of(row.scheme), alpha=alpha)
            ax.text(row.speedup, len(labels), f" {row.speedup:.2f}x", va="center", fontsize=8)
            labels.append(f"{row.scheme} / {row.path}, {when}")
    ax.axvline(p, color="0.5", lw=1)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel=f"speedup over the layer on one GPU ({dtype})", xlim=(0, p * 1.15),
           title=f"the layer on {p} GPUs, before and after")
    ax.grid(alpha=0.3, axis="x")
    return fig


def speedup_over_round_robin(speedup, ranks, suptitle=None):
    """At ``ranks`` ranks: each strategy's makespan gain over round-robin per workload, one panel per TP
    degree (``speedup``: rows (ranks, tp, distribution), one column per strategy)."""
    mine = speedup.xs(ranks, level="ranks")
    tps = list(dict.fromkeys(mine.index.get_level_values("tp")))[:3]
    fig, axes = _row(len(tps), width=5.5, height=3.6)
    for ax, t in zip(axes, tps):
        table = mine.xs(t, level="tp")
        table.plot.bar(ax=ax, rot=0, color=[color_of(s) for s in table.columns], legend=ax is axes[0])
        ax.axhline(1, color="gray", lw=1)
        ax.set(ylabel="speed-up over round-robin", xlabel="", title=f"{ranks} ranks, tp {t}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, ncol=2)
    if suptitle:
        set_suptitle(fig, suptitle)
    return fig


def pipeline_bubbles(ref, ranks, suptitle=None):
    """At ``ranks`` ranks, per layout (stages × tp): the measured bubble against (p-1)/(m+p-1) and against
    the formula for unequal micro-batches, for micro-batches by count and balanced by cost."""
    from tplab.balance.pipeline import (
        gpipe_bubble,  # (here: tplab.balance brings torch)
    )

    layouts = list(ref[ref.ranks == ranks].groupby(["stages", "tp"]))[:3]
    fig, axes = _row(len(layouts), width=5.5, height=3.6)
    for ax, ((stages, t), group) in zip(axes, layouts):
        med = group.groupby(["micro_batching", "m"]).median(numeric_only=True).reset_index()
        ms = np.arange(1, med.m.max() + 1)
        ax.plot(ms, [gpipe_bubble(stages, int(m)) for m in ms], "k-", label="(p-1)/(m+p-1)")
        for rule, g in med.groupby("micro_batching"):
            ax.plot(g.m, g.bubble, "o-", color=color_of(rule), label=f"measured, {rule}")
            ax.plot(g.m, g.bubble_unequal_formula, "x--", color=color_of(rule), label=f"from Σc + (p-1)·max c, {rule}")
        ax.set(xscale="log", xlabel="micro-batches m", ylabel="bubble", ylim=(0, 1),
               title=f"{stages} stages x tp {t} ({ranks} ranks)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if suptitle:
        set_suptitle(fig, suptitle)
    return fig


def strategies_gantt(intervals, names, p):
    """Up to three strategies, one Gantt chart each, on a shared time axis: who ran what, when."""
    from tplab.balance import plot_gantt

    names = list(names)[:3]
    fig, axes = plt.subplots(len(names), 1, figsize=(MAX_WIDTH, len(names) * (0.35 * p + 0.9)), constrained_layout=True,
                             sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        mine = intervals[intervals.strategy == name]  # work bars, and the queue's waits as hatched strips
        plot_gantt(mine, color_by="item", ax=ax, title=f"{name}: makespan {mine[mine.what == 'forward'].end.max():.3f} s")
    return fig


def allreduce_time_parts(parts, after=None, before=None):
    """Where a small GPU all-reduce's time went (CUDA-graph replays, gpu_allreduce_time_parts_*.csv). Left, on
    2 GPUs: one_shot_ll alone, and with the ranks' argument agreement sent as flag-and-release or as tagged
    lines, and with every peer's lines read at once and programmatic launch (a later run on another 2-GPU
    machine); the agreement alone and an empty kernel as levels. Right, on 4 GPUs: tplab's one-shots now (solid)
    and before (``before``: a frontier run's graph rows, dashed) against NCCL's symmetric kernels and torch's
    symmetric-memory two-shot of the same run (``after``)."""
    fig, (left, right) = _row(2, height=4.2)
    two = parts[parts.ranks == 2]
    ll = color_of("one_shot_ll")
    for stage, style in (("agreement by release flags", "--"), ("agreement by tagged lines", "-"),
                         ("and programmatic launch", "-.")):
        rows = two[(two.stage == stage) & (two.kernel == "one_shot_ll") & two.agreement].sort_values("size")
        left.plot(rows["size"], rows.graph_us, style, marker="o", color=ll, label=f"one_shot_ll, {stage}")
        alone = two[(two.stage == stage) & (two.kernel == "agree_only")].graph_us
        if len(alone):
            left.axhline(alone.iloc[0], ls=style, color="0.45", lw=1,
                         label=f"the agreement alone, {stage.removeprefix('agreement by ')}")
    kernel_alone = two[(two.stage == "agreement by tagged lines") & (two.kernel == "one_shot_ll") & ~two.agreement]
    kernel_alone = kernel_alone.sort_values("size")
    left.plot(kernel_alone["size"], kernel_alone.graph_us, ":", marker=".", color=ll, label="one_shot_ll, no agreement")
    empty = two[two.kernel == "empty kernel"].graph_us
    if len(empty):
        left.axhline(empty.iloc[0], color="0.75", lw=1, label="an empty kernel")
    shown = two[two.kernel.isin(["one_shot_ll", "agree_only", "empty kernel"])].graph_us
    left.set(title="2 GPUs: what the argument agreement costs", ylim=(0, 1.5 * shown.max()))
    four = parts[(parts.ranks == 4) & (parts.stage == "final") & parts.agreement]
    for kernel in ("one_shot", "one_shot_ll"):
        rows = four[four.kernel == kernel].sort_values("size")
        right.plot(rows["size"], rows.graph_us, "-", marker="o", color=color_of(kernel), label=f"{kernel}, after")
    for frame, names, style, when in ((before, ["peer_one_shot"], "--", "before"),
                                      (after, ["nccl_symmetric", "symm_mem_two_shot"], "-", "same run")):
        if frame is None:
            continue
        graph = frame[(frame["mode"] == "graph") & (frame["size"] <= 256 << 10)]
        for name in names:
            rows = graph[graph.algorithm == name].groupby("size").time_us.min()
            right.plot(rows.index, rows.values, style, marker="s", ms=4, color=color_of(name), label=f"{name}, {when}")
    right.set(title="4 GPUs: tplab's one-shots and the strongest others")
    right.set_ylim(0, None)
    for ax in (left, right):
        ax.set(xscale="log", xlabel="bytes per rank", ylabel="µs per all-reduce (CUDA graph)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return fig


def two_shot_pushes(parts):
    """two_shot on 2 GPUs from CUDA graphs (gpu_allreduce_time_parts_*.csv, one run): pulling the results
    (three barriers) against pushing them (two), and with programmatic launch; one_shot of the same run."""
    fig, (ax,) = _row(1, width=7.0, height=4.0)
    two = parts[(parts.ranks == 2) & parts.agreement]
    first = "tagged lines, same run as the next"
    for stage, style, what in ((first, "--", "pull the results, 3 barriers"),
                               ("lines read at once, no fences", "-", "push the results, 2 barriers"),
                               ("and programmatic launch", "-.", "push, programmatic launch")):
        rows = two[(two.stage == stage) & (two.kernel == "two_shot")].sort_values("size")
        ax.plot(rows["size"], rows.graph_us, style, marker="o", color=color_of("two_shot"), label=f"two_shot: {what}")
    rows = two[(two.stage == first) & (two.kernel == "one_shot")].sort_values("size")
    ax.plot(rows["size"], rows.graph_us, "--", marker="o", color=color_of("one_shot"), label="one_shot (the same run)")
    ax.set(xscale="log", xlabel="bytes per rank", ylabel="µs per all-reduce (CUDA graph)", ylim=(0, None),
           title="2 GPUs: two_shot before and after")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return fig


def frontier_before_after(before, after):
    """Small all-reduces from CUDA graphs (tplab bench --graph rows of two runs on the same kind of machine):
    tplab's fastest kernel per size in the run ``before`` a change (dashed) and ``after`` it (solid), with the
    anchors of the run after (NCCL, NCCL's symmetric kernels, torch's symmetric-memory two-shot)."""
    fig, (ax,) = _row(1, width=7.5, height=4.0)
    for when, frame, style in (("before", before, "--"), ("after", after, "-")):
        graph = frame[frame["mode"] == "graph"]
        best = graph[graph.algorithm.str.startswith("peer_")].groupby("size").time_us.min()
        ax.plot(best.index, best.values, style, marker="o", ms=3, color=color_of("tplab.allreduce"),
                label=f"tplab, fastest kernel ({when})")
    graph = after[after["mode"] == "graph"]
    for anchor in ("nccl_symmetric", "symm_mem_two_shot", "nccl"):
        rows = graph[graph.algorithm == anchor].sort_values("size")
        if len(rows):
            ax.plot(rows["size"], rows.time_us, marker=".", color=color_of(anchor), label=anchor)
    ranks = int(after.ranks.iloc[0])
    ax.set(xscale="log", xlabel="bytes per rank", ylabel="µs per all-reduce (CUDA graph)", ylim=(0, None),
           title=f"{ranks} GPUs: small all-reduces, before and after")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return fig


ASYNC_TP_BARS = [  # (variant of scripts/gpu_async_tp.py, label, colour)
    ("compute", "compute alone (collectives as no-ops)", "tab:blue"),
    ("plain_nccl", "plain layer, NCCL all-reduces", color_of("torch.distributed")),
    ("sequence_parallel", "sequence parallel, NCCL (no overlap)", "tab:gray"),
    ("async_no_transfers", "async TP, nothing moving, attention cut", "tab:cyan"),
    ("async_no_transfers_whole_attention", "async TP, nothing moving, attention whole", "tab:cyan"),
    ("async_tp_all_peers_at_once", "async TP, copies to every peer at once", color_of("copy_engine")),
    ("async_tp", "async TP, attention cut, one peer at a time", color_of("copy_engine")),
    ("async_tp_whole_attention", "async TP, attention whole", color_of("copy_engine")),
]
HATCHES = {"async_tp_all_peers_at_once": "//",   # the same algorithm as async_tp, its exchange run another way
           "async_tp_whole_attention": "..", "async_no_transfers_whole_attention": ".."}   # (attention in one call)


def async_tp_layer(rows):
    """One layer of a stack (async_tp_gpu_*.csv; the median over its runs, the whiskers their range): each
    variant's time, split into the plain layer's compute and what it adds; the target line at compute + 10%
    of NCCL's communication alone."""
    fig, (ax,) = _row(1, width=8.5, height=4.0)
    layer = rows[rows.layers == rows.layers.max()].groupby("variant")["ms_per_layer"]
    stack, low, high = layer.median(), layer.min(), layer.max()
    compute, comm = stack["compute"], stack["nccl_comm"]
    bars = [(v, label, colour) for v, label, colour in ASYNC_TP_BARS if v in stack.index]
    for i, (variant, _, colour) in enumerate(bars):
        hatch = HATCHES.get(variant)
        ax.barh(i, min(stack[variant], compute), color=colour, alpha=0.35, hatch=hatch)  # (the plain compute)
        if stack[variant] > compute:
            ax.barh(i, stack[variant] - compute, left=compute, color=colour, hatch=hatch)  # what it adds
        ax.errorbar(stack[variant], i, xerr=[[stack[variant] - low[variant]], [high[variant] - stack[variant]]],
                    color="tab:gray", capsize=3, lw=1.5)
        ax.text(high[variant] + 0.03, i, f"{stack[variant]:.2f} ms", va="center", fontsize=8)
    ax.axvline(compute + 0.1 * comm, color="tab:green", ls="--", lw=1,
               label=f"compute + 10% of NCCL's communication ({comm:.2f} ms alone): 90% hidden")
    ax.barh([0], [0], color="silver", alpha=0.35, label="pale: up to the plain layer's compute")
    ax.barh([0], [0], color="dimgray", label="dark: beyond it")
    ax.set_yticks(range(len(bars)), [label for _, label, _ in bars])
    ax.invert_yaxis()
    lo = min(low[v] for v, _, _ in bars)
    runs = rows["run"].nunique() if "run" in rows else 1
    ax.set(xlim=(lo - 0.6, max(high[v] for v, _, _ in bars) + 0.6),
           xlabel=f"ms per layer (a stack of {rows.layers.max()}; median of {runs} run(s), whiskers: range)\n"
                  f"(the axis starts at {lo - 0.6:.1f} ms)",
           title=f"{rows.ranks.iloc[0]}x {rows.card.iloc[0]}: where a layer's time goes")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.4, -0.24), frameon=False, ncol=2)
    ax.grid(alpha=0.3, axis="x")
    return fig
