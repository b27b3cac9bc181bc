"""tplab.lab.demo.write_index: build/index.html, the reading copy's table of contents (no cluster needed)."""

import re
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from tplab.lab.demo import _shorten, write_index


def fake_executed(folder: Path, name, *cells, html=True) -> Path:
    path = folder / name
    nbformat.write(new_notebook(cells=list(cells)), path)
    if html:
        path.with_suffix(".html").write_text("<html>executed</html>")
    return path


def test_index_lists_each_notebook_with_heading_description_and_links(tmp_path):
    fake_executed(tmp_path, "00_cluster.ipynb",
                  new_code_cell("x = 1"),  # a code cell first: the first *markdown* cell counts
                  new_markdown_cell("# 00 — An MPI cluster inside Jupyter\n\nAn MPI program is **p processes "
                                    "started together** by a launcher\n(`mpiexec -n 4`). Each process knows "
                                    "its [rank](https://example.org).\n\nThat is what ipyparallel gives us:"),
                  new_markdown_cell("# A later heading"))
    fake_executed(tmp_path, "01_allreduce.ipynb",
                  new_markdown_cell("# 01 — `AllReduce` from *scratch* & co\n\n| a | table |\n|---|---|\n\n"
                                    "Here we build 2<sup>k</sup> & more."), html=False)
    fake_executed(tmp_path, "02_plain.ipynb", new_code_cell("print(1)"))  # no markdown at all
    (tmp_path / "figures").mkdir()
    for name in ["01_a.png", "01_b.png"]:
        (tmp_path / "figures" / name).write_bytes(b"\x89PNG")

    index = write_index(tmp_path, note="Executed on 4 ranks.")
    page = index.read_text()

    assert index == tmp_path / "index.html"
    assert "<title>tplab — the workbook, executed</title>" in page and "Executed on 4 ranks." in page
    items = re.findall(r"<li>(.*?)</li>", page, re.DOTALL)
    assert len(items) == 3
    first, second, third = items
    # the first heading links to the HTML copy; the first paragraph, as plain text, describes it
    assert '<a href="00_cluster.html">00 — An MPI cluster inside Jupyter</a>' in first
    assert ("An MPI program is p processes started together by a launcher (mpiexec -n 4). Each process knows "
            "its rank.") in first
    assert "ipyparallel" not in first and "later heading" not in first
    assert '<a href="00_cluster.ipynb">00_cluster.ipynb</a>' in first
    # no HTML copy: no link; markup escaped; tables skipped, tags stripped
    assert "01 — AllReduce from scratch &amp; co<br>" in second and "01_allreduce.html" not in second
    assert "Here we build 2k &amp; more." in second and "table" not in second
    assert third.startswith('<a href="02_plain.html">02_plain</a><br><span')  # no markdown: the name
    assert '<a href="figures/">figures/</a>: the 2 figures' in page


def test_index_follows_the_results_and_marks_failures(tmp_path):
    ran = fake_executed(tmp_path, "00_a.ipynb", new_markdown_cell("# 00 — A\n\nFirst."))
    failed = fake_executed(tmp_path, "01_b.ipynb", new_markdown_cell("# 01 — B\n\nSecond."))
    fake_executed(tmp_path, "99_stale.ipynb", new_markdown_cell("# from an earlier run"))  # not in results
    results = [
        {"name": "00_a.ipynb", "seconds": 12.3, "ok": True, "error": None,
         "paths": {"ipynb": str(ran), "html": str(ran.with_suffix(".html"))}},
        {"name": "01_b.ipynb", "seconds": 4.0, "ok": False, "error": "ValueError: <boom> (cell [3])",
         "paths": {"ipynb": str(failed), "html": str(failed.with_suffix(".html"))}},
        {"name": "02_lost.ipynb", "seconds": 1.0, "ok": False, "error": "DeadKernelError: died", "paths": {}},
    ]
    page = write_index(tmp_path, results).read_text()

    items = re.findall(r"<li>(.*?)</li>", page, re.DOTALL)
    assert len(items) == 3 and "earlier run" not in page
    assert '<a href="00_a.html">00 — A</a> <span class="time">(12 s)</span>' in items[0]
    assert 'FAILED: ValueError: &lt;boom&gt; (cell [3])' in items[1] and '<a href="01_b.html">' in items[1]
    assert items[2].startswith("02_lost <span class=\"failed\">FAILED: DeadKernelError: died")  # nothing written
    assert "figures/" not in page  # no figures folder, no link


def test_index_of_an_empty_folder(tmp_path):
    assert "No executed notebooks here." in write_index(tmp_path).read_text()


def test_shorten_keeps_whole_sentences():
    assert _shorten("One. Two.") == "One. Two."
    long = "A first sentence of some length. " + "word " * 100
    assert _shorten(long, limit=120) == "A first sentence of some length. " + ("word " * 17).strip() + " …"
    assert _shorten("x" * 50 + ". Second sentence here.", limit=60) == "x" * 50 + "."
    assert _shorten("It has three numbers:") == "It has three numbers …"
