"""tplab.lab.demo — execute the notebooks headless against one MPI cluster, and summarise what they found.

``make demo`` (``tplab demo --ranks 4 --out build``) calls ``run_demo``:

    from tplab.lab.demo import run_demo
    run_demo(ranks=4, out="build")       # start 4 engines, run notebooks/*.ipynb into build/, stop, summarise

and leaves a reading copy: each executed notebook as .ipynb and .html, and ``build/index.html`` linking
them, one line each with its first heading and the start of its introduction (``write_index``).

Each notebook has a cell tagged ``parameters`` (``n_ranks``, ``cluster_id``, ``output_dir``) that papermill
overrides, and connects with ``tplab.cluster.connect_or_start(n=n_ranks, cluster_id=cluster_id)``: the
cluster started here is shared by all notebooks, so its start-up (seconds) is paid once.
"""

from __future__ import annotations

import html
import os
import re
import time
from pathlib import Path

DEMO_CLUSTER_ID = "tplab-demo"


def kernel_transport() -> str:
    """How a notebook's kernel should talk to Jupyter here: "ipc" (ZeroMQ over Unix sockets, the socket files
    in Jupyter's private runtime folder) where that works, else "tcp" (ports on 127.0.0.1). IPC opens no port
    another local user could reach, and ipykernel 7 warns that TCP is unencrypted. It needs Unix sockets (not
    Windows) and a runtime folder short enough for their names: a socket's path holds at most 107 bytes, and
    the kernel's are the folder plus "/kernel-<36-character id>-ipc-<n>" (50 more). ``make lab`` asks too."""
    if os.name != "posix":
        return "tcp"
    from jupyter_core.paths import jupyter_runtime_dir

    return "ipc" if len(os.fsencode(jupyter_runtime_dir())) + 50 <= 107 else "tcp"


def _kernel_over_unix_sockets() -> dict:
    """papermill's keyword for a kernel over Unix sockets where ``kernel_transport`` says so (else none)."""
    if kernel_transport() != "ipc":
        return {}
    import uuid

    from jupyter_client.manager import AsyncKernelManager
    from jupyter_core.paths import jupyter_runtime_dir
    from traitlets import default

    class UnixSocketKernelManager(AsyncKernelManager):
        @default("transport")
        def _transport_default(self):
            return "ipc"

        @default("ip")
        def _ip_default(self):  # (jupyter_client's default, "kernel-ipc", is relative: to the kernel's folder
            folder = jupyter_runtime_dir()   # when it binds, to this process's when it connects)
            os.makedirs(folder, mode=0o700, exist_ok=True)
            return os.path.join(folder, f"kernel-{uuid.uuid4()}-ipc")
    return {"kernel_manager_class": UnixSocketKernelManager}


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
                progress_bar=False, log_output=False, **_kernel_over_unix_sockets(),
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
    index = write_index(out, results, note=f"Executed by tplab demo on {ranks} MPI ranks, "
                                           f"{time.strftime('%Y-%m-%d %H:%M')}. Each page shows a notebook's "
                                           "code, outputs and figures; make lab opens them to run yourself.")
    print(f"reading copy: {index}")
    return 0 if all(r["ok"] for r in results) else 1


def write_index(out_dir, results=None, *, title="tplab — the workbook, executed", note="") -> Path:
    """Write ``out_dir/index.html``: one line per executed notebook (its first heading, linked to its HTML
    copy, and the start of its first markdown cell), a link to ``figures/`` if it holds any, so a reader
    can look before running anything. ``results`` are execute_notebooks' (a failed notebook is marked);
    without them, every ``*.ipynb`` in ``out_dir``. Returns the path.

        write_index("build")        # after execute_notebooks(..., "build")
    """
    import nbformat

    out_dir = Path(out_dir)
    if results is None:
        results = [{"name": p.name, "ok": None, "error": None, "seconds": None, "paths": {"ipynb": str(p)}}
                   for p in sorted(out_dir.glob("*.ipynb"))]
    rows = []
    for r in results:
        executed = Path(r["paths"].get("ipynb", out_dir / r["name"]))
        heading, description = Path(r["name"]).stem, ""
        try:
            heading, description = _describe(nbformat.read(executed, as_version=4), heading)
        except (OSError, ValueError, AttributeError):  # not written, or not a notebook: the name only
            pass
        html_copy = Path(r["paths"].get("html", executed.with_suffix(".html")))
        link = html_copy.name if html_copy.is_file() and html_copy.parent.resolve() == out_dir.resolve() else None
        title_html = (f'<a href="{html.escape(link)}">{html.escape(heading)}</a>' if link
                      else html.escape(heading))
        status = ""
        if r.get("ok") is False:
            status = f' <span class="failed">FAILED: {html.escape(r.get("error") or "")}</span>'
        elif r.get("seconds") is not None:
            status = f' <span class="time">({r["seconds"]:.0f} s)</span>'
        notebook_link = (f'<a href="{html.escape(executed.name)}">{html.escape(executed.name)}</a>'
                         if executed.is_file() and executed.parent.resolve() == out_dir.resolve()
                         else html.escape(r["name"]))
        files = f'<span class="files">{notebook_link}</span>'
        rows.append(f"<li>{title_html}{status}<br>" + " ".join(filter(None, [html.escape(description), files]))
                    + "</li>")
    figures = sorted((out_dir / "figures").glob("*.png"))
    page = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
            f"<title>{html.escape(title)}</title>", _INDEX_STYLE, "</head>", "<body>",
            f"<h1>{html.escape(title)}</h1>"]
    if note:
        page.append(f"<p>{html.escape(note)}</p>")
    page += ["<ul>", *rows, "</ul>"] if rows else ["<p>No executed notebooks here.</p>"]
    if figures:
        count = f"{len(figures)} figure" + ("s" if len(figures) != 1 else "")
        page.append(f'<p><a href="figures/">figures/</a>: the {count} the notebooks saved (PNG)</p>')
    page += ["</body>", "</html>", ""]
    index = out_dir / "index.html"
    index.write_text("\n".join(page), encoding="utf-8")
    return index


_INDEX_STYLE = ("<style>body{font-family:sans-serif;max-width:52em;margin:2em auto;padding:0 1em;line-height:1.45}"
                "ul{list-style:none;padding-left:0}li{margin-bottom:.9em}"
                ".files,.time{color:#777;font-size:.85em}.failed{color:#b00}</style>")


def _describe(notebook, fallback: str) -> tuple[str, str]:
    """(first heading, first paragraph after it as plain text, a sentence or two) of the first markdown
    cell; the heading is ``fallback`` when that cell has none."""
    cell = next((c for c in notebook.cells if c.cell_type == "markdown" and c.source.strip()), None)
    if cell is None:
        return fallback, ""
    heading, paragraphs, current = None, [], []
    for line in cell.source.splitlines():
        match = re.match(r"\s{0,3}#{1,6}\s+(.*)", line)
        if match and heading is None and not paragraphs and not current:
            heading = _plain(match.group(1))
        elif line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    text = next((_plain(p) for p in paragraphs if not p.startswith(("```", "|", "<", "#"))), "")
    return heading or fallback, _shorten(text)


def _plain(markdown: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", markdown)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)                          # HTML tags (<sup>, <br>)
    text = re.sub(r"(\*\*|__|\*|`)", "", text)                   # emphasis and code marks
    return re.sub(r"\s+", " ", text).strip()


def _shorten(text: str, limit=240) -> str:
    """Whole sentences up to ``limit`` characters; when that leaves fewer than ``limit // 3``, the next
    sentence too, cut at a word (so is a first sentence longer than ``limit``)."""
    kept = ""
    for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z(])", text):
        if len(kept) >= limit // 3 and len(kept) + 1 + len(sentence) > limit:
            break
        kept = f"{kept} {sentence}".strip()
    if len(kept) > limit:
        kept = kept[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " …"
    elif kept.endswith(":"):  # a paragraph that introduces a table or a list
        kept = kept[:-1] + " …"
    return kept


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
