"""tplab.lab.demo — execute the notebooks headless against one MPI cluster, and summarise what they found.

``make demo`` (``tplab demo --ranks 4 --out build``) calls ``run_demo``:

    from tplab.lab.demo import run_demo
    run_demo(ranks=4, out="build")       # start 4 engines, run notebooks/*.ipynb into build/, stop, summarise

Each notebook has a cell tagged ``parameters`` (``n_ranks``, ``cluster_id``, ``output_dir``) that papermill
overrides, and connects with ``tplab.cluster.connect_or_start(n=n_ranks, cluster_id=cluster_id)``: the
cluster started here is shared by all notebooks, so its start-up (seconds) is paid once.
"""

from __future__ import annotations

import time
from pathlib import Path

DEMO_CLUSTER_ID = "tplab-demo"


def execute_notebooks(notebooks, out_dir, *, parameters: dict, timeout=900, html=True,
                      log=print) -> list[dict]:
    """Execute each notebook with papermill into ``out_dir`` (plus an HTML copy); go on after a failure.

    ``timeout`` is per cell. Each notebook runs in its own folder, so relative paths such as ``../data``
    work. Returns one dict per notebook: name, seconds, ok, error (first line, or None), paths.

        results = execute_notebooks(["notebooks/01_ring.ipynb"], "build", parameters={"n_ranks": 2})
    """
    import papermill

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    notebooks = [Path(nb) for nb in notebooks]
    results = []
    for i, notebook in enumerate(notebooks, 1):
        log(f"[{i}/{len(notebooks)}] {notebook.name} ...")
        executed = out_dir / notebook.name
        if executed.resolve() == notebook.resolve():
            raise ValueError(f"out_dir {out_dir} holds {notebook.name} itself: executing would overwrite it")
        for stale in (executed, executed.with_suffix(".html")):  # from an earlier run: not this one's
            stale.unlink(missing_ok=True)
        started = time.perf_counter()
        error = None
        try:
            papermill.execute_notebook(
                str(notebook), str(executed), parameters=parameters,
                # "python3" runs sys.executable (jupyter_client maps the spec's `python` to it): this
                # venv's Python, even when its bin/ is not on PATH
                kernel_name="python3",
                cwd=str(notebook.resolve().parent), execution_timeout=timeout,
                progress_bar=False, log_output=False,
            )
        except papermill.PapermillExecutionError as e:  # a cell raised: the notebook is still written
            error = f"{e.ename}: {_first_line(e.evalue)} (cell [{e.exec_count}])"
        except Exception as e:  # noqa: BLE001 - a kernel that died, a cell timeout...: report, go on
            error = f"{type(e).__name__}: {_first_line(str(e))}"
        seconds = time.perf_counter() - started
        paths = {"ipynb": str(executed)} if executed.exists() else {}
        if html and executed.exists():
            try:
                paths["html"] = str(_export_html(executed))
            except Exception as e:  # noqa: BLE001 - the executed notebook is there; the HTML is a copy
                log(f"    no HTML copy: {type(e).__name__}: {_first_line(str(e))}")
        log(f"    {'OK' if error is None else 'FAILED'} in {seconds:.1f} s" + (f": {error}" if error else ""))
        results.append({"name": notebook.name, "seconds": seconds, "ok": error is None, "error": error,
                        "paths": paths})
    return results


def run_demo(ranks=4, out="build", notebooks=None, timeout=900) -> int:
    """Start a cluster of ``ranks`` engines, execute the notebooks into ``out``, stop it, print a summary.
    Returns 0 if every notebook ran, 1 otherwise (the exit status of ``tplab demo``)."""
    from tplab.cluster import Cluster, ClusterError, stop_cluster

    out = Path(out).resolve()
    notebooks = [Path(nb) for nb in notebooks] if notebooks else sorted(_notebook_dir().glob("*.ipynb"))
    missing = [str(nb) for nb in notebooks if not nb.is_file()]
    if not notebooks or missing:
        print("tplab demo: no notebooks to run" + (f" (not found: {', '.join(missing)})" if missing else ""))
        return 1

    # A demo killed before it could clean up leaves its cluster running: take it down first.
    if stop_cluster(DEMO_CLUSTER_ID):
        print(f"tplab demo: stopped a cluster {DEMO_CLUSTER_ID!r} left over from an earlier run")
    print(f"tplab demo: starting {ranks} MPI engines ...")
    try:
        cluster = Cluster.start(ranks, cluster_id=DEMO_CLUSTER_ID)
    except ClusterError as e:
        print(f"tplab demo: could not start the cluster: {e}")
        return 1
    try:
        parameters = {"n_ranks": ranks, "cluster_id": DEMO_CLUSTER_ID, "output_dir": str(out)}
        results = execute_notebooks(notebooks, out, parameters=parameters, timeout=timeout)
    finally:
        cluster.stop()
    _print_summary(results, out)
    return 0 if all(r["ok"] for r in results) else 1


def _print_summary(results, out: Path):
    import pandas as pd

    width = max(len(r["name"]) for r in results)
    print(f"\n{'notebook':<{width}}  {'time':>7}  result")
    for r in results:
        print(f"{r['name']:<{width}}  {r['seconds']:6.1f}s  {'OK' if r['ok'] else 'FAILED  ' + r['error']}")
    # Notebooks leave CSVs of what they measured in the output folder: show each in brief.
    for csv in sorted(out.glob("*.csv")):
        print(f"\n{csv.name}:")
        try:
            print(_brief(pd.read_csv(csv)).to_string(max_rows=12, max_cols=10, show_dimensions="truncate"))
        except (ValueError, OSError, KeyError) as e:  # an empty or half-written file: say so, go on
            print(f"  (unreadable: {e})")
    print(f"\nexecuted notebooks and HTML: {out}/")
    figures = sorted((out / "figures").glob("*.png"))
    if figures:
        print(f"figures ({len(figures)}): {out / 'figures'}/")
    failed = [r["name"] for r in results if not r["ok"]]
    print(f"\n{len(results) - len(failed)} of {len(results)} notebooks ran"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))


def _brief(df):
    """A correctness table as cases and failures per algorithm; a timing table as time (us) by size and
    algorithm; anything else as it is."""
    if {"algorithm", "ok"} <= set(df.columns):
        return df.groupby("algorithm", sort=False).agg(cases=("ok", "size"), correct=("ok", "sum"))
    if {"algorithm", "size", "time_us"} <= set(df.columns):
        return df.pivot_table(index="size", columns="algorithm", values="time_us", sort=False).round(1)
    return df


def _export_html(executed: Path) -> Path:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter(embed_images=True).from_filename(str(executed))
    html = executed.with_suffix(".html")
    html.write_text(body, encoding="utf-8")
    return html


def _notebook_dir() -> Path:
    """notebooks/ of the current folder (``make demo`` runs from the repository), else of this checkout."""
    here = Path("notebooks")
    return here if here.is_dir() else Path(__file__).resolve().parents[2] / "notebooks"


def _first_line(text) -> str:
    lines = [line for line in str(text).splitlines() if line.strip()]
    return lines[0].strip() if lines else ""
