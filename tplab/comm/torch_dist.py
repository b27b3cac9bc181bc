"""torch.distributed's collectives (NCCL on GPUs, gloo on CPUs) behind the interface tplab's layers use.

tplab's layers (tplab.layers.mappings) call ``comm.tensor_allreduce`` & co. when a communicator has them, so
this adapter lets the same model run on the vendor's collectives next to tplab's own, for comparison:

    comm = TorchDistributedComm(device)        # collective: the process group from MPI's rank and size
    model = parallelize(model, comm)           # the layers' all-reduces are now ProcessGroupNCCL's

The process group is started from MPI: rank 0 picks a free port on 127.0.0.1 and broadcasts it (one node).
Collectives run on the caller's current CUDA stream (ProcessGroupNCCL orders its own stream after it, and
the caller's after the result).
"""

from __future__ import annotations

import socket


class TorchDistributedComm:
    """``rank``, ``size``, ``tensor_allreduce``, ``tensor_allgather`` / ``tensor_reduce_scatter`` (flat
    results, rank order), ``barrier``, ``allgather_object``. ``device``: a torch.device; NCCL for CUDA, gloo
    otherwise. ``in_place=True``: the all-reduce overwrites its input (the forward-only overlap experiments
    hand over a fresh partial product); the default sums into a copy, which is always safe."""

    def __init__(self, device, mpi_comm=None, *, in_place: bool = False):
        import torch.distributed as dist
        from mpi4py import MPI

        self.mpi = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.dist, self.rank, self.size = dist, self.mpi.Get_rank(), self.mpi.Get_size()
        self.in_place = in_place
        if not dist.is_initialized():
            port = self.mpi.bcast(free_port() if self.rank == 0 else None, root=0)
            gpu = device.type == "cuda"
            dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                    rank=self.rank, world_size=self.size, **({"device_id": device} if gpu else {}))

    def tensor_allreduce(self, x):
        x = x if self.in_place else x.clone()
        self.dist.all_reduce(x)
        return x

    def tensor_allgather(self, x):  # -> 1-D: rank 0's x, rank 1's, ...
        import torch

        out = torch.empty(self.size * x.numel(), dtype=x.dtype, device=x.device)
        self.dist.all_gather_into_tensor(out, x.reshape(-1))
        return out

    def tensor_reduce_scatter(self, x):  # -> 1-D: my block of the sum
        import torch

        out = torch.empty(x.numel() // self.size, dtype=x.dtype, device=x.device)
        self.dist.reduce_scatter_tensor(out, x.reshape(-1))
        return out

    def barrier(self):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.mpi.Barrier()

    def allgather_object(self, obj):
        return self.mpi.allgather(obj)

    def close(self):
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
