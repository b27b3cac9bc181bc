"""pyproject.toml and environment.yml describe the same stack."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"torch": "pytorch"}  # PyPI name -> conda-forge name


def names(requirements):
    return {re.split(r"[<>=!\[ ;]", r.strip(), maxsplit=1)[0].lower() for r in requirements}


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = names(project["dependencies"]) | names(extras["notebooks"]) | names(extras["test"]) | names(extras["mpich"])
    wanted = {CONDA_NAMES.get(n, n) for n in wanted}
    listed = set()
    dependencies = (ROOT / "environment.yml").read_text().split("dependencies:", 1)[1]
    for line in dependencies.splitlines():
        m = re.match(r"\s+-\s+([A-Za-z0-9_.\-]+)", line)
        if m and not line.strip().startswith("- -e") and m.group(1) not in ("pip", "python"):
            listed.add(names([m.group(1)]).pop())
    assert wanted == listed, f"only in pyproject: {wanted - listed}; only in environment.yml: {listed - wanted}"
