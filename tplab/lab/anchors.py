"""The all-reduces a GPU result is measured against, timed by tplab's own harness next to tplab's kernels:

    mpiexec -n 4 tplab bench allreduce --device gpu --peer-memory 64M -b 1K -e 4M -f 4 \\
        -a peer_one_shot,nccl,symm_mem_one_shot,symm_mem_two_shot --graph
    mpiexec -n 4 tplab bench allreduce --device gpu -b 1K -e 4M -f 4 -a nccl,nccl_symmetric --graph

    nccl               NCCL's default kernels: torch.distributed.all_reduce, in place
    nccl_symmetric     NCCL's symmetric kernels (NCCL >= 2.27): the same call on a tensor registered in an NCCL
                       window (torch's symmetric memory with its NCCL backend); they pay off inside CUDA graphs
    symm_mem_one_shot  torch's symmetric-memory one-shot (torch.ops.symm_mem.one_shot_all_reduce): every rank
                       reads every peer's buffer over NVLink and sums
    symm_mem_two_shot  torch's two-shot, in place (two_shot_all_reduce_): reduce-scatter, then all-gather

The symmetric-memory anchors get their input already in symmetric memory (their best case: a real program
would copy it there or produce it there); tplab's kernels copy any tensor in. torch fixes the symmetric-memory
backend at its first allocation, so nccl_symmetric and symm_mem_* need separate runs.
"""

from __future__ import annotations

ANCHORS = ("nccl", "nccl_symmetric", "symm_mem_one_shot", "symm_mem_two_shot")
BACKEND = {"nccl_symmetric": "NCCL", "symm_mem_one_shot": "CUDA", "symm_mem_two_shot": "CUDA"}


def unavailable(names) -> str | None:
    """Why the anchors ``names`` cannot run together in this process; None if they can."""
    import torch

    if len({BACKEND[n] for n in names if n in BACKEND}) > 1:
        return ("nccl_symmetric and symm_mem_* need separate runs: torch fixes the symmetric-memory backend "
                "at its first allocation")
    if not torch.cuda.is_available():
        return "the anchors run on CUDA GPUs"
    if any(n in BACKEND for n in names):
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError:
            return f"torch {torch.__version__} has no symmetric memory"
        if "NCCL" in {BACKEND.get(n) for n in names} and not hasattr(symm_mem, "set_backend"):
            return f"torch {torch.__version__} has no NCCL backend for symmetric memory"
        if any(n.startswith("symm_mem") for n in names) and not hasattr(torch.ops.symm_mem, "two_shot_all_reduce_"):
            return f"torch {torch.__version__} has no symm_mem one_shot / two_shot all-reduce"
    return None


def start(names, device_index: int) -> None:
    """Collective, once, before any symmetric memory: the backend the anchors need, then torch.distributed's
    NCCL process group on this rank's GPU (from MPI's ranks; tplab.comm.torch_dist)."""
    import torch
    import torch.distributed as dist

    from tplab.comm.torch_dist import TorchDistributedComm

    if any(BACKEND.get(n) == "NCCL" for n in names) and not dist.is_initialized():
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.set_backend("NCCL")  # (CUDA is the default; naming it fails before its first allocation)
    TorchDistributedComm(torch.device("cuda", device_index))


def stop() -> None:
    """Collective, after the last anchor: torch.distributed's process group destroyed on every rank, rank 0's
    rendezvous store kept until all have (tplab.comm.torch_dist.stop_process_group)."""
    from mpi4py import MPI

    from tplab.comm.torch_dist import stop_process_group

    stop_process_group(MPI.COMM_WORLD)


def prepare(name: str, x, validate: bool = True):
    """(run, wrong): ``run()`` all-reduces (sums) ``x``'s values (a CuPy array or torch tensor on this rank's
    GPU) by the anchor ``name``; ``wrong`` counts the elements, over all ranks, farther from NCCL's sum than
    rounding allows (-1 without ``validate``). Collective."""
    import torch
    import torch.distributed as dist

    t = torch.from_dlpack(x) if not isinstance(x, torch.Tensor) else x
    group = dist.group.WORLD
    if name == "nccl":
        buf = t.clone()
    else:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(t.numel(), device=t.device, dtype=t.dtype)
        symm_mem.rendezvous(buf, group.group_name)
        buf.copy_(t.reshape(-1))
    if name in ("nccl", "nccl_symmetric"):
        def run():
            dist.all_reduce(buf)
            return buf
    elif name == "symm_mem_one_shot":
        def run():
            return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name)
    else:
        def run():
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group.group_name)
            return buf
    wrong = -1
    if validate:
        from tplab.toolkit.ops import sum_tolerance

        want = t.reshape(-1).clone()
        dist.all_reduce(want)
        got = run().reshape(-1)
        tolerance = sum_tolerance(dist.get_world_size(), torch.finfo(t.dtype).eps) if t.dtype.is_floating_point else 0
        scale = want.double().abs().clamp(min=1.0)
        mine = int(((got.double() - want.double()).abs() > tolerance * scale).sum())
        total = torch.tensor([mine], device=t.device)
        dist.all_reduce(total)
        wrong = int(total.item())
        buf.copy_(t.reshape(-1))
    return run, wrong
