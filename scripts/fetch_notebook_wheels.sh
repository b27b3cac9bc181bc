#!/usr/bin/env bash
# Download the wheels a GPU node without internet needs to run the notebooks (scripts/gpu_notebooks.sh) into
# DIR, here, on a machine with internet; copy DIR to the node with the checkout. They are ipyparallel,
# papermill and the Jupyter kernel machinery, for CPython PY_VERSION (default 3.12) on x86-64 Linux.
#
#   bash scripts/fetch_notebook_wheels.sh [DIR]        # default build/notebook-wheels; ~19 MB
#   bash scripts/gpu_notebooks.sh [OUT_DIR]            # on the node: WHEELS=DIR if you put them elsewhere
#
# The list is the whole dependency closure of ipyparallel, papermill, nbclient, nbformat, ipykernel and
# jupyter_client, pinned (resolved for Python 3.12 on 2026-11-26), minus what a GPU node's Python with
# torch and CuPy usually holds already (numpy, torch, cupy, mpi4py, pandas, matplotlib, jinja2, aiohttp, ...).
# A few small packages such a Python also has ride along as fallbacks: pip installs one only where the
# node's copy is too old for a requirement (ipython 9 needs psutil >= 7, jupyter_client typing_extensions >= 4.13).
set -euo pipefail
DIR=$(realpath -m "${1:-$(dirname "$0")/../build/notebook-wheels}")
cd "$(dirname "$0")/.."
PIP=${PIP:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 ) -m pip}

MISSING=(  # usually not on a GPU node: the closure itself
  ipyparallel==9.2.0 papermill==2.7.0 nbclient==0.11.0 nbformat==5.11.1 ipykernel==7.4.0 jupyter_client==8.10.0
  jupyter_core==5.9.1 traitlets==5.16.1 pyzmq==27.3.0 tornado==6.6.1 ipython==9.18.1 ipython_pygments_lexers==1.1.1
  decorator==5.3.1 comm==0.2.3 debugpy==1.8.22 matplotlib_inline==0.2.2 nest_asyncio2==1.7.4 jedi==0.20.1
  parso==0.8.7 pexpect==4.9.0 ptyprocess==0.7.0 prompt_toolkit==3.0.53 wcwidth==0.9.4 stack_data==0.6.3
  executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4 platformdirs==4.14.8 fastjsonschema==2.22.3
  jsonschema==4.26.0 jsonschema_specifications==2025.9.1 referencing==0.37.0 rpds_py==2026.9.1
  entrypoints==0.4.2 tenacity==9.2.1
)
FALLBACKS=(  # usually on the node, maybe too old for the closure's lower bounds: installed only where needed
  psutil==7.2.2 typing_extensions==4.16.0 packaging==26.4 pygments==2.21.0 attrs==26.1.0 tqdm==4.70.1
  python_dateutil==4.0.0 tzdata==2026.6 click==8.5.1 pyyaml==6.0.4 requests==2.34.2 certifi==2026.10.19.post1
  charset_normalizer==3.5.3 idna==3.20 urllib3==2.8.0
)
mkdir -p "$DIR"
$PIP download --quiet --dest "$DIR" --no-deps --only-binary=:all: --implementation cp --python-version "${PY_VERSION:-3.12}" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  "${MISSING[@]}" "${FALLBACKS[@]}"
count=$(ls "$DIR"/*.whl | wc -l)
echo "$count wheels, $(du -sh "$DIR" | cut -f1) in $DIR"
[ "$count" -eq $(( ${#MISSING[@]} + ${#FALLBACKS[@]} )) ] || { echo "expected $(( ${#MISSING[@]} + ${#FALLBACKS[@]} )) wheels" >&2; exit 1; }
