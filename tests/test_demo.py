"""tplab.lab.demo: notebooks executed headless by papermill, against a real MPI cluster for run_demo.

The fixture notebooks are in tests/fixtures/notebooks/: ``allreduce`` (connects with connect_or_start,
runs tplab.allreduce on every rank, writes a CSV and a figure), ``fails`` (raises), ``plain`` (no cluster).
IPYTHONDIR points at a temporary folder, so the clusters never touch ~/.ipython.
"""

import os
from pathlib import Path

import pandas as pd
import psutil
import pytest

from tplab.lab.demo import DEMO_CLUSTER_ID, execute_notebooks, run_demo

pytestmark = pytest.mark.slow

NOTEBOOKS = Path(__file__).parent / "fixtures" / "notebooks"


@pytest.fixture
def ipython_dir(tmp_path, monkeypatch):
    """A private IPython directory for this process and the kernels it starts (they inherit it)."""
    path = tmp_path / "ipython"
    monkeypatch.setenv("IPYTHONDIR", str(path))
    return path


def cluster_processes_under(folder) -> list:
    found = []
    for proc in psutil.process_iter():
        try:
            env, alive = proc.environ(), proc.status() != psutil.STATUS_ZOMBIE
            if env.get("IPP_PROFILE_DIR", "").startswith(str(folder)) and alive:
                found.append(proc)
        except (psutil.Error, OSError):
            pass
    return found


def test_execute_notebooks_reports_a_failure_and_goes_on(tmp_path, ipython_dir):
    out, lines = tmp_path / "out", []
    parameters = {"n_ranks": 3, "cluster_id": "unused", "output_dir": str(tmp_path / "out")}
    results = execute_notebooks([NOTEBOOKS / "fails.ipynb", NOTEBOOKS / "plain.ipynb"], out,
                                parameters=parameters, timeout=120, log=lines.append)

    assert [r["name"] for r in results] == ["fails.ipynb", "plain.ipynb"]
    failed, ran = results
    assert not failed["ok"] and failed["error"].startswith("ValueError: this notebook fails on purpose")
    assert ran["ok"] and ran["error"] is None and ran["seconds"] > 0
    for r in results:  # the executed notebook and its HTML copy, even for the failed one
        assert set(r["paths"]) == {"ipynb", "html"}
        assert all(Path(p).is_file() and Path(p).parent == out for p in r["paths"].values())
    assert "this notebook fails on purpose" in Path(failed["paths"]["html"]).read_text()
    # the parameters were injected, and the notebook ran in its own folder (it checks a relative path)
    assert pd.read_csv(out / "plain.csv")["n_ranks"].tolist() == [3]
    assert any("FAILED" in line for line in lines) and any("OK" in line for line in lines)


def test_run_demo_end_to_end(tmp_path, ipython_dir, capsys):
    out = tmp_path / "build"
    notebooks = [NOTEBOOKS / "fails.ipynb", NOTEBOOKS / "allreduce.ipynb"]
    status = run_demo(ranks=2, out=str(out), notebooks=notebooks, timeout=120)
    printed = capsys.readouterr().out

    assert status == 1  # one notebook failed ...
    table = pd.read_csv(out / "fixture_allreduce.csv")  # ... and the next one still ran on 2 ranks
    assert table["rank"].tolist() == [0, 1] and table["size"].tolist() == [2, 2]
    assert table["sum"].tolist() == [3.0, 3.0]
    assert (out / "figures" / "fixture_allreduce.png").is_file()
    assert (out / "allreduce.html").is_file() and (out / "fails.html").is_file()

    assert "FAILED  ValueError: this notebook fails on purpose" in printed
    assert "fixture_allreduce.csv" in printed and "expected" in printed  # the CSV, printed
    assert f"figures (1): {out / 'figures'}/" in printed
    assert "1 of 2 notebooks ran; FAILED: fails.ipynb" in printed
    index = (out / "index.html").read_text()  # the reading copy's contents: both, the failure marked
    assert 'href="allreduce.html"' in index and "FAILED: ValueError: this notebook fails on purpose" in index
    assert f"reading copy: {out / 'index.html'}" in printed
    assert cluster_processes_under(ipython_dir) == []  # the demo's cluster is gone


def test_run_demo_stops_before_starting_anything_when_a_notebook_is_missing(tmp_path, ipython_dir, capsys):
    assert run_demo(ranks=2, out=str(tmp_path / "b"), notebooks=[tmp_path / "nope.ipynb"]) == 1
    assert "not found" in capsys.readouterr().out
    assert not (ipython_dir / "profile_default" / "security" / f"cluster-{DEMO_CLUSTER_ID}.json").exists()


def test_run_demo_passes_when_every_notebook_runs(tmp_path, ipython_dir, monkeypatch, capsys):
    # The cluster part is covered above; here a notebook without a cluster keeps the test quick.
    import tplab.cluster

    class NoCluster:
        def stop(self):
            pass

    monkeypatch.setattr(tplab.cluster.Cluster, "start", classmethod(lambda cls, n, **kw: NoCluster()))
    assert run_demo(ranks=2, out=str(tmp_path / "b"), notebooks=[NOTEBOOKS / "plain.ipynb"]) == 0
    assert "1 of 1 notebooks ran" in capsys.readouterr().out
    assert os.path.exists(tmp_path / "b" / "plain.html")


def test_kernels_talk_over_unix_sockets_where_their_names_fit(monkeypatch, tmp_path):
    """Notebook kernels use ZeroMQ's IPC transport (no TCP port) when Jupyter's runtime folder leaves room for
    the socket names (107 bytes a path), TCP otherwise -- a long home folder on a cluster, say."""
    from tplab.lab.demo import kernel_transport

    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", "/tmp/short")
    assert kernel_transport() == ("ipc" if os.name == "posix" else "tcp")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", "/home/" + "a-long-folder-name/" * 4 + "runtime")
    assert kernel_transport() == "tcp"
