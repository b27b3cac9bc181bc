"""scripts/frontier_table.py rebuilds each committed 4-GPU headline table (4x H200, 4x H100) from the committed
per-size and per-run CSVs it was made from: every row the same value and anchor (p4: the fastest of tplab's
paths against NCCL's all-gather, ring attention against the fastest other scheme, medians over the rounds)."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"


def one_start(name, start):   # files that hold several machine starts; a table is one start's
    rows = pd.read_csv(DATA / name)
    return rows[rows.machine_start == start].drop(columns="machine_start")


def h200_runs(folder):
    # the run with two_shot_lamport (one machine start, the code as committed): the frontier with LAYERS=1, its
    # sequence-parallel layer in three runs, each path eagerly and replayed from CUDA graphs
    for name, target in (("gpu_frontier_4x-h200_small-messages_two-shot-lamport.csv", "small.csv"),
                         ("gpu_frontier_4x-h200_256MiB_two-shot-lamport.csv", "large.csv"),
                         ("gpu_api_allreduce_4x-h200_two-shot-lamport.csv", "gpu_api_allreduce_4x-h200.csv"),
                         ("async_tp_gpu_4x-h200_two-shot-lamport.csv", "async_tp_gpu_4x-nvidia-h200.csv")):
        (folder / target).write_bytes((DATA / name).read_bytes())
    (folder / "async_tp_gpu_2x-nvidia-h200.csv").write_bytes((DATA / "async_tp_gpu_2x-h200.csv").read_bytes())
    return pd.read_csv(DATA / "sequence_parallel_gpu_4x-h200_two-shot-lamport.csv")


def h100_runs(folder):
    # the run of the lean ring (one machine start, the code as committed): the frontier with LAYERS=1, its
    # sequence-parallel layer in three runs; the same file holds two earlier starts' before/after rounds
    one_start("gpu_frontier_4x-h100_small-messages_lean-ring.csv", 1).to_csv(folder / "small.csv", index=False)
    one_start("gpu_frontier_4x-h100_256MiB_lean-ring.csv", 1).to_csv(folder / "large.csv", index=False)
    one_start("gpu_api_allreduce_4x-h100_lean-ring.csv", 1).to_csv(folder / "gpu_api_allreduce_4x-h100.csv",
                                                                   index=False)
    (folder / "async_tp_gpu_4x-nvidia-h100-80gb-hbm3.csv").write_bytes(
        (DATA / "async_tp_gpu_4x-h100_lean-ring.csv").read_bytes())
    return one_start("sequence_parallel_gpu_4x-h100_lean-ring.csv", 3).drop(columns=["round", "code"])


@pytest.mark.parametrize("card, runs", [("h200", h200_runs), ("h100", h100_runs)])
def test_the_headline_table_comes_from_the_committed_runs(tmp_path, card, runs):
    sequence = runs(tmp_path)
    sequence.to_csv(tmp_path / f"sequence_parallel_gpu_4x-{card.upper()}.csv", index=False)
    # (a 2-GPU run in the same folder must not reach the 4-GPU table)
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "frontier_table.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    table = pd.read_csv(tmp_path / f"gpu_frontier_4x-{card}.csv").set_index("metric")
    committed = pd.read_csv(DATA / f"gpu_frontier_4x-{card}.csv").set_index("metric")
    assert sorted(table.index) == sorted(committed.index)
    for metric in committed.index:
        assert table.loc[metric, "value"] == committed.loc[metric, "value"], metric
        assert str(table.loc[metric, "anchor"]) == str(committed.loc[metric, "anchor"]), metric
    # p4 by hand: the fastest median over tplab's paths, eager or replayed from graphs (path ..._graph), NCCL's
    # all-gather the anchor; the ring against the rest; the compute with nothing moved (compute_only,
    # compute_floor) is a floor, not a path
    layers = sequence[(sequence.kind == "layer") & ~sequence.path.str.startswith("compute_")]
    medians = layers.assign(name=layers.scheme + " " + layers.path).groupby("name").speedup.median()
    tplab = medians[~medians.index.str.contains(" direct_nccl| torch_nccl")]
    assert table.loc["p4_bf16_speedup", "value"] == round(tplab.max(), 3)
    assert table.loc["p4_ring_bf16_speedup", "value"] == round(medians.filter(like="ring direct").max(), 3)
    assert table.loc["p4_ring_bf16_speedup", "anchor_value"] == round(medians.max(), 3)
