"""scripts/frontier_table.py rebuilds the committed 4x H200 headline table from the committed per-size and
per-run CSVs it was made from: every row the same value and anchor (p4: the fastest of tplab's paths against
NCCL's all-gather, ring attention against the fastest other scheme, medians over the rounds)."""

import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"


def one_start(name):   # the per-size files hold two machine starts; the headline table is the second's
    rows = pd.read_csv(DATA / name)
    return rows[rows.machine_start == 2].drop(columns="machine_start")


def test_the_headline_table_comes_from_the_committed_runs(tmp_path):
    one_start("gpu_frontier_4x-h200_small-messages_programmatic-eager.csv").to_csv(tmp_path / "small.csv", index=False)
    one_start("gpu_frontier_4x-h200_256MiB_programmatic-eager.csv").to_csv(tmp_path / "large.csv", index=False)
    one_start("gpu_api_allreduce_4x-h200_programmatic-eager.csv").to_csv(
        tmp_path / "gpu_api_allreduce_4x-h200.csv", index=False)
    # all twelve runs: the table takes the six that timed the whole attention (7-12), as the committed one did
    (tmp_path / "async_tp_gpu_4x-nvidia-h200.csv").write_bytes((DATA / "async_tp_gpu_4x-h200.csv").read_bytes())
    (tmp_path / "async_tp_gpu_2x-nvidia-h200.csv").write_bytes((DATA / "async_tp_gpu_2x-h200.csv").read_bytes())
    sequence = pd.read_csv(DATA / "sequence_parallel_gpu_4x-h200_cudnn-lse.csv")
    sequence = sequence[sequence.lse_kernel == "cudnn (current code)"]        # (rounds 3-5)
    sequence.to_csv(tmp_path / "sequence_parallel_gpu_4x-H200.csv", index=False)

    # (a 2-GPU run in the same folder must not reach the 4-GPU table)
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "frontier_table.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    table = pd.read_csv(tmp_path / "gpu_frontier_4x-h200.csv").set_index("metric")
    committed = pd.read_csv(DATA / "gpu_frontier_4x-h200.csv").set_index("metric")
    assert sorted(table.index) == sorted(committed.index)
    for metric in committed.index:
        assert table.loc[metric, "value"] == committed.loc[metric, "value"], metric
        assert str(table.loc[metric, "anchor"]) == str(committed.loc[metric, "anchor"]), metric
    # p4 by hand: the fastest median over tplab's paths, NCCL's all-gather the anchor; the ring against the rest
    layers = sequence[(sequence.kind == "layer") & ~sequence.path.str.startswith("compute_only")]
    medians = layers.assign(name=layers.scheme + " " + layers.path).groupby("name").speedup.median()
    assert table.loc["p4_bf16_speedup", "value"] == round(medians.drop("allgather_kv direct_nccl").max(), 3)
    assert table.loc["p4_ring_bf16_speedup", "value"] == round(medians.filter(like="ring direct").max(), 3)
    assert table.loc["p4_ring_bf16_speedup", "anchor_value"] == round(medians.max(), 3)
