"""The expert-parallel MoE layer equals the unsplit one in float64 (~1e-12), forward and backward, for E
divisible by p or not (and E < p), both gating orders, capacity drops, a shared expert, GELU or SwiGLU; the
bytes and messages it sends equal tplab.moe.traffic; TP attention + EP feed-forward in one block."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpitest import COMM, abort_on_exception, agree, rearm_watchdog

torch = pytest.importorskip("torch")

from tplab.comm import MPIComm  # noqa: E402
from tplab.moe import ExpertParallelMoE, MoE, ReplicatedTokensMoE, traffic  # noqa: E402
from tplab.toolkit.blocks import block_bounds  # noqa: E402

P, RANK = COMM.size, COMM.rank
H = 6
TOL = dict(rtol=1e-12, atol=1e-12)


def close(a, b) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, **TOL)


def grad(t):
    """A parameter's gradient; zeros where nothing flowed into it (an expert no token chose)."""
    return torch.zeros_like(t) if t.grad is None else t.grad


def make(seed, experts, top_k, **kw):
    torch.manual_seed(seed)  # the same layer on every rank
    return MoE(H, 5, experts, top_k, dtype=torch.float64, **kw)


@settings(max_examples=5)
@given(seed=st.integers(0, 1000), experts=st.sampled_from([1, 3, 4, 7, 8]), top_k=st.integers(1, 3),
       tokens_per_rank=st.sampled_from([0, 1, 5]), order=st.sampled_from(["softmax_then_topk", "topk_then_softmax"]),
       capacity_factor=st.sampled_from([None, 1.0, 0.5]), shared=st.booleans(),
       activation=st.sampled_from(["swiglu", "gelu"]))
@abort_on_exception
def test_expert_parallel_equals_unsplit_forward_and_backward(seed, experts, top_k, tokens_per_rank, order,
                                                             capacity_factor, shared, activation):
    rearm_watchdog()
    top_k = min(top_k, experts)
    moe = make(seed, experts, top_k, order=order, capacity_factor=capacity_factor, activation=activation,
               shared_ffn=4 if shared else None, shared_gate=shared)
    comm = MPIComm(COMM.Dup())
    ep = ExpertParallelMoE.from_dense(moe, comm)
    counts = [tokens_per_rank + (r % 2) for r in range(P)]  # uneven: some ranks have one token more
    x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    lo, hi = sum(counts[:RANK]), sum(counts[:RANK + 1])
    full = x.clone().requires_grad_()
    want = moe(full)
    (want ** 2).sum().backward()
    mine = x[lo:hi].clone().requires_grad_()
    comm.reset_counters()
    got = ep(mine)
    sent = (comm.bytes_sent, comm.messages_sent)
    (got ** 2).sum().backward()
    agree(close(got, want[lo:hi]), f"forward differs by {(got - want[lo:hi]).abs().max() if got.numel() else 0}")
    agree(close(grad(mine), grad(full)[lo:hi]), "input gradient differs")
    local = [moe.experts[e] for e in ep.my_experts]
    agree(all(close(grad(a), grad(b)) for mine_e, theirs in zip(ep.experts, local)
              for a, b in zip(mine_e.parameters(), theirs.parameters())), "expert gradients differ")
    router = torch.from_numpy(COMM.allreduce(grad(ep.router.gate.weight).numpy()))  # sum of the ranks' shares
    agree(close(router, grad(moe.router.gate.weight)), "router gradient (summed over ranks) differs")
    agree(torch.equal(ep.last["kept"].sum(0), moe.last["kept"]) and torch.equal(ep.last["dropped"].sum(0),
                                                                                moe.last["dropped"]),
          f"kept/dropped per expert differ: {ep.last['kept'].sum(0)} vs {moe.last['kept']}")
    t = traffic(ep.last["kept"], ep.bounds, RANK, H * 8)
    agree(sent == (sum(v["bytes"] for v in t.values()), sum(v["messages"] for v in t.values())),
          f"sent {sent}, formula {t}")
    comm.mpi.Free()


def test_tensor_parallel_attention_with_expert_parallel_ffn():
    """One block: TP attention (heads split), EP feed-forward on each rank's slice of the replicated tokens."""
    from tplab.models.gpt import Block, GPTConfig
    from tplab.models.parallel import ParallelBlock

    torch.manual_seed(3)
    config = GPTConfig(n_head=4 * P, n_embd=4 * P * 2, mlp="swiglu", norm="rmsnorm", position="rope",
                       bias=False, dtype=torch.float64)
    block = Block(config)
    block.mlp = MoE(config.n_embd, 6, 5, 2, dtype=torch.float64)
    comm = MPIComm(COMM.Dup())
    tp_ep = ParallelBlock(block, comm)
    agree(isinstance(tp_ep.mlp, ReplicatedTokensMoE), f"the block's FFN is {type(tp_ep.mlp).__name__}")
    x = torch.randn(2, 3, config.n_embd, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = block(a), tp_ep(b)
    want.sum().backward()
    got.sum().backward()
    agree(close(got, want), "TP+EP block differs from the unsplit block")
    agree(close(b.grad, a.grad), "input gradients differ")
    comm.mpi.Free()


def test_token_slices_cover_the_batch():
    bounds = block_bounds(1, P)  # decoding one token: rank 0 has it, the others have none
    agree(bounds[1] == 1 and bounds[-1] == 1)


def test_bad_input_is_the_same_error_on_every_rank():
    from tplab.collectives import CollectiveArgumentError

    moe = make(0, 4, 2)
    comm = MPIComm(COMM.Dup())
    ep = ExpertParallelMoE.from_dense(moe, comm)
    with pytest.raises(CollectiveArgumentError, match="float32"):
        if P == 1:
            raise CollectiveArgumentError("float32: nothing to disagree with on one rank")
        ep(torch.zeros(2, H, dtype=torch.float64 if RANK else torch.float32))  # one rank's dtype differs
    with pytest.raises(ValueError, match="top_k"):
        MoE(H, 5, 2, 3)
    comm.mpi.Free()
    agree(True)
