"""Sequence-parallel attention equals full attention (float64, ~1e-12) for every scheme, causal or not,
contiguous or zig-zag; bytes counted equal the formulas; bad input is the same error on every rank."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpitest import COMM, abort_on_exception, agree, rearm_watchdog

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from tplab.collectives import CollectiveArgumentError, alltoall  # noqa: E402
from tplab.comm import world  # noqa: E402
from tplab.cost import attention_bytes, attention_messages, causal_work  # noqa: E402
from tplab.models.gpt import Block, GPTConfig  # noqa: E402
from tplab.sequence import (  # noqa: E402
    LAYOUTS,
    SCHEMES,
    SequenceParallelBlock,
    SequenceParallelError,
    gather_sequence,
    ring_attention,
    shard,
    staged_allgather_first_dim,
    unsplit_layer,
)
from tplab.sequence.scaling import scaling_study  # noqa: E402

P, RANK = COMM.size, COMM.rank
C = world(timeout=10)
TOL = dict(rtol=1e-12, atol=1e-12)


def randn(*shape, seed):
    """The same random float64 tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def full_attention(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def qkv(kv_heads, seq_chunks=3, seed=0):
    """(b, n, s, d) q and (b, n_kv, s, d) k, v with n = 2P heads and s = 2P·seq_chunks (zig-zag needs 2P)."""
    b, n, s, d = 2, 2 * P, 2 * P * seq_chunks, 4
    return (randn(b, n, s, d, seed=seed), randn(b, kv_heads, s, d, seed=seed + 1),
            randn(b, kv_heads, s, d, seed=seed + 2))


def mine(t, layout):
    return shard(t, RANK, P, layout, dim=2)


@pytest.mark.parametrize("kv_heads", [2 * P, P], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_scheme_equals_full_attention_and_sends_the_formula_bytes(scheme, causal, layout, kv_heads):
    q, k, v = qkv(kv_heads)
    expected = mine(full_attention(q, k, v, causal), layout)
    C.reset_counters()
    with torch.no_grad():
        out = SCHEMES[scheme](mine(q, layout), mine(k, layout), mine(v, layout), C, causal=causal, layout=layout)
    agree(torch.allclose(out, expected, **TOL), f"{scheme}: differs by {(out - expected).abs().max():.2e}")
    b, n, s, d = q.shape
    want = attention_bytes(scheme, b, s, n * d, P, kv_hidden=kv_heads * d, bytes_per_element=8)
    agree(C.bytes_sent == want and C.messages_sent == attention_messages(scheme, P),
          f"{scheme} sent {C.bytes_sent} B in {C.messages_sent} messages; formula {want} B in "
          f"{attention_messages(scheme, P)}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("scheme", ["allgather_kv", "ulysses"])
def test_gradients_equal_full_attention(scheme, causal, layout):
    q, k, v = (t.requires_grad_() for t in qkv(P, seed=10))
    full_attention(q, k, v, causal).pow(2).sum().backward()
    parts = [mine(t.detach(), layout).requires_grad_() for t in (q, k, v)]
    SCHEMES[scheme](*parts, C, causal=causal, layout=layout).pow(2).sum().backward()
    for name, full, part in zip("qkv", (q, k, v), parts):
        agree(torch.allclose(part.grad, mine(full.grad, layout), **TOL),
              f"{scheme}: d{name} differs by {(part.grad - mine(full.grad, layout)).abs().max():.2e}")


@pytest.mark.parametrize("scheme", ["ring", "streamed_kv"])
def test_block_schemes_refuse_gradients_and_count_causal_work(scheme):
    q, k, v = qkv(2 * P, seq_chunks=2, seed=20)
    for grads in ((q,), (k, v)):
        for t in grads:
            t.requires_grad_()
        with pytest.raises(NotImplementedError, match="forward-only"):
            SCHEMES[scheme](q, k, v, C, check=False)  # (before any message: no rank waits for another)
        for t in grads:
            t.requires_grad_(False)
    for layout in LAYOUTS:
        stats = {}
        SCHEMES[scheme](mine(q, layout), mine(k, layout), mine(v, layout), C, causal=True, layout=layout,
                        stats=stats)
        want = causal_work(q.shape[2], P, layout)[RANK]
        agree(stats["scores"] == want, f"{layout}: scored {stats['scores']} pairs, causal_work says {want}")
    agree(len(set(causal_work(4 * P, P, "zigzag"))) == 1, "zig-zag work is not the same on every rank")


class RecordingComm:
    """Passes every call on to C and notes the nonblocking ones, so a test can see their order."""

    def __init__(self, comm, log):
        self.comm, self.log, self.rank, self.size = comm, log, comm.rank, comm.size

    def isend(self, buf, dest, tag=0):
        self.log.append(("isend", tag))
        return self.comm.isend(buf, dest, tag)

    def irecv(self, buf, source, tag=0):
        self.log.append(("irecv", tag))
        return self.comm.irecv(buf, source, tag)

    def waitall(self, requests):
        self.log.append(("wait", None))
        return self.comm.waitall(requests)

    def allgather_object(self, obj):
        return self.comm.allgather_object(obj)


def test_ring_starts_the_next_transfer_before_computing_on_the_current_block(monkeypatch):
    from tplab.sequence import ring
    from tplab.sequence.online_softmax import OnlineSoftmax

    log = []
    original = OnlineSoftmax.update
    monkeypatch.setattr(ring.OnlineSoftmax, "update", lambda self, *a, **k: (log.append(("compute", None)),
                                                                             original(self, *a, **k))[1])
    q, k, v = (mine(t, "contiguous") for t in qkv(P, seed=80))
    ring_attention(q, k, v, RecordingComm(C, log), causal=False)
    kinds = [kind for kind, _ in log]
    expected = []
    for step in range(P):  # post the transfer, compute on the block we hold, then wait for the transfer
        expected += (["irecv", "isend"] if step < P - 1 else []) + ["compute"] + (["wait"] if step < P - 1 else [])
    agree(kinds == expected, f"order of operations: {kinds}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_through_a_shard_exchange_equals_full_attention(causal, layout):
    """The ring's steps through ``exchange.start_pass`` (MessageExchange: one isend/irecv pair per step), two
    rings in a row on one exchange; through NullExchange nothing moves, so every step folds my own block again:
    without a mask, attention over p copies of my keys equals attention over my keys once."""
    from tplab.comm.shard_exchange import MessageExchange, NullExchange

    exchange = MessageExchange(C)  # (collective)
    q, k, v = qkv(P, seed=90)
    expected = mine(full_attention(q, k, v, causal), layout)
    with torch.no_grad():
        for _ in range(2):
            out = ring_attention(mine(q, layout), mine(k, layout), mine(v, layout), C, causal=causal, layout=layout,
                                 exchange=exchange)
            agree(torch.allclose(out, expected, **TOL), f"differs by {(out - expected).abs().max():.2e}")
        if not causal:
            q_mine, k_mine, v_mine = mine(q, layout), mine(k, layout), mine(v, layout)
            alone = ring_attention(q_mine, k_mine, v_mine, C, causal=False, layout=layout,
                                   exchange=NullExchange(RANK, P))
            own = full_attention(q_mine, k_mine, v_mine, causal=False)
            agree(torch.allclose(alone, own, **TOL), f"NullExchange: differs by {(alone - own).abs().max():.2e}")


def block_config(kv_heads, llama=False):
    if llama:  # RoPE (rotations by global positions), SwiGLU, RMSNorm, no biases
        return GPTConfig(n_embd=8 * P, n_head=2 * P, n_kv_head=kv_heads, mlp="swiglu", norm="rmsnorm",
                         position="rope", bias=False, dtype=torch.float64)
    return GPTConfig(n_embd=8 * P, n_head=2 * P, n_kv_head=kv_heads, dtype=torch.float64)


def non_causal_block(block, x):
    """The unsplit layer without the causal mask (gpt.Block is always causal)."""
    a, (b, s, h) = block.attention, x.shape
    y = block.norm1(x)
    q = a.q_proj(y).view(b, s, a.n_head, a.head_dim).transpose(1, 2)
    k = a.k_proj(y).view(b, s, a.n_kv_head, a.head_dim).transpose(1, 2)
    v = a.v_proj(y).view(b, s, a.n_kv_head, a.head_dim).transpose(1, 2)
    if a.rotary is not None:
        q, k = a.rotary(q, k)
    x = x + a.o_proj(full_attention(q, k, v, causal=False).transpose(1, 2).reshape(b, s, h))
    return x + block.mlp(block.norm2(x))


@pytest.mark.parametrize("model", ["gpt2-like", "llama-like"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_sequence_parallel_layer_equals_unsplit_block(scheme, layout, model):
    torch.manual_seed(30)  # the same weights on every rank
    block = Block(block_config(None, llama=False) if model == "gpt2-like" else block_config(P, llama=True))
    x = randn(2, 4 * P, 8 * P, seed=31)  # (b, s, h)
    with torch.no_grad():
        for causal in (True, False):
            expected = block(x) if causal else non_causal_block(block, x)
            whole = unsplit_layer(block, causal=causal)(x)  # the baseline of the scaling studies
            agree(torch.allclose(whole, expected, **TOL), f"unsplit_layer(causal={causal}) differs")
            layer = SequenceParallelBlock(block, C, scheme=scheme, layout=layout, causal=causal)
            y = layer(shard(x, RANK, P, layout))
            agree(torch.allclose(y, shard(expected, RANK, P, layout), **TOL),
                  f"causal={causal}: differs by {(y - shard(expected, RANK, P, layout)).abs().max():.2e}")


def test_layer_gradients_sum_over_ranks_to_the_unsplit_ones():
    """Weights are replicated: each rank's weight gradient covers its tokens; their sum is the full one."""
    torch.manual_seed(40)
    block = Block(block_config(None))
    x = randn(2, 4 * P, 8 * P, seed=41).requires_grad_()
    block(x).pow(2).sum().backward()
    full = {name: w.grad.clone() for name, w in block.named_parameters()}
    block.zero_grad()
    x_mine = shard(x.detach(), RANK, P, "zigzag").requires_grad_()
    SequenceParallelBlock(block, C, layout="zigzag")(x_mine).pow(2).sum().backward()
    agree(torch.allclose(x_mine.grad, shard(x.grad, RANK, P, "zigzag"), **TOL), "dx differs")
    for name, w in block.named_parameters():
        summed = torch.from_numpy(COMM.allreduce(w.grad.numpy()))
        agree(torch.allclose(summed, full[name], **TOL), f"{name}: summed gradient differs")


def test_staged_and_custom_gathers_move_the_same_bytes():
    """The course project's staging (host copy, bf16 as int16) and a vendor-style gather give the direct result."""
    x = randn(3, 5, seed=50 + RANK)  # (m, ...) blocks along the first dim
    direct = gather_sequence(x, C, dim=0)
    staged = staged_allgather_first_dim(x, C)
    vendor = gather_sequence(x, C, dim=0, gather=lambda t, comm: torch.from_numpy(
        np.concatenate(COMM.allgather(t.numpy()))))
    agree(torch.equal(direct, staged) and torch.equal(direct, vendor), "gathers disagree")
    b16 = x.to(torch.bfloat16)
    agree(torch.equal(staged_allgather_first_dim(b16, C), direct.to(torch.bfloat16))
          and torch.equal(gather_sequence(b16, C, dim=0), direct.to(torch.bfloat16)), "bf16 bits changed")


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@settings(max_examples=8)  # (of 6 sizes x 3 dtypes)
@given(block=st.integers(0, 5), dtype=st.sampled_from(["float64", "float32", "int32"]))
@abort_on_exception
def test_alltoall_equals_mpi_alltoall(kind, block, dtype):
    rearm_watchdog()
    x = (np.arange(P * block) + 1000 * RANK).astype(dtype).reshape(P, block)  # row j for rank j
    want = np.empty_like(x)
    COMM.Alltoall(x, want)
    C.reset_counters()
    got = alltoall(torch.from_numpy(x) if kind == "torch" else x, C)
    got = got.numpy() if kind == "torch" else got
    agree(np.array_equal(got, want), f"got {got.tolist()}, MPI_Alltoall {want.tolist()}")
    agree(C.bytes_sent == (P - 1) * block * x.itemsize and C.messages_sent == P - 1,
          f"sent {C.bytes_sent} B in {C.messages_sent} messages")


def test_bad_input_is_the_same_error_on_every_rank():
    with pytest.raises(ValueError, match="cannot be cut into"):
        shard(torch.zeros(1, 2 * P + 1, 4), RANK, P, "zigzag")  # odd: never 2P equal chunks
    with pytest.raises(ValueError, match="unknown layout"):
        shard(torch.zeros(1, 4, 4), RANK, P, "striped")
    with pytest.raises(ValueError, match="unknown sequence-parallel scheme"):
        SequenceParallelBlock(Block(block_config(None)), C, scheme="tree")
    q, k, v = (mine(t, "contiguous") for t in qkv(2 * P, seed=60))
    # one rank holds a token more than the others: the shapes disagree, on every rank the same error
    longer = [torch.cat([t, t[:, :, :1]], dim=2) if RANK == P - 1 else t for t in (q, k, v)]
    for scheme in SCHEMES:
        with pytest.raises(SequenceParallelError, match="disagree on shapes" if P > 1 else "."):
            if P == 1:
                raise SequenceParallelError("nothing to disagree with on one rank")
            SCHEMES[scheme](*longer, C)
    with pytest.raises(SequenceParallelError, match="do not cut into the 2 chunks"):
        SCHEMES["ring"](q[:, :, :1], k[:, :, :1], v[:, :, :1], C, layout="zigzag")  # 1 local token
    with pytest.raises(CollectiveArgumentError, match="one block per destination"):
        alltoall(np.zeros((P + 1, 2)), C)
    agree(True)


@pytest.mark.skipif(P < 2, reason="one rank holds every head")
def test_ulysses_needs_heads_divisible_by_ranks():
    q = randn(1, P + 1, 2 * P, 4, seed=70)[:, :, : 2]  # P + 1 heads, 2 local tokens
    with pytest.raises(SequenceParallelError, match=f"divisible by {P}"):
        SCHEMES["ulysses"](q, q, q, C)
    q = randn(1, 2 * P, 2, 4, seed=71)  # query heads split, but one KV head cannot be
    with pytest.raises(SequenceParallelError, match=f"1 key/value heads must both be divisible by {P}"):
        SCHEMES["ulysses"](q, q[:, :1], q[:, :1], C)
    agree(True)


def test_scaling_study_counts_the_formula_bytes():
    rows = scaling_study(C, hidden=4 * P, heads=P, seq_len=2 * P, batch=1, ranks=[1, P], iters=1, warmup=0,
                         dtype=torch.float64)
    agree([r["p"] for r in rows] == [1, P], str(rows))
    agree(all(r["bytes_per_rank"] == r["predicted_bytes_per_rank"] and r["time_s"] > 0 for r in rows),
          str([(r["bytes_per_rank"], r["predicted_bytes_per_rank"]) for r in rows]))


def test_each_query_chunk_is_final_at_the_last_block_it_sees():
    """The ring folds blocks in the order r, r-1, ...: under a causal mask a query chunk sees nothing after
    rank 0's block in the contiguous layout, and neither does rank r's first chunk in the zig-zag layout
    (its second sees every block); without a mask every chunk is final at the last block."""
    from tplab.sequence.ring import last_blocks

    for p in range(1, 7):
        for r in range(p):
            ring_order = tuple((r - step) % p for step in range(p))
            assert last_blocks((r,), ring_order, p, "contiguous", True) == (0,)
            assert last_blocks((r, 2 * p - 1 - r), ring_order, p, "zigzag", True) == (0, ring_order[-1])
            for layout, chunks in (("contiguous", (r,)), ("zigzag", (r, 2 * p - 1 - r))):
                assert last_blocks(chunks, ring_order, p, layout, False) == (ring_order[-1],) * len(chunks)
