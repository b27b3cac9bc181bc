"""The all-gather of K and V fused into the projection that makes them (GPU, inference).

The all-gather scheme (allgather_kv.py) computes K and V, then gathers them: on 4 H100s the course project's layer
receives 240 MiB a layer per GPU (0.74 ms at the 340 GB/s the links carry; the gather adds 0.85 ms to the layer),
and no stream-level overlap hid it (a gather beside the GEMMs takes their SMs or memory bandwidth). Here the Q/K/V projection is one GEMM
(tplab.gpu_collectives.matmul_allgather) whose epilogue writes each K/V tile straight into every rank's
gathered buffer, while the other tiles are still being computed:

    x (b, s/p, h)  my tokens, after norm1
    └─ [Wq; Wk; Wv] GEMM ─┬─ Q tiles    -> q (b, n, s/p, d)                 mine
                          └─ K/V tiles  -> every rank's K, V (b, n_kv, s, d)  written from the SM, over NVLink
       barrier            every rank's tiles have landed
    attend_local(q, K, V)                                                   as the all-gather scheme

Same bytes on the links as the all-gather, but no pass of its own: the transfer runs under the GEMM's compute.
On 4 H100s that hid about half of it (4.89-4.99 ms a layer against 5.35-5.71 for NCCL's all-gather, the
compute alone 4.50-4.72; data/README.md). Limits: no RoPE (K is rotated after the projection, so it would leave unrotated), 16-bit weights,
one node, forward only; the weights are copied when it is made (make it again after changing them).

    fused = FusedKV(block.attention, MPI.COMM_WORLD, batch=b, tokens_per_rank=s // p)   # collective
    layer = SequenceParallelBlock(block, comm, scheme="allgather_kv", fused_kv=fused)
"""

from __future__ import annotations

import torch

from tplab.sequence.checks import SequenceParallelError


class FusedKV:
    """Q, and every rank's K and V, from one GEMM per rank: ``q, k_all, v_all = fused(x)``, x (b, s/p, h) ->
    q (b, n, s/p, d), k_all, v_all (b, n_kv, s, d) in rank order along the sequence (all three views of buffers
    that the next call overwrites). Collective to make and to call."""

    def __init__(self, attention, mpi_comm, *, batch: int, tokens_per_rank: int, block=None):
        from tplab.gpu_collectives.matmul_allgather import MatmulAllGather

        a = attention
        problem = "" if getattr(a, "rotary", None) is None else (
            "the fused K/V gather needs attention without RoPE: K is rotated after the projection, and the "
            "projection's epilogue sends it before (use the all-gather scheme's gathers)")
        problems = [f"rank {r}: {p}" for r, p in enumerate(mpi_comm.allgather(problem)) if p]
        if problems:
            raise SequenceParallelError("; ".join(problems))
        self.attention, self.batch, self.tokens_per_rank = a, batch, tokens_per_rank
        self.n_head, self.n_kv_head, self.head_dim = a.n_head, a.n_kv_head, a.head_dim
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        with torch.no_grad():
            weight = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])   # (h_q + 2 h_kv, h)
            bias = (None if a.q_proj.bias is None else
                    torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
        self.projection = MatmulAllGather(mpi_comm, weight, bias, local=a.n_head * a.head_dim, batch=batch,
                                          m=tokens_per_rank, block=block)

    def __call__(self, x, *, check: bool = True):
        """x (b, s/p, h) -> q, k_all, v_all. Bad input (a shape other than the one it was made for, or autograd
        on: nothing here is differentiable) is the same error on every rank (``check``; module MatmulAllGather)."""
        problem = ""
        wants_grad = x.requires_grad or any(w.requires_grad for w in self.attention.parameters())
        if torch.is_grad_enabled() and wants_grad:
            problem = ("the fused K/V gather is forward only (inference): run it under torch.no_grad(), or use "
                       "the all-gather scheme's gathers")
        elif x.dim() != 3 or tuple(x.shape[:2]) != (self.batch, self.tokens_per_rank):
            problem = (f"x must be (batch {self.batch}, tokens {self.tokens_per_rank}, hidden), as this FusedKV was "
                       f"made for, not {tuple(x.shape)}")
        flat = None if problem else x.reshape(-1, x.shape[-1])                 # (b·s/p, h)
        q, gathered = self.projection(flat, check=check, problem=problem)      # (b·s/p, h_q), (b, s, 2 h_kv)
        b, m = self.batch, self.tokens_per_rank
        h_kv, s = self.n_kv_head * self.head_dim, gathered.shape[1]
        q = q.view(b, m, self.n_head, self.head_dim).transpose(1, 2)                      # (b, n, s/p, d)
        k_all = gathered[..., :h_kv].view(b, s, self.n_kv_head, self.head_dim).transpose(1, 2)  # (b, n_kv, s, d)
        v_all = gathered[..., h_kv:].view(b, s, self.n_kv_head, self.head_dim).transpose(1, 2)
        return q, k_all, v_all

    def close(self) -> None:
        """Collective: free the shared buffers."""
        self.projection.close()
