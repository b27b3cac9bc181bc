"""tplab.overlap — communication that runs while the ranks compute, and timelines that show it.

    nonblocking.py        iallreduce / ireduce_scatter / iallgather -> Handle (wait, test), for every
                          hand-written algorithm: a progress thread per communicator (host memory)
    progress_thread.py    that thread: FIFO, a duplicate communicator, MPI_THREAD_MULTIPLE, shutdown()
    handles.py            Handle: wait(), test()
    streams.py            the same for CUDA tensors: the collective on a side stream, events between
    mpi_progress.py       why MPI's own MPI_Iallreduce hides nothing unless something drives its progress
    chunked_mlp.py        OverlappedMLP (tensor- and sequence-parallel), OverlappedRowParallelLinear:
                          k chunks of tokens, chunk i's collective overlapping chunk i+1's compute
    query_blocks.py       QueryBlocks: Q, K, V once, attention and output projection by query range
    chunked_attention.py  OverlappedAttention (query blocks), OverlappedBlock (attention and MLP
                          pipelined across the block)
    factory.py            overlapped(layer, k): the overlapped version of a layer, block or stack
    micro_batches.py      MicroBatchPipeline: k micro-batches through a stack of blocks, every all-reduce
                          overlapping another micro-batch's compute, across layers too
    pipeline.py           chunk bounds; finished collectives wired back into autograd
    nullcomm.py           NullComm / without_communication: the layer with its collectives as no-ops
    trace.py              Tracer: per-rank compute / comm / wait intervals, a DataFrame, Chrome trace JSON
    metrics.py            exposed communication and hidden fraction; overlap_sweep over chunk counts
                          (optionally timed as CUDA graph replays: captured); pipeline_model
    experiments.py        notebook 06's experiments on a small TP block (run on every rank)
    (tplab.comm.shard_exchange: moving token shards under GEMMs -- MessageExchange, NullExchange)
    async_tp.py           AsyncTPBlock: a block on sequence shards whose all-gathers and reduce-scatters move
                          shard by shard under its GEMMs (async tensor parallelism; forward only)

    h = iallreduce(x, comm, algorithm="ring"); ...compute...; y = h.wait()
    fast = overlapped(parallel_mlp, chunks=4)          # equal to parallel_mlp(x) to rounding
    df = overlap_sweep(layer, x, comm, [1, 2, 4, 8])   # exposed_ms, hidden_fraction per chunk count
"""

from tplab.overlap.chunked_attention import OverlappedAttention, OverlappedBlock
from tplab.overlap.factory import overlapped
from tplab.overlap.chunked_mlp import OverlappedMLP, OverlappedRowParallelLinear
from tplab.overlap.micro_batches import MicroBatchPipeline
from tplab.overlap.metrics import collectives_of, overlap_sweep, pipeline_model, time_forward
from tplab.overlap.mpi_progress import progress_experiment
from tplab.overlap.handles import Handle, waitall
from tplab.overlap.nonblocking import iallgather, iallreduce, ireduce_scatter
from tplab.overlap.progress_thread import running_threads, shutdown
from tplab.overlap.nullcomm import NullComm, with_comm, without_communication
from tplab.overlap.trace import Tracer, chrome_trace, write_chrome_trace

__all__ = [
    "Handle",
    "MicroBatchPipeline",
    "NullComm",
    "OverlappedAttention",
    "OverlappedBlock",
    "OverlappedMLP",
    "OverlappedRowParallelLinear",
    "Tracer",
    "chrome_trace",
    "collectives_of",
    "iallgather",
    "iallreduce",
    "ireduce_scatter",
    "overlap_sweep",
    "overlapped",
    "pipeline_model",
    "progress_experiment",
    "running_threads",
    "shutdown",
    "time_forward",
    "waitall",
    "with_comm",
    "without_communication",
    "write_chrome_trace",
]
