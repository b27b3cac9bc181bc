"""The ``tplab`` command.

    tplab info                       versions, MPI library, GPUs
    tplab demo --ranks 4 --out build start a local MPI cluster, execute the notebooks, summarise, stop
"""

from __future__ import annotations

import argparse
import sys


def cmd_info(args) -> int:
    import platform

    import numpy

    import tplab

    print(f"tplab {tplab.__version__}, Python {platform.python_version()}, numpy {numpy.__version__}")
    try:
        from mpi4py import MPI

        print(f"mpi4py {__import__('mpi4py').__version__}; {MPI.Get_library_version().splitlines()[0].strip()}")
    except Exception as e:  # noqa: BLE001 - report, don't fail: info is a diagnostic
        print(f"mpi4py: not usable ({e})")
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"torch {torch.__version__}; CUDA GPUs: {gpus}")
    except ImportError:
        print("torch: not installed")
    return 0


def cmd_demo(args) -> int:
    from tplab.demo import run_demo

    return run_demo(ranks=args.ranks, out=args.out, notebooks=args.notebooks, timeout=args.timeout)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tplab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, MPI library and GPUs")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("demo", help="execute the notebooks on a local MPI cluster into an output folder")
    p.add_argument("--ranks", "-n", type=int, default=4, help="MPI engines (default 4)")
    p.add_argument("--out", default="build", help="output folder (default build/)")
    p.add_argument("--notebooks", nargs="*", default=None, help="notebooks to run (default: all)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell (default 900)")
    p.set_defaults(func=cmd_demo)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
