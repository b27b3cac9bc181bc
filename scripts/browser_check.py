"""Run notebooks 00, 01, 03, 05 and 06 in a real browser: JupyterLab on 127.0.0.1, Debian's Chromium driven by Playwright.

    make browser-test                                  # = .venv/bin/python scripts/browser_check.py
    python scripts/browser_check.py [00 01 ...] [--out build/browser] [--chromium PATH] [--timeout 600]

For each notebook: open it in JupyterLab, Run > Run All Cells from the menu, wait until every cell has
run and the kernel is idle, save it, and fail on
- an error output (output_type "error" in the saved notebook) or a cell that never ran (Run All stops at
  the first error),
- a stderr output with a traceback shown in the page,
- what the notebook must show missing: notebook 00 its first allreduce, notebook 01 a matplotlib figure
  (an <img> that loaded) and the exercise checker's reports, notebooks 03, 05 and 06 their figures (the
  reference sections' from data/ among them) and exercise reports.
Screenshots go to OUT/<nn>.png (plus OUT/01_report.png, and OUT/<nn>_error.png on an error).

JupyterLab serves copies of the notebooks (OUT/lab/notebooks, with OUT/lab/data linking to data/), so
neither the run nor JupyterLab's autosave writes outputs into notebooks/; the notebooks' figures land in
OUT/lab/build/. Kernels, IPython and Jupyter settings live in a temporary folder, so the clusters the
notebooks start are private to this run. At the end JupyterLab is stopped and every process it left (a
kernel, a cluster's controller, mpiexec, engines) is found by a marker in its environment and ended.

Playwright drives the system's Chromium (``executable_path``): no ``playwright install`` download.
Run All uses the notebooks' own parameters (4 ranks; notebook 01's timing sweep up to 1 MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "TPLAB_BROWSER_CHECK"  # set in JupyterLab's environment; its kernels, clusters and engines inherit it

# What each notebook must show once it ran (others: only no errors, every cell run).
EXPECT = {
    "00": {"texts": ["same as MPI: True"], "images": 0, "reports": 0},
    "01": {"texts": [], "images": 1, "reports": 2},  # the first attempt's report, the exercises' (skeletons: a
                                                      # student's Run All; solutions run only with show_solutions)
    # the notebooks whose reference sections plot the GPU results (28, 19 and 19 figures when written)
    "03": {"texts": [], "images": 20, "reports": 2},
    "05": {"texts": [], "images": 15, "reports": 2},
    "06": {"texts": [], "images": 15, "reports": 2},
}
REPORT = re.compile(r"(\d+) of (\d+) cases correct")

# JupyterLab settings for a quiet, fully rendered page: every cell in the DOM (no windowing), no news toast
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                       "checkForUpdates": False},
}

# The current notebook's session holds an idle kernel (window.jupyterapp: --LabApp.expose_app_in_browser)
KERNEL_READY_JS = """() => {
  const widget = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const session = widget && widget.sessionContext;
  return !!(session && session.isReady && !session.hasNoKernel && session.session && session.session.kernel
            && session.session.kernel.status === 'idle');
}"""

# The notebook's code cells' prompts and the kernel's state, read from the page
STATE_JS = """() => {
  const prompts = [...document.querySelectorAll('.jp-NotebookPanel .jp-CodeCell .jp-InputPrompt')]
    .map(e => e.textContent.trim());
  const indicator = document.querySelector('.jp-NotebookPanel .jp-Notebook-ExecutionIndicator');
  return {prompts, status: indicator ? indicator.dataset.status : null};
}"""


class CheckFailed(Exception):
    pass


def log(message):
    print(f"browser-check: {message}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", default=["00", "01", "03", "05", "06"],
                        help="notebook numbers (default: 00 01 03 05 06), or paths of .ipynb files")
    parser.add_argument("--out", default="build/browser", help="screenshots, logs and the served copies")
    parser.add_argument("--chromium", default=os.environ.get("CHROMIUM"),
                        help="the browser (default: $CHROMIUM, else chromium on PATH)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for one notebook's Run All")
    args = parser.parse_args(argv)

    chromium = args.chromium or shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        log("no chromium found (Debian: apt-get install chromium; or pass --chromium PATH)")
        return 2
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        log("playwright is not installed: pip install -e '.[browser]'")
        return 2

    notebooks = []
    for number in args.notebooks:
        if number.endswith(".ipynb") and Path(number).is_file():  # a notebook from elsewhere (say, a fixture)
            notebooks.append(Path(number).resolve())
            continue
        found = sorted((ROOT / "notebooks").glob(f"{number}*.ipynb"))
        if len(found) != 1:
            log(f"notebook {number!r}: found {[p.name for p in found] or 'none'}")
            return 2
        notebooks.append(found[0])

    out = Path(args.out).resolve()
    started = time.perf_counter()
    failures = run(notebooks, out, chromium, args.timeout)
    seconds = time.perf_counter() - started
    for failure in failures:
        log(f"FAILED {failure}")
    log(f"{len(notebooks) - len(failures)} of {len(notebooks)} notebooks passed in {seconds:.0f} s; "
        f"screenshots in {out}/")
    print(f"browser-check: {max(len(notebooks) - len(failures), 0)} passed, {len(failures)} failed", flush=True)
    return 1 if failures else 0


def run(notebooks, out: Path, chromium, timeout) -> list:
    """Serve copies of ``notebooks``, run each in Chromium, clean up; the failures, one line each."""
    lab = out / "lab"
    shutil.rmtree(lab, ignore_errors=True)
    for stale in out.glob("*.png"):
        stale.unlink()
    (lab / "notebooks").mkdir(parents=True)
    (lab / "build").mkdir()
    (lab / "data").symlink_to(ROOT / "data")  # notebook 01 plots the reference CSVs from ../data
    for notebook in notebooks:
        shutil.copy2(notebook, lab / "notebooks" / notebook.name)

    state = Path(tempfile.mkdtemp(prefix="tplab-browser-"))
    run_id, token, port = secrets.token_hex(8), secrets.token_hex(24), free_port()
    env = browser_env(state, run_id)
    server = None
    failures = []
    try:
        server = start_jupyterlab(lab, port, token, env, out / "jupyterlab.log")
        base = f"http://127.0.0.1:{port}"
        wait_for_server(server, base, token, out / "jupyterlab.log")
        failures = drive(notebooks, lab, out, chromium, base, token, timeout)
    except CheckFailed as e:
        failures.append(str(e))
    finally:
        left = stop(server, run_id)
        if left:
            failures.append(f"processes left behind after the clean-up: {left}")
        shutil.rmtree(state, ignore_errors=True)
    return failures


def browser_env(state: Path, run_id) -> dict:
    """JupyterLab's environment: private IPython and Jupyter folders, this checkout's tplab, the marker."""
    for name, settings in SETTINGS.items():
        path = state / "lab-settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings))
    bin_dir = os.path.dirname(sys.executable)  # mpiexec and ipcluster, beside this Python
    return dict(
        os.environ, IPYTHONDIR=str(state / "ipython"), JUPYTER_CONFIG_DIR=str(state / "jupyter-config"),
        JUPYTER_DATA_DIR=str(state / "jupyter-data"), JUPYTER_RUNTIME_DIR=str(state / "jupyter-runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(state / "lab-settings"), JUPYTERLAB_WORKSPACES_DIR=str(state / "lab-workspaces"),
        OMP_NUM_THREADS="1",
        PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
        PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
        **{MARKER: run_id})


def start_jupyterlab(lab: Path, port, token, env, log_path: Path):
    # expose_app_in_browser: window.jupyterapp, to wait for the notebook's kernel (KERNEL_READY_JS)
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
               f"--ServerApp.root_dir={lab}", "--LabApp.expose_app_in_browser=True",
               "--KernelManager.transport=ipc"]   # (as make lab: kernels over Unix sockets, not TCP ports)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-root")
    log(f"JupyterLab on 127.0.0.1:{port}, serving {lab}")
    with open(log_path, "wb") as f:
        return subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def wait_for_server(server, base, token, log_path: Path, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise CheckFailed(f"JupyterLab exited ({server.returncode}):\n{tail(log_path)}")
        try:
            api(base, token, "status")
            return
        except OSError:
            time.sleep(0.5)
    raise CheckFailed(f"JupyterLab did not answer within {timeout} s:\n{tail(log_path)}")


def api(base, token, path, method="GET"):
    request = urllib.request.Request(f"{base}/api/{path}", method=method,
                                     headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read()
    return json.loads(body) if body else None


def drive(notebooks, lab: Path, out: Path, chromium, base, token, timeout) -> list:
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    failures = []
    with sync_playwright() as playwright:
        args = ["--no-sandbox"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []  # root: no sandbox
        browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=args)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for notebook in notebooks:
                started = time.perf_counter()
                try:
                    run_notebook(page, notebook.name, lab, out, base, token, timeout)
                    log(f"{notebook.name}: OK in {time.perf_counter() - started:.0f} s")
                except (CheckFailed, PlaywrightError) as e:  # (a page that never showed what was awaited)
                    log(f"{notebook.name}: FAILED in {time.perf_counter() - started:.0f} s")
                    failures.append(f"{notebook.name}: {_first_lines(e)}")
                    if not (out / f"{key(notebook.name)}_error.png").exists():
                        page.screenshot(path=str(out / f"{key(notebook.name)}_failed.png"))
                finally:
                    try:  # shut its kernel down before the next
                        for session in api(base, token, "sessions"):
                            api(base, token, f"sessions/{session['id']}", method="DELETE")
                    except OSError as e:  # JupyterLab itself is gone: stop() cleans up
                        log(f"could not shut the kernels down: {e}")
        finally:
            browser.close()
    return failures


def run_notebook(page, name, lab: Path, out: Path, base, token, timeout):
    number = key(name)
    # ?reset: a fresh workspace, so only this notebook is open
    page.goto(f"{base}/lab/tree/notebooks/{name}?reset&token={token}")
    # (the toolbar says idle a moment before the notebook's session holds the kernel; Run All then would
    # ask which kernel to start: wait for the session itself)
    page.wait_for_function(KERNEL_READY_JS, timeout=120_000)
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")  # the notebook, full width
    log(f"{name}: kernel idle; Run > Run All Cells")
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    label = page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$"))
    page.locator(".lm-Menu-item", has=label).click()
    wait_until_done(page, name, timeout)

    copy = lab / "notebooks" / name
    before = copy.stat().st_mtime_ns
    page.keyboard.press("Control+s")  # save, to read the outputs as the notebook stores them
    page.wait_for_selector(".lm-TabBar-tab.jp-mod-current:not(.jp-mod-dirty)", timeout=30_000)
    deadline = time.monotonic() + 30
    while copy.stat().st_mtime_ns == before:
        if time.monotonic() > deadline:
            raise CheckFailed("Ctrl+S did not save the notebook within 30 s")
        time.sleep(0.2)
    import nbformat

    problems = []
    saved = nbformat.read(copy, as_version=4)
    code = [(i, c) for i, c in enumerate(saved.cells) if c.cell_type == "code"]
    for i, cell in code:
        for output in cell.get("outputs", []):
            if output.output_type == "error":
                problems.append(f"cell {i} raised {output.ename}: {_first_lines(output.evalue, 1)}")
    not_run = [i for i, c in code if c.execution_count is None]
    if not_run:
        problems.append(f"{len(not_run)} of {len(code)} code cells did not run (the first: cell {not_run[0]})")

    stderr = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    tracebacks = [text for text in stderr.all_text_contents() if "Traceback" in text]
    if tracebacks:
        problems.append(f"{len(tracebacks)} traceback(s) in the page, the first:\n{tracebacks[0][-1500:]}")
        first = stderr.filter(has_text="Traceback").first
        first.scroll_into_view_if_needed()
        page.screenshot(path=str(out / f"{number}_error.png"))

    expect = EXPECT.get(number, {"texts": [], "images": 0, "reports": 0})
    outputs = page.locator(".jp-OutputArea-output")
    text = "\n".join(outputs.all_text_contents())
    problems += [f"no output shows {t!r}" for t in expect["texts"] if t not in text]

    images = page.locator(".jp-OutputArea-output img")
    loaded = page.evaluate("""() => [...document.querySelectorAll('.jp-OutputArea-output img')]
        .filter(img => img.complete && img.naturalWidth > 0 && img.src.startsWith('data:image/png')).length""")
    if loaded < expect["images"]:
        problems.append(f"{loaded} figure(s) rendered (<img> loaded), expected at least {expect['images']}")

    reports = REPORT.findall(text)
    if len(reports) < expect["reports"]:
        problems.append(f"{len(reports)} exercise report(s) rendered, expected {expect['reports']}")

    # Screenshots: the notebook where it shows what it is about
    if expect["texts"]:
        outputs.filter(has_text=expect["texts"][0]).first.scroll_into_view_if_needed()
    elif images.count():
        images.first.scroll_into_view_if_needed()
    page.screenshot(path=str(out / f"{number}.png"))
    if reports:  # the checker on the notebook's first attempt (what it finds wrong), and on the last exercise
        cells = page.locator(".jp-CodeCell", has=page.locator(".jp-OutputArea-output", has_text=REPORT))
        cells.first.screenshot(path=str(out / f"{number}_report.png"))
        cells.last.screenshot(path=str(out / f"{number}_exercise.png"))
    log(f"{name}: {len(code) - len(not_run)} of {len(code)} code cells ran, {loaded} figures, "
        f"{len(reports)} exercise reports" + (f" (last: {reports[-1][0]} of {reports[-1][1]})" if reports else ""))
    if problems:
        raise CheckFailed("; ".join(problems))


def wait_until_done(page, name, timeout):
    """Until no cell is queued or running ([*]) and the kernel is idle, twice in a row; at least one cell
    must have run (so a check made before Run All took effect does not count)."""
    deadline, last_report, settled = time.monotonic() + timeout, time.monotonic(), 0
    while True:
        state = page.evaluate(STATE_JS)
        prompts, status = state["prompts"], state["status"]
        ran = sum(bool(re.fullmatch(r"\[\d+\]:", p)) for p in prompts)
        busy = any("*" in p for p in prompts) or status != "idle"
        if status in ("dead", "unknown", "terminating"):
            raise CheckFailed(f"the kernel is {status} after {ran} cells")
        settled = settled + 1 if (ran and not busy) else 0
        if settled >= 2:
            return
        if time.monotonic() > deadline:
            raise CheckFailed(f"Run All did not finish within {timeout:.0f} s "
                              f"({ran} of {len(prompts)} cells ran)")
        if time.monotonic() - last_report > 20:
            log(f"{name}: {ran} of {len(prompts)} code cells ran, kernel {status}")
            last_report = time.monotonic()
        time.sleep(1)


def stop(server, run_id) -> list:
    """Stop JupyterLab (it shuts its kernels down), then end every process still carrying this run's marker
    (a cluster a notebook left running). Returns those that would not die, as 'pid name'."""
    import psutil

    if server is not None and server.poll() is None:
        server.send_signal(signal.SIGTERM)  # jupyter-server shuts its kernels down on SIGTERM
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

    def marked():
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.pid != os.getpid() and proc.environ().get(MARKER) == run_id:
                    found.append(proc)
            except (psutil.Error, OSError):
                pass
        return found

    leftovers = marked()
    if leftovers:
        log(f"ending {len(leftovers)} processes left by the run: "
            + ", ".join(f"{p.pid} {cmdline(p)}" for p in leftovers[:8]))
        for proc in leftovers:
            try:
                proc.terminate()
            except psutil.Error:
                pass
        for proc in psutil.wait_procs(leftovers, timeout=5)[1]:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(leftovers, timeout=5)
    return [f"{p.pid} {cmdline(p)}" for p in marked()]


def cmdline(proc) -> str:
    try:
        return " ".join(proc.cmdline())[:100]
    except Exception:  # noqa: BLE001 - gone meanwhile
        return "?"


def key(name) -> str:
    """A notebook's number (screenshots are <number>.png), or its stem when it has none."""
    return name[:2] if name[:2].isdigit() else Path(name).stem


def _first_lines(error, n=12) -> str:
    return "\n".join(str(error).splitlines()[:n])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines=30) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(True)[-lines:])
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
