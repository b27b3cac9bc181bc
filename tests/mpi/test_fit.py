"""Fitting α, β, γ under mpiexec: collective, finite, the same everywhere. (No timing is asserted: the
numbers depend on the machine and its load; see tplab.cost.fit for what they mean.)"""

import math

from mpitest import COMM, agree, same_on_every_rank

from tplab.lab.bench import sweep
from tplab.comm import MPIComm
from tplab.cost import Machine, compare, fit_on, measure_exchange

SIZES = [8, 512, 32768, 262144]


def test_fit_on_is_collective_positive_finite_and_identical():
    comm = MPIComm(COMM.Dup())
    machine, exchange, reduction = fit_on(comm, sizes=SIZES, iters=5)
    values = (machine.alpha, machine.beta, machine.gamma, machine.entry)
    ok = (isinstance(machine, Machine) and all(math.isfinite(v) and v > 0 for v in values)
          and machine.entry_per_byte == 0.0)  # the result's first touch is in γ
    agree(ok, f"fitted {machine}")
    agree(same_on_every_rank((machine, exchange, reduction)), "fit_on differs between ranks")
    agree([r["size"] for r in exchange] == SIZES and len(reduction) == len(SIZES), f"rows {exchange} {reduction}")
    comm.mpi.Free()


def test_fit_on_without_entry_is_the_lecture_model():
    comm = MPIComm(COMM.Dup())
    machine, _, _ = fit_on(comm, sizes=[8, 4096], iters=3, entry=False)
    agree(machine.entry == machine.entry_per_byte == machine.step == 0.0 and machine.alpha > 0, f"{machine}")
    comm.mpi.Free()


def test_exchange_rows_are_the_slowest_ranks():
    comm = MPIComm(COMM.Dup())
    rows = measure_exchange(comm, [8, 4096], iters=3)
    agree(same_on_every_rank(rows) and all(r["time_s"] > 0 for r in rows), f"rows {rows}")
    comm.mpi.Free()


def test_compare_adds_columns_to_bench_rows():
    comm = MPIComm(COMM.Dup())
    machine = Machine(alpha=5e-6, beta=1e-10, gamma=1e-10)
    rows = sweep("allreduce", ["ring", "builtin"], [64, 4096], iters=2, warmup=1, comm=comm)
    out = compare(rows, machine)
    ring = [r for r in out if r["algorithm"] == "ring"]
    builtin = [r for r in out if r["algorithm"] == "builtin"]
    ok = (len(out) == len(rows) and all({"predicted_us", "error"} <= set(r) for r in out)
          and all(r["predicted_us"] >= 0 and math.isfinite(r["error"]) for r in ring)  # 0 on one rank
          and all(math.isnan(r["predicted_us"]) for r in builtin))
    agree(ok, f"compare gave {out}")
    comm.mpi.Free()
