"""tplab.cost — what communication costs, by formula, next to what it costs by measurement.

    formulas.py        Machine(alpha, beta, gamma); predict(collective, algorithm, p, n, machine) for every
                       algorithm tplab has, non-powers of two folded as tplab folds them; formula_text()
    two_level.py       TwoLevelMachine(intra, inter, ranks_per_node): a step lasts as long as its slowest
                       link; the hierarchical allreduce
    traffic.py         traffic(collective, algorithm, p, n): messages and bytes, busiest rank and total
                       (checked exactly against the Communicator's counters in tests/mpi/test_traffic.py)
    alltoall.py        all-to-all, pairwise exchange vs Bruck: predict("alltoall", "bruck", p, n, m),
                       alltoall_traffic, crossover_bytes (below it Bruck's fewer messages win)
    fit.py             fit_on(comm): α, β, γ (and tplab's entry cost) measured on the machine at hand;
                       fit_on_timings(rows): the same five numbers fitted to collective timings;
                       compare(rows, machine): predicted next to measured
    tensor_parallel.py what a transformer layer sends under TP, and the comm/compute ratio
    sequence_parallel.py  bytes, messages, memory and causal work of SP attention; SP vs TP; why
                       the course project's CPU-staged all-gathers made 4 GPUs slower than one (staged_vs_direct)

n is nccl-tests' size S in bytes: allreduce, bytes per rank; reduce_scatter, the full input vector;
allgather, the gathered total; broadcast and reduce, the message. p = ranks; times in seconds.

    m = Machine(alpha=5e-6, beta=1 / 10e9, gamma=1 / 20e9)
    predict("allreduce", "ring", 8, 1 << 20, m)        # seconds
    formula_text("allreduce", "ring")                  # '2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ'
"""

from tplab.cost.alltoall import alltoall_traffic, crossover_bytes
from tplab.cost.fit import (
    compare,
    fit_machine,
    fit_on,
    fit_on_timings,
    fit_reduction,
    fit_step,
    measure_entry,
    measure_exchange,
    measure_reduction,
)
from tplab.cost.formulas import FORMULAS, CriticalPath, Machine, critical_path, formula_text
from tplab.cost.predict import predict
from tplab.cost.sequence_parallel import attention_bytes, attention_messages, causal_work, sp_vs_tp, staged_vs_direct
from tplab.cost.tensor_parallel import layer_model, tensor_parallel_allreduce_cost
from tplab.cost.traffic import allreduce_traffic, traffic
from tplab.cost.two_level import TwoLevelMachine

__all__ = [
    "FORMULAS",
    "CriticalPath",
    "Machine",
    "TwoLevelMachine",
    "allreduce_traffic",
    "alltoall_traffic",
    "attention_bytes",
    "attention_messages",
    "causal_work",
    "compare",
    "critical_path",
    "crossover_bytes",
    "fit_machine",
    "fit_on",
    "fit_on_timings",
    "fit_reduction",
    "fit_step",
    "formula_text",
    "layer_model",
    "measure_entry",
    "measure_exchange",
    "measure_reduction",
    "predict",
    "sp_vs_tp",
    "staged_vs_direct",
    "tensor_parallel_allreduce_cost",
    "traffic",
]
