# tplab — on a fresh machine with Python >= 3.10 (with venv and pip) and make:
#   make setup  create .venv and install tplab with everything it needs (the other targets do it first if needed)
#   make lab    JupyterLab on 127.0.0.1 with a token; open notebooks/00_cluster.ipynb first
#   make demo   start an MPI cluster of N engines, execute the notebooks into build/ (.ipynb, .html, and
#               build/index.html linking them: a reading copy), stop it
#   make test   check the import layers (lint-imports), run the whole test suite (unit, MPI at several rank
#               counts, notebooks; as root with iproute2 also MPI across 2 nodes made of network namespaces)
#   make browser-test  notebooks 00, 01, 03, 05, 06 run in a real browser: JupyterLab driven by the system's Chromium
#               through Playwright (Run All, no errors, figures and the exercise report shown); screenshots
#               in build/browser/. Needs chromium (Debian: apt-get install chromium), not `playwright install`
#
# On a laptop, create .venv with the small CPU build of torch, whichever target runs first:
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu      (then make lab / demo / test)
# .venv is created once; rm -rf .venv to create it again with other variables. torch comes from pip (which
# honours pip.conf's local wheels); the rest from uv where it installs (several times faster), else pip.
#
# Variables:
#   N=4                    MPI engines for make demo
#   PYTHON=python3         interpreter that creates the venv
#   TORCH="torch==2.13.0"  torch requirement installed first; from PyPI's default index on Linux that is the
#                          CUDA build (GBs): on a GPU node TORCH=torch takes it as is; TORCH= skips torch
#   TORCH_INDEX=URL        where torch comes from: https://download.pytorch.org/whl/cpu for the small CPU build
#                          (a few hundred MB), the laptop choice for every target (setup, lab, demo, test)
#   MPI=mpich              MPI from the PyPI wheel; MPI= uses the system MPI that mpi4py builds against
#   TEST_WORKERS=2         pytest workers for make test (pytest-xdist; the suite waits on subprocesses much of
#                          the time, so two workers fit two cores); TEST_WORKERS=0 runs it in one process
#   CHROMIUM=PATH          the browser for make browser-test (default: chromium on PATH)

PYTHON ?= python3
VENV   ?= .venv
N      ?= 4
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=
MPI    ?= mpich
PYTEST_ARGS ?=
TEST_WORKERS ?= 2

BIN   := $(abspath $(VENV))/bin
EXTRAS  = $(if $(MPI),mpich$(comma))notebooks,test
STAMP := $(VENV)/.tplab-installed
BROWSER_STAMP := $(VENV)/.tplab-browser-installed
comma := ,

# mpiexec, ipcluster and jupyter come from the venv; one thread per rank (ranks share few cores)
export PATH := $(BIN):$(PATH)
export OMP_NUM_THREADS ?= 1

.PHONY: setup test demo lab browser-test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(if $(TORCH),$(BIN)/python -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)))
	$(BIN)/python -m pip install -q uv && $(BIN)/uv pip install -q --python $(BIN)/python -e ".[$(EXTRAS)]" \
	  || $(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	$(BIN)/python -m tplab info
	touch $@

test: setup
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

demo: setup
	$(BIN)/tplab demo --ranks $(N) --out build

lab: setup
	$(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 \
	    --KernelManager.transport=$$($(BIN)/python -c 'from tplab.lab.demo import kernel_transport; print(kernel_transport())') \
	    --ServerApp.root_dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

$(BROWSER_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[browser]"
	touch $@

browser-test: $(BROWSER_STAMP)
	$(BIN)/python scripts/browser_check.py --out build/browser $(if $(CHROMIUM),--chromium $(CHROMIUM))

clean:
	rm -rf build .pytest_cache .hypothesis
