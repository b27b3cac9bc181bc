"""The notebooks execute from top to bottom against a real MPI cluster, and leave what they promise."""

from pathlib import Path

import pandas as pd
import pytest

from tplab.cluster import Cluster
from tplab.lab.demo import execute_notebooks

pytestmark = pytest.mark.slow
NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
RANKS = 4


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Run every notebook once, small, on one 4-engine cluster in a private IPython directory."""
    tmp = tmp_path_factory.mktemp("notebooks")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("IPYTHONDIR", str(tmp / "ipython"))  # the kernels inherit it: clusters stay private
        with Cluster.start(RANKS, cluster_id="tplab-test"):
            results = execute_notebooks(
                NOTEBOOKS, tmp / "out", timeout=600,
                parameters={"n_ranks": RANKS, "cluster_id": "tplab-test", "output_dir": str(tmp / "out"),
                            "max_bytes": 1 << 14, "iters": 5, "fit_iters": 5, "osu_max_bytes": 64})
    return tmp / "out", {r["name"]: r for r in results}


def test_there_are_notebooks():
    assert [nb.name[:2] for nb in NOTEBOOKS][:4] == ["00", "01", "02", "03"]


@pytest.mark.parametrize("name", [nb.name for nb in NOTEBOOKS])
def test_notebook_runs(executed, name):
    out, results = executed
    assert results[name]["ok"], results[name]["error"]
    assert (out / name).with_suffix(".html").exists()


def test_notebook_01_outputs(executed):
    out, _ = executed
    correctness = pd.read_csv(out / "correctness.csv")
    assert len(correctness) > 100 and correctness.ok.all()
    assert set(correctness.algorithm) == {"naive", "ring", "recursive_doubling", "rabenseifner", "tree"}
    figures = {p.name for p in (out / "figures").glob("01_*.png")}
    for name in ["steps_naive", "steps_ring", "steps_recursive_doubling", "bytes_per_rank", "timings",
                 f"steps_recursive_doubling_p{RANKS - 1}"]:
        assert f"01_{name}.png" in figures
    timings = pd.read_csv(out / "01_allreduce_timings.csv")
    assert set(timings.algorithm) >= {"ring", "builtin"} and (timings.time_us > 0).all()


def test_committed_without_outputs():
    import nbformat

    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), path.name
        assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells), f"{path.name}: no parameters cell"


def test_notebook_02_and_03_outputs(executed):
    out, _ = executed
    figures = {p.name for p in (out / "figures").glob("0[23]_*.png")}
    for name in ["02_formulas", "02_fit", "02_model_vs_measured", "02_tp_ratio", "03_sweep", "03_osu_latency",
                 "03_emulated_network", "03_emulated_network_model", "03_two_real_nodes", "03_tp_across_nodes"]:
        assert f"{name}.png" in figures, name
    import json

    table = json.loads((out / "tuning.json").read_text())
    assert str(RANKS) in table["collectives"]["allreduce"]
    sweep = pd.read_csv(out / f"03_allreduce_p{RANKS}.csv")
    assert (sweep.wrong == 0).all() and set(sweep.algorithm) >= {"ring", "rabenseifner", "builtin"}
