"""Figures of notebook 05's reference section that reference_plots.py (its other figures) has no room for:

    sp_floor(rows, dtype)     05: the layer on p GPUs per scheme and path, next to its compute with nothing moved
    lse_kernel_before_after(rows, dtype)   05: the same layer with its blocks on FlashAttention's kernel and
                              on cuDNN's (sequence_parallel_gpu_*_cudnn-lse.csv)
    ring_host_before_after(rows, dtype)    05: ring attention before and after its host path was trimmed
                              (sequence_parallel_gpu_4x-h100_lean-ring.csv)
    eager_and_replayed(rows, dtype)        05: the layer's paths eagerly and replayed from CUDA graphs
                              (sequence_parallel_gpu_4x-h200_graphs.csv)
    overlap_attempts(rows, dtype)   05: the all-gather scheme's paths and the ways tried to hide its transfers,
                              medians and ranges over rounds (sequence_parallel_gpu_4x-h100_overlap-attempts.csv)
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from tplab.lab.plots import MAX_WIDTH, color_of


def sp_floor(rows, dtype="bfloat16"):
    """Rows of one scripts/gpu_sequence_parallel.py run at its largest p: each (scheme, path)'s time per layer
    (bars, the scheme's colour), the ``compute_only`` paths hatched (a shard exchange that moves nothing: the
    split layer's own compute), the unsplit layer's time / p as a grey line (every GPU busy, nothing exposed)."""
    layer = rows[(rows.kind == "layer") & (rows.dtype == dtype)]
    layer = layer[layer.p == layer.p.max()].drop_duplicates(["scheme", "path"], keep="last")
    # grouped by scheme (its fastest path first), within a scheme the floor first: the gap is the exposed part
    layer = layer.assign(floor=~layer.path.str.startswith("compute_"),
                         fastest=layer.groupby("scheme").time_s.transform("min"))
    layer = layer.sort_values(["fastest", "scheme", "floor", "time_s"], ascending=False)
    p = int(layer.p.max())
    fig, ax = plt.subplots(figsize=(min(9.0, MAX_WIDTH), 0.32 * len(layer) + 1.4), constrained_layout=True)
    for y, row in enumerate(layer.itertuples()):
        floor = row.path.startswith("compute_")
        ax.barh(y, row.time_s * 1e3, color=color_of(row.scheme), alpha=0.45 if floor else 0.9,
                hatch="//" if floor else None, edgecolor="0.3" if floor else None)
        ax.text(row.time_s * 1e3, y, f" {row.time_s * 1e3:.2f} ms ({row.speedup:.2f}x)", va="center", fontsize=8)
    ideal = float(layer.unsplit_time_s.median()) / p * 1e3
    ax.axvline(ideal, color="0.5", lw=1)
    ax.text(ideal, -0.75, f" one GPU / {p} = {ideal:.2f} ms", color="0.4", fontsize=8, va="center")
    ax.set_ylim(-1.1, len(layer) - 0.4)
    ax.set_yticks(range(len(layer)), [f"{row.scheme} / {row.path}" for row in layer.itertuples()], fontsize=8)
    ax.set(xlabel=f"ms per layer ({dtype}, {p} GPUs)", xlim=(0, layer.time_s.max() * 1e3 * 1.22),
           title="where the layer's time goes: hatched = nothing moved (the compute's floor)")
    ax.grid(alpha=0.3, axis="x")
    return fig


def lse_kernel_before_after(rows, dtype="bfloat16"):
    """The A/B rounds of sequence_parallel_gpu_*_cudnn-lse.csv: for each (scheme, path), the layer's time with
    attend_with_lse on FlashAttention's kernel (pale) and on cuDNN's (dark), the median of the rounds of each,
    the scheme's colour; the unsplit layer's time / p as a grey line."""
    chosen = rows.lse_kernel.isin(["flash", "cudnn"])
    return _before_after(rows[chosen], rows[chosen].lse_kernel == "cudnn", dtype,
                         "the same blocks, another attention kernel\n(pale: attend_with_lse on FlashAttention, dark: "
                         "on cuDNN)")


def ring_host_before_after(rows, dtype="bfloat16", before="f25a1e8, before this change"):
    """The A/B rounds of sequence_parallel_gpu_4x-h100_lean-ring.csv: ring attention's and streamed K/V's paths (the
    all-gather's compute as the control) with the code ``before`` (pale) and after (dark), medians and ranges
    over the rounds of the machine starts that ran both; the unsplit layer's time / p as a grey line."""
    both = rows[rows.machine_start.isin(rows[rows.code == before].machine_start.unique())]
    both = both[both.scheme.isin(["ring", "streamed_kv"]) | (both.path == "compute_only") | (both.kind == "unsplit")]
    return _before_after(both, both.code != before, dtype,
                         "ring attention, its host path trimmed\n(pale: before, dark: after; on the same two machines)")


def eager_and_replayed(rows, dtype="bfloat16", machine_start=None):
    """The runs of sequence_parallel_gpu_4x-h200_graphs.csv: each (scheme, path) eagerly (pale) and replayed from
    CUDA graphs (dark; the rows whose path ends in ``_graph``), medians and ranges over the runs; ring attention,
    streamed K/V and the all-gather's fastest paths, the ring with nothing moved hatched; the one-GPU layer / p as a
    grey line. ``machine_start``: one start's runs only."""
    if machine_start is not None:
        rows = rows[rows.machine_start == machine_start]
    path = rows.path.str.removesuffix("_graph")
    shown = ((rows.scheme == "ring") & path.isin(["direct_copy_engine", "compute_only"])
             | (rows.scheme == "streamed_kv") & (path == "direct_copy_engine")
             | (rows.scheme == "allgather_kv") & path.isin(["fused_kv", "torch_nccl", "direct_copy_engine"])
             | (rows.kind == "unsplit"))
    return _before_after(rows[shown].assign(path=path[shown]), rows.path[shown].str.endswith("_graph"), dtype,
                         "the same layer, its calls replayed from a CUDA graph\n(pale: eager calls, dark: replayed)")


def _before_after(rows, after, dtype, title):
    """Each (scheme, path)'s layer time before (pale) and after (dark): the median of its rounds (bar) and their
    range (whisker), the scheme's colour, hatched where nothing moved; the unsplit layer / p as a grey line."""
    layer = rows[(rows.kind == "layer") & (rows.dtype == dtype)].assign(after=after)
    stats = layer.groupby(["scheme", "path", "after"]).time_s.agg(["median", "min", "max"]).unstack("after") * 1e3
    stats = stats.sort_values(("median", True))   # (the fastest on top)
    p = int(layer.p.max())
    fig, ax = plt.subplots(figsize=(min(9.0, MAX_WIDTH), 0.55 * len(stats) + 1.4), constrained_layout=True)
    for y, ((scheme, path), row) in enumerate(stats.iterrows()):
        for offset, done in ((-0.2, False), (0.2, True)):   # (the axis inverted: before above after)
            ax.barh(y + offset, row[("median", done)], height=0.38, color=color_of(scheme), alpha=0.9 if done else 0.35,
                    hatch="//" if path.startswith("compute_") else None, edgecolor="0.3")
            ax.plot([row[("min", done)], row[("max", done)]], [y + offset] * 2, color="0.2", lw=1)
            ax.text(row[("max", done)], y + offset, f" {row[('median', done)]:.2f} ms", va="center", fontsize=8)
    unsplit = rows[(rows.kind == "unsplit") & (rows.dtype == dtype)]
    ideal = float(unsplit.time_s.median()) / p * 1e3
    ax.axvline(ideal, color="0.5", lw=1)
    ax.text(ideal, -0.75, f" one GPU / {p} = {ideal:.2f} ms", color="0.4", fontsize=8, va="center")
    ax.set_ylim(-1.1, len(stats) - 0.4)
    ax.set_yticks(range(len(stats)), [f"{scheme} / {path}" for scheme, path in stats.index], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel=f"ms per layer ({dtype}, {p} GPUs; hatched: nothing moved)",
           xlim=(0, stats["max"].max().max() * 1.25), title=title)
    ax.grid(alpha=0.3, axis="x")
    return fig


# overlap_attempts: each path in words, and the colour of its wire (the floors grey)
_WIRES = {"direct_nccl": ("NCCL all-gather", "nccl"), "direct_peer": ("tplab peer all-gather", "tplab_peer_memory"),
          "direct_copy_engine": ("copy engines", "copy_engine"), "direct_ring": ("tplab ring (NCCL send/recv)", "ring"),
          "fused_kv": ("fused into the Q/K/V GEMM", "fused_kv"),
          "compute_floor": ("compute alone", None),
          "compute_only": ("compute + K/V writes", None)}
_HOW = (("_side_k_first", ", K first, under V and Q"), ("_side", ", 2nd stream, under Q"), ("_g2", ", 2 head groups"))


def _path_words(path: str):
    """(label, colour name or None for a floor) of an all-gather path of scripts/gpu_sequence_parallel.py."""
    how = ""
    for suffix, words in _HOW:
        if path.endswith(suffix):
            path, how = path[: -len(suffix)], words
            break
    if path.startswith("peer_b"):   # (tplab's peer all-gather held to that many blocks)
        return f"tplab peer, {path[6:]} blocks{how}", "tplab_peer_memory"
    words, colour = _WIRES.get(path, (path, path))
    return words + how, colour


def overlap_attempts(rows, dtype="bfloat16",
                     title="hiding the K/V all-gather: every attempt lands right of the dashed line (no overlap, NCCL)",
                     scheme="allgather_kv"):
    """One scheme's rows (the all-gather's unless ``scheme`` says another): each path's time per layer, the median
    over its rounds (bar) and their range (whisker), coloured by its wire (NCCL black, tplab's peer memory cyan, the
    copy engines brown, tplab's ring orange); the floors grey and hatched (only the plain ones: compute alone, and
    with the gathered tensor's writes; for ring attention, the ring with nothing moved); a dashed line at the plain
    NCCL all-gather's median, where nothing overlaps: an attempt pays off only left of it."""
    layer = rows[(rows.kind == "layer") & (rows.dtype == dtype) & (rows.scheme == scheme)]
    layer = layer[~layer.path.str.startswith("compute_") | layer.path.isin(["compute_floor", "compute_only"])]
    stats = (layer.groupby("path").time_s.agg(["median", "min", "max"]) * 1e3).sort_values("median")
    p = int(layer.p.max())
    fig, ax = plt.subplots(figsize=(min(9.0, MAX_WIDTH), 0.28 * len(stats) + 1.5), constrained_layout=True)
    for y, (path, row) in enumerate(stats.iterrows()):
        words, colour = _path_words(path)
        floor = colour is None
        ax.barh(y, row["median"], color="0.75" if floor else color_of(colour), alpha=0.9,
                hatch="//" if floor else None, edgecolor="0.3" if floor else None)
        ax.plot([row["min"], row["max"]], [y, y], color="0.2", lw=1)
        ax.text(row["max"], y, f" {row['median']:.2f} ms", va="center", fontsize=8)
    plain = float(stats.loc["direct_nccl", "median"]) if "direct_nccl" in stats.index else None
    if plain is not None:
        ax.axvline(plain, color="0.3", ls="--", lw=1)
    labels = ["nothing moved (ring's compute)" if scheme == "ring" and path == "compute_only"
              else _path_words(path)[0] for path in stats.index]
    ax.set_yticks(range(len(stats)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel=f"ms per layer ({dtype}, {p} GPUs; bar: median of the rounds, line: their range)",
           xlim=(0, stats["max"].max() * 1.15),
           title=title)
    ax.grid(alpha=0.3, axis="x")
    return fig
