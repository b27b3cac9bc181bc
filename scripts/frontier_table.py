"""The headline numbers of scripts/gpu_frontier.sh's run: OUT_DIR/gpu_frontier_<p>x-<card>.csv with columns
metric, value, unit, anchor, anchor_value, card (the anchor: the best other implementation of the same run);
the layers' rows too where OUT_DIR holds their runs (``LAYERS=1``): p5 from scripts/gpu_async_tp.py's
async_tp_gpu_*.csv (medians over the runs it holds), p4 from scripts/gpu_sequence_parallel.py's
sequence_parallel_gpu_*.csv (bf16, strong scaling, its largest p);
also prints every size, from CUDA graphs, where another implementation beat tplab's best, and where one whose
input already lies in shared memory (NCCL's symmetric kernels, torch's symm_mem) beat tplab's kernels on such an
input (peer_registered: like for like; not in the table, whose tplab rows take any input).

    python scripts/frontier_table.py OUT_DIR
"""

import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tplab.collectives.tuning import human_bytes  # noqa: E402

TPLAB = {"peer_one_shot_ll", "peer_one_shot_lamport", "peer_one_shot", "peer_two_shot_lamport", "peer_two_shot",
         "peer_ring", "auto"}   # any input
REGISTERED = "peer_registered"                    # tplab's kernels on an input already in the shared buffer
IN_SHARED_MEMORY = {"nccl_symmetric", "symm_mem_one_shot", "symm_mem_two_shot"}       # the others' such input


def best(rows, names, column="time_us", lowest=True):
    rows = rows[rows.algorithm.isin(names) & (rows.wrong <= 0)]
    if rows.empty:
        return None
    row = rows.loc[rows[column].idxmin() if lowest else rows[column].idxmax()]
    return row.algorithm, float(row[column])


def main(out: Path) -> None:
    small = pd.read_csv(out / "small.csv")
    large = pd.read_csv(out / "large.csv") if (out / "large.csv").exists() else None  # (a run cut short)
    card = str(small.machine.iloc[0])  # (tplab bench --machine: the card's name)
    p = int(small.ranks.iloc[0])
    api = next(out.glob(f"gpu_api_allreduce_{p}x-*.csv"), None)   # (this run's rank count: not another's)
    api = pd.read_csv(api) if api else None
    rows = []

    def add(metric, unit, mine, anchor):
        if mine and (anchor or metric.startswith("p5_nccl")):   # (NCCL's comm alone: nothing else may be timed)
            rows.append(dict(metric=metric, value=round(mine[1], 3), unit=unit, anchor=anchor[0] if anchor else "",
                             anchor_value=round(anchor[1], 3) if anchor else float("nan"), card=card))

    graph = small[small["mode"] == "graph"]
    for kib in (1, 16, 64, 256, 1024, 4096):
        at = graph[graph["size"] == kib << 10]
        add(f"p2_graph_us_{human_bytes(kib << 10).replace(' ', '')}", "us", best(at, TPLAB), best(at, set(at.algorithm) - TPLAB - {REGISTERED}))
    if api is not None:
        at = api[api["size"] == 64 << 10]
        at = at.rename(columns={"path": "algorithm"})
        add("p2_eager_us_64KiB", "us", best(at, {"tplab.allreduce"}), best(at, {"torch.distributed"}))
        if "gpu_us_host_ahead" in at:   # the GPU's own time per eager call, the host ahead of it (no host bound)
            add("p2_eager_gpu_us_64KiB", "us", best(at, {"tplab.allreduce"}, "gpu_us_host_ahead"),
                best(at, {"torch.distributed"}, "gpu_us_host_ahead"))
    if large is not None:
        big = large[large["size"] == 256 << 20]
        add("p1_busbw_256MiB", "GB/s", best(big, TPLAB, "busbw", lowest=False),
            best(big, set(big.algorithm) - TPLAB - {REGISTERED}, "busbw", lowest=False))
    layer_rows(out, p, add)
    behind, behind_registered = [], []   # every size measured: where another beat tplab's best, by how much
    for size, at in graph.groupby("size"):
        for mine, other, where in ((best(at, TPLAB), best(at, set(at.algorithm) - TPLAB - {REGISTERED}), behind),
                                   (best(at, {REGISTERED}), best(at, IN_SHARED_MEMORY), behind_registered)):
            if mine and other and other[1] < mine[1]:
                where.append(f"{human_bytes(size)}: {mine[1]:.2f} against {other[0]} {other[1]:.2f} us "
                             f"(+{100 * (mine[1] / other[1] - 1):.1f}%)")
    print("tplab's best behind another, from CUDA graphs: " + ("; ".join(behind) or "nowhere"))
    if REGISTERED in set(graph.algorithm):
        print("like for like, the input already in shared memory (peer_registered against NCCL's symmetric kernels "
              "and torch's symm_mem): " + ("; ".join(behind_registered) or "tplab ahead everywhere"))
    slug = card.lower().replace("nvidia ", "").split()[0]
    path = out / f"gpu_frontier_{p}x-{slug}.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    print(pd.DataFrame(rows).to_string(index=False))
    print(f"wrote {path}")


def layer_rows(out: Path, p: int, add) -> None:
    """p5: the async-TP layer (its attention whole where timed) against the plain layer over NCCL; then two
    yardsticks, each next to tplab's counterpart as its anchor: the plain layer's compute (anchor: the async
    layer with nothing moving) and NCCL's two all-reduces alone (anchor: the copy engines' exchange alone).
    p4: the fastest sequence-parallel path on tplab's wires against the fastest on a library's collective
    (NCCL's all-gather, MPI's), and ring attention's fastest path against every other path. Only files of
    this run's rank count; a file holding several runs: the median over the runs that timed the layer."""
    async_tp = next(out.glob(f"async_tp_gpu_{p}x-*.csv"), None)
    if async_tp is not None:
        runs = pd.read_csv(async_tp)
        layer = "async_tp_whole_attention" if "async_tp_whole_attention" in set(runs.variant) else "async_tp"
        if "run" in runs:   # (runs of other variants, older code: left out)
            runs = runs[runs.run.isin(runs[runs.variant == layer].run)]
        m = runs[runs.layers == runs.layers.max()].groupby("variant").ms_per_layer.median()

        def at(variant):
            return (variant, float(m[variant])) if variant in m else None
        whole = layer == "async_tp_whole_attention"
        print(f"p5_layer_ms: {layer}, the median of {runs['run'].nunique() if 'run' in runs else 1} run(s)")
        add("p5_layer_ms", "ms", at(layer), at("plain_nccl"))
        add("p5_compute_ms", "ms", at("compute"),
            at("async_no_transfers_whole_attention" if whole else "async_no_transfers"))
        add("p5_nccl_comm_ms", "ms", at("nccl_comm"), at("exchange_alone"))
    sequence = next(out.glob("sequence_parallel_gpu_*.csv"), None)
    if sequence is not None:
        rows = pd.read_csv(sequence)
        rows = rows[(rows.kind == "layer") & (rows["mode"] == "strong") & (rows.dtype == "bfloat16")]
        rows = rows[(rows.p == p) & ~rows.path.str.startswith("compute_")]   # (compute_only, compute_floor: not paths)
        speedup = rows.assign(name=rows.scheme + " " + rows.path).groupby("name").speedup.median().dropna()
        vendor = speedup.index.str.contains(" direct_nccl| direct_vendor| torch_nccl| staged_mpi")   # a library's

        def top(mask):
            return (speedup[mask].idxmax(), float(speedup[mask].max())) if mask.any() else None
        ring = speedup.index.str.startswith("ring ")
        for metric, mask in (("p4_bf16_speedup", ~vendor), ("p4_ring_bf16_speedup", ring & ~vendor)):
            if top(mask):   # (which path: eager, or replayed from CUDA graphs -- its name ends in _graph)
                print(f"{metric}: {top(mask)[0]}")
        add("p4_bf16_speedup", "x", top(~vendor), top(vendor))
        add("p4_ring_bf16_speedup", "x", top(ring & ~vendor), top(~ring))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
