"""A matrix product whose epilogue all-gathers its output: every output tile is written, straight from the SM
that computed it, into every rank's gathered buffer (peer memory over NVLink). No separate all-gather runs, so no
pass of its own takes SMs or reads the output back from memory: the transfer runs under the GEMM's compute, as
far as the links keep up (Flux's idea, a paper and library from ByteDance, for tensor parallelism).

    rank r, tokens r·m .. r·m + m - 1 of every sequence:

    y = x Wᵀ + b     x (B·m, K), W (N, K)    one Triton GEMM; tile (BLOCK_M x BLOCK_N)
    ├─ columns [0, local)     -> out (B·m, local), this rank only                      (Q of attention)
    └─ columns [local, N)     -> gathered[q][batch, r·m + t, :]   for every rank q     (K and V)
                                 TMA stores from the SM straight into rank q's memory

    after it:  a barrier (flags in GPU memory) -- every rank's tiles have landed in mine. This leans on what
               NCCL's and torch's symmetric-memory kernels lean on too: a kernel's stores, the TMA's bulk stores
               included, are done when the kernel has ended, before the barrier's release store in the next kernel.
    The gathered buffer is doubled, calls alternating between the two, so no barrier is needed before the GEMM:
    the call before this one ended in a barrier that every rank reached after reading the buffer this call
    writes (read it before your next call, on the calls' stream). The barrier gives up on a peer that never
    comes after ``timeout`` seconds: the next call raises CommTimeoutError (the GPU does not spin forever).

The column tiles are visited in the order local, gathered, gathered, local, ... (``interleave``): every wave of
tiles then sends about as much over the links, instead of a wave of local tiles leaving the links idle and a
wave of gathered tiles queueing on them.

One program per tile, on purpose: a persistent kernel (one program per SM walking its tiles, written in Gluon)
that went on to its next tile while the stores drained took 1.33 ms for the course project's Q/K/V on 4 H100s,
against this kernel's 1.10 on the same machine (itself 1.07 with no stores at all), most likely because the next
tile's TMA loads queue behind the stores.

Needs Triton with tensor descriptors (3.4 or later) and a Hopper GPU or newer (TMA), one process per GPU on one
node (CUDA IPC). Forward only (inference): nothing here is differentiable.
"""

from __future__ import annotations

from tplab.gpu_collectives.peer_agreement import MAX_RANKS


def _kernel():
    """The Triton kernel (matmul_allgather_kernel.py), imported at first use: Triton only where a GPU path asks.
    (Every descriptor is made on the host, so the kernel needs no global scratch: no allocator to set.)"""
    from tplab.gpu_collectives.matmul_allgather_kernel import matmul_allgather_kernel

    return matmul_allgather_kernel


class _Address:
    """A device address (a peer's buffer, mapped here) where Triton expects a tensor: a descriptor's base."""

    def __init__(self, address: int, dtype):
        self.address, self.dtype = int(address), dtype

    def data_ptr(self) -> int:
        return self.address


def _largest_dividing(n: int, choices) -> int | None:
    return next((c for c in choices if n % c == 0), None)


class MatmulAllGather:
    """``y = x @ weight.T + bias`` on every rank, where columns ``[0, local)`` stay here (``out``) and columns
    ``[local, N)`` of every rank's rows land in every rank's ``gathered`` (batch, p·m, N - local) buffer, in rank
    order along the sequence. Collective to build (one process per GPU, one node, at most 8 ranks): ``mpi_comm``,
    the same ``weight`` (N, K), ``bias`` (N,) or None, ``local``, ``batch`` and ``m`` (rows per sequence on each
    rank) on every rank. Calls are collective, queued on torch's current stream::

        fused = MatmulAllGather(MPI.COMM_WORLD, w_qkv, b_qkv, local=h_q, batch=b, m=s // p)
        q, gathered = fused(x)     # x (b·m, K) my rows; q (b·m, h_q) mine; gathered (b, p·m, N - h_q) everyone's
        ...                        # read ``gathered`` before the next call (on its stream): the call after
                                   # it writes into this buffer again

    16-bit floats only (bf16, fp16; fp32 accumulation). ``block``: (BLOCK_M, BLOCK_N, BLOCK_K, num_stages,
    num_warps[, GROUP_M[, halves]]), default (128, 256, 64, 3, 8, 8, 1) where the shapes allow: the fastest of
    eight tried on 4 H100s for the course project's layer (``halves``: each tile stored as two halves, which
    frees shared memory: 1.15 ms a call against 1.28 whole, with two barriers, on one machine, in an experiment
    not kept); ``interleave``: local and gathered column tiles alternate (module docstring). ``out`` is reused
    by every call, and each of the two ``gathered`` buffers by every other call (twice the gathered bytes in
    peer memory). Not for CUDA graph capture: which buffer a call writes is a host counter, so a replayed call
    would always write the same one. ``close()`` (collective) frees the peer memory."""

    def __init__(self, mpi_comm, weight, bias, *, local: int, batch: int, m: int, block=None,
                 interleave: bool = True, timeout: float = 30.0):
        import torch
        from triton.tools.tensor_descriptor import TensorDescriptor

        from tplab.gpu_collectives.peer_memory import PeerMemory

        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        n, k = weight.shape
        block_m = _largest_dividing(m, (128, 64))
        block_n = _largest_dividing(local, (256, 128, 64))
        problem = ""
        if weight.dtype not in (torch.bfloat16, torch.float16):
            problem = f"needs bf16 or fp16 weights, not {weight.dtype}"
        elif self.size > MAX_RANKS:
            problem = f"handles at most {MAX_RANKS} ranks, not {self.size}"
        elif not (0 < local < n):
            problem = f"local={local}: some columns must stay here and some be gathered (0 < local < N = {n})"
        elif block_m is None or block_n is None or k % 8 or (n - local) % 8:
            problem = (f"rows per rank m={m} must be a multiple of 64, local={local} of 64, and K={k}, "
                       f"N - local={n - local} of 8 (whole tiles, 16-byte rows for TMA)")
        defaults = (block_m, block_n, 64, 3, 8, 8, 1)             # (+ GROUP_M, halves)
        self.block = tuple(block or ()) + defaults[len(block or ()):]
        bm, bn, bk = self.block[:3]
        if not problem and (len(self.block) != 7 or m % bm or local % bn):
            problem = f"block {self.block} must be 5 to 7 numbers whose tiles cut m={m} and local={local}"
        everyone = mpi_comm.allgather((problem, tuple(weight.shape), local, batch, m, self.block, bool(interleave)))
        problems = [f"rank {r}: {p}" for r, (p, *_) in enumerate(everyone) if p]
        if not problems and len({tuple(e[1:]) for e in everyone}) != 1:
            problems = [f"ranks disagree on (weight shape, local, batch, m, block, interleave): "
                        f"{[e[1:] for e in everyone]}"]
        if problems:
            raise ValueError("MatmulAllGather: " + "; ".join(problems))
        store_n = bn // 2 if self.block[6] else bn           # the TMA box of a store
        self.weight, self.bias = weight.contiguous(), None if bias is None else bias.contiguous()
        self.local, self.batch, self.m, self.n, self.k = local, batch, m, n, k
        self.seq = self.size * m
        width = n - local
        nbytes = -(-batch * self.seq * width * weight.element_size() // 256) * 256      # one buffer, aligned
        self.peers = PeerMemory(mpi_comm, 2 * nbytes, timeout=timeout)                  # two: calls alternate
        both = torch.as_tensor(self.peers.buffer(2 * nbytes, "uint8"), device=weight.device)
        self._gathered = [both[i * nbytes:(i + 1) * nbytes].view(weight.dtype)[:batch * self.seq * width].view(
            batch, self.seq, width) for i in range(2)]           # (B, p·m, N - local): every rank's rows
        self.out = torch.empty((batch * m, local), dtype=weight.dtype, device=weight.device)
        ring_order = [(self.rank + i) % self.size for i in range(self.size)]   # me, then the next ranks
        shape, strides = [batch * self.seq, width], [width, 1]
        self._gathered_descs = []
        for i in range(2):
            descs = [TensorDescriptor(_Address(self.peers.data_pointer(q) + i * nbytes, weight.dtype), shape,
                                      strides, [bm, store_n]) for q in ring_order]
            self._gathered_descs.append(descs + [descs[0]] * (MAX_RANKS - self.size))
        self.calls = 0                                           # which buffer the next call writes: calls % 2
        self._w_desc = TensorDescriptor(self.weight, [n, k], [k, 1], [bn, bk])
        self._out_desc = TensorDescriptor(self.out, [batch * m, local], [local, 1], [bm, store_n])
        ratio = n // local                                      # 1 local tile, then ratio - 1 gathered ones
        self.interleave = ratio if interleave and n % local == 0 and ratio > 1 else 0

    def barrier(self) -> None:
        """Every rank's queued work up to here is done (a kernel on torch's current stream; nothing waits on
        the host). A peer that never comes ends the wait after the timeout: the next call raises."""
        import torch

        self.peers.queue_timed_barrier(torch.cuda.current_stream().cuda_stream)

    def problem_with(self, x) -> str:
        """Why ``x`` cannot be this rank's input ("" if it can)."""
        want = (self.batch * self.m, self.k)
        if x is None or tuple(x.shape) != want or x.dtype != self.weight.dtype or not x.is_contiguous():
            got = "nothing" if x is None else f"{x.dtype} {tuple(x.shape)}"
            return f"x must be contiguous {self.weight.dtype} of shape {want}, not {got}"
        if x.device != self.weight.device or x.data_ptr() % 16:
            return f"x must lie on {self.weight.device}, 16-byte aligned (TMA), not on {x.device} at {x.data_ptr():#x}"
        return ""

    def __call__(self, x, *, check: bool = True, problem: str = ""):
        """x (B·m, K) this rank's rows -> (out (B·m, local), gathered (B, p·m, N - local)). ``check``: the ranks
        agree on their inputs first (a host exchange), so a bad one is the same error on every rank. Without it
        a bad input raises on its own rank only, after queuing the call's barrier so that its peers do not
        wait on it (their ``gathered`` then lacks its rows). ``problem``: a caller's own reason to refuse."""
        from triton.tools.tensor_descriptor import TensorDescriptor

        self.peers.raise_pending()          # a peer that timed out in an earlier call's barrier
        problem = problem or self.problem_with(x)
        if check:
            problems = [f"rank {r}: {p}" for r, p in enumerate(self.peers.mpi.allgather(problem)) if p]
            if problems:
                raise ValueError("MatmulAllGather: " + "; ".join(problems))
        elif problem:
            self.calls += 1
            self.barrier()
            raise ValueError(f"MatmulAllGather on rank {self.rank}: {problem}")
        bm, bn, bk = self.block[:3]
        x_desc = TensorDescriptor(x, [self.batch * self.m, self.k], [self.k, 1], [bm, bk])
        which = self.calls % 2              # (the call before last wrote it; every rank has read it since)
        self.calls += 1
        self._launch(x_desc, self._gathered_descs[which])
        self.barrier()                      # every rank's tiles have landed in my buffer
        return self.out, self._gathered[which]

    def _launch(self, x_desc, gathered_descs) -> None:
        import triton

        bm, bn, bk, stages, warps, group_m, halves = self.block
        rows = self.batch * self.m
        grid = (triton.cdiv(rows, bm) * triton.cdiv(self.n, bn),)
        _kernel()[grid](x_desc, self._w_desc, self._out_desc, self.weight if self.bias is None else self.bias,
                        *gathered_descs, rows, self.n, self.k, self.local, self.m, self.seq,
                        self.rank * self.m, RANKS=self.size, HAS_BIAS=self.bias is not None,
                        INTERLEAVE=self.interleave, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m,
                        HALVES=halves, num_stages=stages, num_warps=warps)

    def close(self) -> None:
        """Collective: free the peer memory."""
        self.peers.close()
