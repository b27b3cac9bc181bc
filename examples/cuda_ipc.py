"""All-reduce through peer memory (CUDA IPC), single node: every GPU reads the others' buffers directly.

(An example kept for history, no longer part of the tplab package: it was tplab.comm.cuda_ipc, the first,
host-synchronised version of what tplab.gpu_collectives.peer_memory now does with flags in GPU memory.
examples/gpu_ipc_allreduce.py imports it from this folder; tests/gpu/test_gpu_cuda_ipc_example.py tests it.)

On one NVLink node a GPU can map another GPU's memory into its own address space (CUDA IPC: the owner
exports a handle, the others open it) and a kernel can then *read* that memory over NVLink as if it were
local. Two all-reduces follow, both with a fixed order of summation, so every rank gets bitwise the same
result:

    one_shot   every rank reads all p input buffers and sums them (in rank order) itself.
               One round; each rank reads (p-1)·n bytes over NVLink: for small messages.
    two_shot   reduce-scatter, then allgather, both by reading peers: rank r sums block r of all p
               buffers (in rank order) into its own buffer; then every rank copies block q from rank q.
               Each rank reads 2(p-1)/p·n bytes, like the ring, but in 2 rounds instead of 2(p-1),
               and from all peers at once (every NVLink busy): for large messages.

    peers = PeerBuffers(mpi_comm, max_bytes)        # collective: one IPC buffer per rank, all mapped
    y = peer_allreduce(x, peers, "two_shot")         # x: a 1-D CuPy array on this rank's GPU
    peers.close()                                    # collective

The input is first copied into this rank's shared buffer (the others can only read memory that was
exported). Between rounds the ranks synchronise on the host (stream drained, then MPI_Barrier): simple
and correct, a few microseconds each; the production versions (vLLM's custom all-reduce, TensorRT-LLM)
set and poll flags in peer memory instead, inside the kernels, so that nothing waits on the host and
the whole all-reduce can be captured in a CUDA graph. That is the next step for small messages.
"""

from __future__ import annotations

from functools import lru_cache

from tplab.toolkit.blocks import block_bounds

ALGORITHMS = ("one_shot", "two_shot")


class PeerBuffers:
    """One GPU buffer of ``nbytes`` per rank, exported with CUDA IPC and opened by every other rank of
    ``mpi_comm`` (all on one node, each on its own GPU). ``views[q]`` is rank q's buffer as bytes."""

    def __init__(self, mpi_comm, nbytes: int):
        import cupy

        rt = cupy.cuda.runtime
        self.mpi, self.nbytes = mpi_comm, int(nbytes)
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.device = cupy.cuda.Device().id
        self._own = rt.malloc(self.nbytes)  # a whole allocation of its own: IPC exports allocations
        handles = mpi_comm.allgather(rt.ipcGetMemHandle(self._own))
        self._opened, self.views = [], []
        for q, handle in enumerate(handles):
            if q == self.rank:
                pointer = self._own
            else:
                pointer = rt.ipcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess)
                self._opened.append(pointer)
            memory = cupy.cuda.UnownedMemory(pointer, self.nbytes, self, self.device)
            self.views.append(cupy.ndarray((self.nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0)))

    def barrier(self) -> None:
        """Everything this rank queued is done, and so is every other rank's."""
        import cupy

        cupy.cuda.get_current_stream().synchronize()
        self.mpi.Barrier()

    def typed(self, dtype, count: int) -> list:
        """Every rank's buffer as ``count`` elements of ``dtype``."""
        return [v[: count * dtype.itemsize].view(dtype) for v in self.views]

    def close(self) -> None:
        import cupy

        self.barrier()  # nobody reads our buffer any more
        rt = cupy.cuda.runtime
        for pointer in self._opened:
            rt.ipcCloseMemHandle(pointer)
        rt.free(self._own)
        self._opened, self.views = [], []


@lru_cache(maxsize=None)
def sum_in_rank_order(p: int):
    """An elementwise kernel out = ((in0 + in1) + in2) + ...: the same order on every rank."""
    import cupy

    expression = "in0"
    for i in range(1, p):
        expression = f"({expression} + in{i})"
    inputs = ", ".join(f"T in{i}" for i in range(p))
    return cupy.ElementwiseKernel(inputs, "T out", f"out = {expression};", f"tplab_sum_in_rank_order_{p}")


def peer_allreduce(x, peers: PeerBuffers, algorithm: str = "two_shot"):
    """The sum over ranks of ``x`` (a 1-D CuPy array of at most ``peers.nbytes`` bytes), on every rank,
    bitwise identical. Collective."""
    import cupy

    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown peer all-reduce {algorithm!r}; choose one of {ALGORITHMS}")
    if x.nbytes > peers.nbytes:
        raise ValueError(f"{x.nbytes} bytes do not fit the {peers.nbytes}-byte peer buffers")
    p, r, n = peers.size, peers.rank, x.size
    buffers = peers.typed(x.dtype, n)
    out = cupy.empty_like(x)
    peers.barrier()                        # the last call's readers are done with my buffer
    cupy.copyto(buffers[r], x)             # my input, where the others can read it
    peers.barrier()                        # every input is in place
    if algorithm == "one_shot":
        sum_in_rank_order(p)(*buffers, out)  # read all p inputs, sum in rank order
        return out
    bounds = block_bounds(n, p)
    mine = slice(bounds[r], bounds[r + 1])
    sum_in_rank_order(p)(*(b[mine] for b in buffers), buffers[r][mine])  # reduce-scatter: block r, here
    peers.barrier()                        # every block is reduced, in its owner's buffer
    for q in range(p):                     # allgather: block q from its owner
        block = slice(bounds[q], bounds[q + 1])
        out[block] = buffers[q][block]
    return out
