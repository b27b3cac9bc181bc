"""Expert parallelism: the E experts of a mixture-of-experts layer spread over p ranks, tokens sent to them.

Rank j holds experts [bounds[j], bounds[j+1]) (contiguous blocks cut like numpy.array_split: E need not be
divisible by p, and a rank may hold none when E < p); the router is replicated. Each rank brings its own
tokens (data-parallel style; in a TP model, its slice of the replicated tokens: replicated.py). Per layer:

    1. route     my tokens -> k experts each (router.py); count assignments per expert
    2. counts    all-gather the p x E count matrix (E int64 per rank, a ring): every rank then knows how many
                 rows each rank sends to each other rank, and which assignments exceed an expert's capacity
                 (decided in global token order, exactly as one process would: dispatch.py)
    3. dispatch  all-to-all-v: my kept rows, grouped by expert, to the experts' ranks
    4. compute   regroup the received rows by local expert (they arrive by source rank), run each expert
    5. combine   all-to-all-v back with the counts swapped; scale by the gates and add up per token

Bytes on the wire per rank and layer, ρ = bytes of one token row (h · itemsize):
    counts      (p-1) messages, (p-1) · E · 8 bytes
    dispatch    one message per other rank I send rows to, rows_out · ρ bytes
    combine     one message per other rank that sent me rows, rows_in · ρ bytes
``traffic(kept, bounds, rank, row_bytes)`` computes these from the kept-count matrix (``layer.last["kept"]``).

Exact against the unsplit layer (layer.py) forward and backward: expert weights get their own gradient on
their owner; the router's (and a shared expert's) gradient is this rank's tokens' share -- summed over ranks
it is the unsplit gradient (data parallelism all-reduces it before the optimizer step). Likewise
``last["aux_loss"]`` (while training) is the auxiliary loss over this rank's tokens.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from tplab.collectives import CollectiveArgumentError, allgather
from tplab.moe import dispatch
from tplab.moe.exchange import exchange
from tplab.moe.experts import run_experts
from tplab.moe.router import load_balancing_loss
from tplab.toolkit.blocks import block_bounds


def expert_bounds(num_experts: int, p: int) -> list[int]:
    """Rank j owns experts bounds[j] .. bounds[j+1]-1."""
    return block_bounds(num_experts, p)


def _no_span(name, kind="compute"):
    return contextlib.nullcontext()


class ExpertParallelMoE(nn.Module):
    def __init__(self, moe, comm, *, check: bool = True):
        super().__init__()
        self.comm, self.check = comm, check
        self.hidden, self.num_experts, self.top_k = moe.hidden, moe.num_experts, moe.top_k
        self.capacity_factor = moe.capacity_factor
        self.bounds = expert_bounds(moe.num_experts, comm.size)
        first, last = self.bounds[comm.rank], self.bounds[comm.rank + 1]
        self.router = copy.deepcopy(moe.router)
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[e]) for e in range(first, last))
        self.shared, self.shared_gate = copy.deepcopy(moe.shared), copy.deepcopy(moe.shared_gate)
        self.span = _no_span  # tplab.overlap.trace.span here draws a Gantt chart of the phases
        self.last: dict = {}

    @classmethod
    def from_dense(cls, moe, comm, **kwargs) -> "ExpertParallelMoE":
        """This rank's share of an unsplit MoE layer (call it on every rank with the same layer)."""
        return cls(moe, comm, **kwargs)

    @property
    def my_experts(self) -> range:
        return range(self.bounds[self.comm.rank], self.bounds[self.comm.rank + 1])

    def _count_matrix(self, experts):
        """(p, E) assignments per rank and expert, on the host: the sizes of every message to come. Gathered
        where the tokens are (a ring all-gather of E int64 per rank, on the GPU for CUDA tensors)."""
        mine = torch.bincount(experts.reshape(-1), minlength=self.num_experts).to(torch.int64)
        gathered = allgather(mine, self.comm, algorithm="ring", check=self.check)
        return gathered.cpu().reshape(self.comm.size, self.num_experts)

    def _agree(self, x) -> None:
        """Bad input (a wrong hidden size or dtype on one rank) becomes the same error on every rank, before
        any rank computes something that would fail on it alone."""
        weight = self.router.gate.weight
        problems = []
        if x.shape[-1:] != (self.hidden,):
            problems.append(f"tokens of shape {tuple(x.shape)}: the last dimension must be hidden = {self.hidden}")
        if x.dtype != weight.dtype or x.device != weight.device:
            problems.append(f"tokens are {x.dtype} on {x.device}, the layer's weights {weight.dtype} on "
                            f"{weight.device}")
        message = self.comm.agree({"num_experts": self.num_experts, "top_k": self.top_k, "hidden": self.hidden,
                                   "problems": problems})
        if message:
            raise CollectiveArgumentError(f"expert-parallel MoE: {message}")

    def forward(self, x):  # (..., h): this rank's tokens -> (..., h)
        if self.check:
            self._agree(x)
        shape, p, r, b = x.shape, self.comm.size, self.comm.rank, self.bounds
        x = x.reshape(-1, self.hidden)
        with self.span("route"):
            routing = self.router(x)
        with self.span("count", "comm"):
            counts = self._count_matrix(routing.experts)  # (p, E) assignments per rank and expert
        tokens = int(counts.sum()) // self.top_k
        limit = dispatch.capacity(self.capacity_factor, tokens, self.top_k, self.num_experts)
        ahead = torch.cumsum(counts, 0) - counts  # assignments of lower ranks, per expert
        kept = dispatch.kept_counts(counts, ahead, limit)  # (p, E): every rank's rows per expert
        plan = dispatch.plan(routing.experts, self.num_experts, limit, ahead[r])
        send = [int(kept[r, b[j]:b[j + 1]].sum()) for j in range(p)]
        recv = [int(kept[s, b[r]:b[r + 1]].sum()) for s in range(p)]
        with self.span("dispatch", "comm"):
            received = exchange(x[plan.token], send, recv, self.comm, self.check)
        with self.span("experts"):
            mine = kept[:, b[r]:b[r + 1]]  # (p, local experts): rows from each source, per expert
            order = self._by_expert(mine).to(received.device)
            out = run_experts(self.experts, received[order], mine.sum(0))
            back = torch.empty_like(out).index_copy(0, order, out)  # in the order they arrived
        with self.span("combine", "comm"):
            returned = exchange(back, recv, send, self.comm, self.check)
        gates = routing.weights.reshape(-1)[plan.assignment]
        y = torch.zeros_like(x).index_add(0, plan.token, returned * gates[:, None])
        if self.shared is not None:
            shared = self.shared(x)
            y = y + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * shared)
        self.last = {"kept": kept, "dropped": counts - kept, "capacity": limit, "send_rows": send,
                     "recv_rows": recv, "aux_loss": load_balancing_loss(routing) if self.training else None}
        return y.reshape(shape)

    @staticmethod
    def _by_expert(mine):
        """Received rows arrive by source rank (and by expert inside each): the permutation that groups them
        by local expert (and by source rank inside each, i.e. in global token order)."""
        p, local = mine.shape
        starts = (torch.cumsum(mine.reshape(-1), 0) - mine.reshape(-1)).reshape(p, local)
        pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + mine[s, e])) for e in range(local)
                  for s in range(p)]
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def traffic(kept, bounds, rank: int, row_bytes: int) -> dict:
    """Bytes and messages ``rank`` sends in one layer (counts, dispatch, combine), from the (p, E) matrix of
    kept rows: what the counters must show (tests/mpi/test_moe.py)."""
    kept = torch.as_tensor(kept)
    p, num_experts = kept.shape
    to = [int(kept[rank, bounds[j]:bounds[j + 1]].sum()) for j in range(p)]
    frm = [int(kept[s, bounds[rank]:bounds[rank + 1]].sum()) for s in range(p)]
    others = [j for j in range(p) if j != rank]
    return {"counts": {"messages": p - 1, "bytes": (p - 1) * num_experts * 8},
            "dispatch": {"messages": sum(1 for j in others if to[j]), "bytes": sum(to[j] for j in others) * row_bytes},
            "combine": {"messages": sum(1 for j in others if frm[j]),
                        "bytes": sum(frm[j] for j in others) * row_bytes}}
