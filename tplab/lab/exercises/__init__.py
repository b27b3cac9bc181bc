"""Exercises for the notebooks, with checkers that run the reader's code and say what is wrong.

    runner.py      run_cases: the reader's function on every rank with deadlines, a side channel that stops
                   every rank as soon as one fails, values and bytes on the wire checked, one report for all
    predict.py     check_prediction: "predict, then run" questions
    allreduce.py   01: check_allreduce (any algorithm, or the ring's exact traffic), check_reduce_scatter
    costs.py       02: check_ring_time, check_busiest_bytes
    tuning.py      03: check_crossover, check_decision
    megatron.py    04: check_column_parallel, check_row_parallel
    sequence.py    05: check_allgather_attention, check_zigzag_positions
    overlap.py     06: check_overlapped_mlp, check_pipeline_time
    balance.py     07: check_lpt, check_gpipe
    fewer_syncs.py 08: check_sync_count, check_parallel_run
    moe.py         09: check_dispatch_order, check_alltoall
    solutions.py   one solution to each (the notebooks run them only when asked)

A checker of an exercise with communication is called on every rank (``cluster.run(check_allreduce, fn)``)
and returns the same report everywhere; the others run in the notebook itself. ``format_report`` prints one.
"""

from tplab.lab.exercises.allreduce import (
           check_allreduce,
           check_reduce_scatter,
           default_cases,
)
from tplab.lab.exercises.balance import check_gpipe, check_lpt
from tplab.lab.exercises.costs import check_busiest_bytes, check_ring_time
from tplab.lab.exercises.fewer_syncs import check_parallel_run, check_sync_count
from tplab.lab.exercises.megatron import check_column_parallel, check_row_parallel
from tplab.lab.exercises.moe import check_alltoall, check_dispatch_order
from tplab.lab.exercises.overlap import check_overlapped_mlp, check_pipeline_time
from tplab.lab.exercises.predict import check_prediction
from tplab.lab.exercises.runner import (
           Case,
           ExerciseComm,
           format_report,
           passed,
           run_cases,
           run_local,
)
from tplab.lab.exercises.sequence import (
           check_allgather_attention,
           check_zigzag_positions,
)
from tplab.lab.exercises.tuning import check_crossover, check_decision

__all__ = ["Case", "ExerciseComm", "check_allgather_attention", "check_allreduce", "check_alltoall",
           "check_busiest_bytes", "check_column_parallel", "check_crossover", "check_decision",
           "check_dispatch_order", "check_gpipe", "check_lpt", "check_overlapped_mlp", "check_parallel_run",
           "check_pipeline_time", "check_prediction", "check_reduce_scatter", "check_ring_time",
           "check_row_parallel", "check_sync_count", "check_zigzag_positions", "default_cases", "format_report",
           "passed", "run_cases", "run_local"]
