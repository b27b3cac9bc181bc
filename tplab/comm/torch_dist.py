"""torch.distributed's collectives (NCCL on GPUs, gloo on CPUs) as a tplab Communicator.

A transport of whole collectives only (``point_to_point = False``): every tplab collective on it runs
torch.distributed's own, whatever algorithm is named, so a model split with tplab's layers runs on the
vendor's collectives next to tplab's, for comparison:

    comm = TorchDistributedComm(device)        # collective: the process group from MPI's rank and size
    model = parallelize(model, comm)           # the layers' all-reduces are now ProcessGroupNCCL's

The process group is started from MPI (start_process_group): rank 0 opens the rendezvous store on
127.0.0.1 and broadcasts its port (one node).
Collectives run on the caller's current CUDA stream (ProcessGroupNCCL orders its own stream after it, and
the caller's after the result). Arguments: torch tensors, or the numpy / CuPy views tplab.collectives
hands over (turned back into tensors without a copy).
"""

from __future__ import annotations

from tplab.comm.base import Communicator, Unsupported
from tplab.toolkit.blocks import block_counts


class TorchDistributedComm(Communicator):
    """``device``: a torch.device; NCCL for CUDA, gloo otherwise. ``in_place=True``: the all-reduce
    overwrites its input (the forward-only overlap experiments hand over a fresh partial product); the
    default sums into a copy, which is always safe."""

    point_to_point = False
    prefers_builtin = True

    def __init__(self, device, mpi_comm=None, *, in_place: bool = False):
        import torch.distributed as dist
        from mpi4py import MPI

        super().__init__()
        self.mpi = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.dist, self.rank, self.size = dist, self.mpi.Get_rank(), self.mpi.Get_size()
        self.in_place = in_place
        self.moves_gpu_memory = device.type == "cuda"
        self.takes_host_memory = not self.moves_gpu_memory
        if not dist.is_initialized():
            start_process_group(self.mpi, device)

    def _op(self, op):
        name = getattr(op, "name", op)
        ops = {"sum": self.dist.ReduceOp.SUM, "prod": self.dist.ReduceOp.PRODUCT,
               "max": self.dist.ReduceOp.MAX, "min": self.dist.ReduceOp.MIN}
        return ops[name]

    def plan(self, collective, x, op=None, algorithm="auto"):
        """torch tensors go straight to torch.distributed (no conversion; and, like torch.distributed
        itself, no agreement round: mismatched arguments are NCCL's to catch)."""
        import torch

        if not isinstance(x, torch.Tensor) or collective not in ("allreduce", "allgather", "reduce_scatter"):
            return None
        if collective == "allgather":
            return lambda t, comm: comm.builtin_allgather(t)
        name = f"builtin_{collective}"
        return lambda t, comm: getattr(comm, name)(t, op)

    def builtin_allreduce(self, x, op="sum"):
        import torch

        t = as_tensor(x)
        bfloat16 = getattr(op, "bfloat16", False)  # (16-bit integers holding bfloat16 bits: tplab.toolkit.bfloat16)
        t = t if self.in_place else t.clone()
        self.dist.all_reduce(t.view(torch.bfloat16) if bfloat16 else t, op=self._op(op))
        return same_kind(t, x)

    def builtin_allgather(self, x):  # -> 1-D: rank 0's x, rank 1's, ... (equal sizes)
        import torch

        t = as_tensor(x).reshape(-1)
        out = torch.empty(self.size * t.numel(), dtype=t.dtype, device=t.device)
        self.dist.all_gather_into_tensor(out, t)
        return same_kind(out, x)

    def builtin_reduce_scatter(self, x, op="sum"):  # -> 1-D: my block of the sum (equal blocks)
        import torch

        t = as_tensor(x).reshape(-1)
        if len(set(block_counts(t.numel(), self.size))) > 1:
            raise Unsupported(f"torch.distributed scatters equal blocks: {t.numel()} elements over {self.size} ranks")
        out = torch.empty(t.numel() // self.size, dtype=t.dtype, device=t.device)
        bfloat16 = getattr(op, "bfloat16", False)
        view = (lambda a: a.view(torch.bfloat16)) if bfloat16 else (lambda a: a)
        self.dist.reduce_scatter_tensor(view(out), view(t), op=self._op(op))
        return same_kind(out, x)

    def builtin_broadcast(self, x, root=0):
        t = as_tensor(x).clone()
        self.dist.broadcast(t, src=root)
        return same_kind(t, x)

    def builtin_reduce(self, x, op="sum", root=0):
        import torch

        t = as_tensor(x).clone()
        bfloat16 = getattr(op, "bfloat16", False)
        self.dist.reduce(t.view(torch.bfloat16) if bfloat16 else t, dst=root, op=self._op(op))
        return same_kind(t, x) if self.rank == root else None

    def barrier(self):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.mpi.Barrier()

    def allgather_object(self, obj):
        return self.mpi.allgather(obj)

    def close(self):
        stop_process_group(self.mpi)


def as_tensor(x):
    """A torch tensor over x's memory (numpy: from_numpy; CuPy: DLPack), or x itself."""
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if type(x).__module__.split(".")[0] == "cupy":
        return torch.from_dlpack(x)
    return torch.from_numpy(x)


def same_kind(t, like):
    """``t`` as the kind of array ``like`` is (what tplab.collectives handed over)."""
    import torch

    if isinstance(like, torch.Tensor):
        return t
    if type(like).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy.from_dlpack(t)
    return t.numpy()


def stop_process_group(mpi_comm) -> None:
    """Collective: torch.distributed's default process group destroyed on every rank of ``mpi_comm`` together
    (NCCL's shutdown is itself collective), and rank 0's rendezvous store (start_process_group) kept until
    every rank has finished: freed earlier, it goes down while the other ranks' NCCL heartbeat threads still
    poll it, and each of them prints a page of "TCPStore ... Connection was likely closed" at exit."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    mpi_comm.Barrier()                  # every rank is done with its collectives
    dist.destroy_process_group()
    mpi_comm.Barrier()                  # every rank's heartbeat thread has stopped
    _STORES.clear()


_STORES: list = []   # rank 0's rendezvous store, held until stop_process_group


def start_process_group(mpi_comm, device) -> None:
    """torch.distributed's default process group over the ranks of ``mpi_comm`` (one node; NCCL for a CUDA
    device, gloo otherwise). Rank 0 opens the rendezvous store on a port the system picks (port 0) and
    broadcasts it: no race for a port picked free earlier, which another process (NCCL's own bootstrap
    listeners, a process group just closed) may hold by the time the store binds it -- seen on a GPU node
    as EADDRINUSE on rank 0 and the other ranks waiting for ever."""
    import torch.distributed as dist

    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = mpi_comm.bcast(store.port if rank == 0 else None, root=0)
    if rank == 0:
        _STORES.append(store)
    if rank != 0:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False)
    gpu = device.type == "cuda"
    dist.init_process_group("nccl" if gpu else "gloo", store=store, rank=rank, world_size=size,
                            **({"device_id": device} if gpu else {}))
