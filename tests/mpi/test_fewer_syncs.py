"""The student project's blocks on real ranks: the TP block is the unsplit block; every block type and model on p
ranks equals its single-process simulation (float64, ~1e-12); the all-reduces counted match the formulas."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpitest import COMM, abort_on_exception, agree, rearm_watchdog, same_on_every_rank

torch = pytest.importorskip("torch")
# torch.optim's first optimizer imports torch._dynamo (seconds per rank on a shared 2-core machine): do it
# here, at collection, rather than inside a test's deadlock watchdog
import torch._dynamo  # noqa: E402, F401, F811

from tplab.comm import world  # noqa: E402
from tplab.lab.data import CharData  # noqa: E402
from tplab.fewer_syncs import (  # noqa: E402
    PATTERNS,
    FewerSyncsGPT,
    ParallelRun,
    RealRanks,
    SimulatedRanks,
    SPDBlock,
    TPBlock,
    TrainConfig,
    dense_gpt,
    syncs_per_forward,
    train,
    weight_grad_syncs,
)
from tplab.layers import mappings  # noqa: E402

P = COMM.size
C = world(timeout=10)
F64 = torch.float64


def close(a, b, tol=1e-12) -> bool:
    a, b = a.detach(), b.detach()
    return bool((a - b).abs().max() <= tol * max(1.0, float(b.abs().max())))


def dense(n_layer=3, n_head=2 * P, head_dim=4, vocab=11, seed=5):
    """An unsplit GPT, the same on every rank, with every weight random (biases and norms included)."""
    model = dense_gpt(n_layer, vocab, block_size=12, n_head=n_head, n_embd=n_head * head_dim, seed=seed, dtype=F64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=F64))
    return model


def tokens(seed=7, vocab=11):
    return torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(seed))


def activations(h, seed=8):
    return torch.randn(2, 7, h, generator=torch.Generator().manual_seed(seed), dtype=F64)


def build(kind, model, ranks):
    blocks = list(model.blocks)
    if kind == "tp":
        return TPBlock.from_dense(blocks[0], ranks)
    if kind == "spd":
        return SPDBlock.from_dense(blocks[0], ranks)
    return ParallelRun.from_dense(blocks[: int(kind[-1])], ranks)  # "parallel1", "parallel3"


def shards_and_replicated(module):
    """(name -> grad) of the shards' parameters by shard index, and of the replicated parameters."""
    sharded, replicated = {}, {}
    for name, p in module.named_parameters():
        parts = name.split(".")
        if "shards" in parts:
            i = parts.index("shards")
            shard = module.ranks.local[int(parts[i + 1])]
            sharded[(shard, ".".join(parts[:i] + parts[i + 2:]))] = p.grad
        else:
            replicated[name] = p.grad
    return sharded, replicated


def test_tp_block_equals_the_unsplit_block():
    model = dense(n_layer=1)
    block = model.blocks[0]
    split = TPBlock.from_dense(block, RealRanks(C))
    x_full = activations(model.config.n_embd).requires_grad_()
    x = x_full.detach().clone().requires_grad_()
    mappings.calls.clear()
    y_full, y = block(x_full), split(x)
    agree(mappings.calls["allreduce"] == 2, f"{dict(mappings.calls)}: the TP block all-reduces twice")
    agree(close(y, y_full), f"forward differs by {(y - y_full).abs().max():.2e}")
    agree(same_on_every_rank(y.detach().numpy().tobytes()), "ranks hold different outputs")
    y_full.square().sum().backward()
    y.square().sum().backward()
    agree(close(x.grad, x_full.grad), "dX differs")
    shard = split.shards[0]
    mine = slice(COMM.rank * shard.heads * shard.head_dim, (COMM.rank + 1) * shard.heads * shard.head_dim)
    a, m = block.attention, block.mlp
    agree(close(shard.q.weight.grad, a.q_proj.weight.grad[mine]) and close(shard.o.weight.grad, a.o_proj.weight.grad[:, mine]),
          "attention weight gradients are not the slices of the unsplit ones")
    agree(close(shard.up.weight.grad, m.up.weight.grad.chunk(P)[COMM.rank])
          and close(split.mlp_bias.grad, m.down.bias.grad) and close(split.norm1.weight.grad, block.norm1.weight.grad),
          "MLP / bias / norm gradients differ")


@pytest.mark.parametrize("kind", ["tp", "spd", "parallel1", "parallel3"])
def test_block_on_ranks_equals_its_simulation(kind):
    model = dense(n_layer=3)
    real, sim = build(kind, model, RealRanks(C)), build(kind, model, SimulatedRanks(P))
    x_real = activations(model.config.n_embd).requires_grad_()
    x_sim = x_real.detach().clone().requires_grad_()
    counted = []
    for module, x in [(real, x_real), (sim, x_sim)]:
        mappings.calls.clear()
        y = module(x)
        counted.append(mappings.calls["allreduce"])
        (y * torch.linspace(-1, 1, y.shape[-1], dtype=F64)).sum().backward()
        module.y = y
    agree(counted == [{"tp": 2, "spd": 1}.get(kind, 1)] * 2, f"{kind}: all-reduces counted {counted}")
    agree(close(real.y, sim.y), f"{kind}: forward differs by {(real.y - sim.y).abs().max():.2e}")
    agree(close(x_real.grad, x_sim.grad), f"{kind}: dX differs")
    real_sharded, real_replicated = shards_and_replicated(real)
    sim_sharded, sim_replicated = shards_and_replicated(sim)
    bad = [k for k, g in real_sharded.items() if not close(g, sim_sharded[k])]
    bad += [k for k, g in real_replicated.items() if not close(g, sim_replicated[k])]
    agree(not bad, f"{kind}: gradients differ for {bad[:4]}")


def run_model(pattern, ranks, model):
    net = FewerSyncsGPT(model, pattern, ranks)
    mappings.calls.clear()
    logits, loss = net(tokens(), tokens(seed=9))
    forward = mappings.calls["allreduce"]
    loss.backward()
    counts = (forward, mappings.calls["allreduce"] - forward, mappings.calls["weight_grad_allreduce"])
    return net, logits, counts


@given(pattern=st.lists(st.sampled_from(["tp", "spd", "parallel"]), min_size=1, max_size=5))
@settings(max_examples=6)
@abort_on_exception
def test_any_pattern_on_ranks_equals_simulation_and_counts_its_syncs(pattern):
    rearm_watchdog()
    model = dense(n_layer=len(pattern))
    real, real_logits, real_counts = run_model(pattern, RealRanks(C), model)
    sim, sim_logits, sim_counts = run_model(pattern, SimulatedRanks(P), model)
    expected = (syncs_per_forward(pattern), syncs_per_forward(pattern), weight_grad_syncs(pattern))
    agree(real_counts == sim_counts == expected, f"{pattern}: counted {real_counts} / {sim_counts}, formula {expected}")
    agree(close(real_logits, sim_logits), f"{pattern}: logits differ by {(real_logits - sim_logits).abs().max():.2e}")
    agree(close(real.wte.weight.grad, sim.wte.weight.grad), f"{pattern}: embedding gradients differ")


def test_project_patterns_and_shape():
    if 4 % P:
        pytest.skip(f"the project's 4 heads do not split over {P} ranks")
    assert [syncs_per_forward(p) for p in PATTERNS.values()] == [8, 4, 4, 1]
    for name, pattern in PATTERNS.items():
        model = dense(n_layer=4, n_head=4, head_dim=8)
        _, real_logits, counts = run_model(pattern, RealRanks(C), model)
        _, sim_logits, _ = run_model(pattern, SimulatedRanks(P), model)
        agree(counts[0] == syncs_per_forward(pattern), f"{name}: {counts}")
        agree(close(real_logits, sim_logits), f"{name}: logits differ")


def test_training_steps_on_ranks_equal_the_simulation():
    text = "".join(chr(97 + (i * 7 + i // 5) % 11) for i in range(600))  # 11 letters, no download
    data = CharData(text)
    cfg = TrainConfig(steps=3, batch_size=2, block_size=8, n_head=2 * P, n_embd=8 * P, warmup_steps=1,
                      eval_interval=3, eval_iters=2, dtype=F64, grad_clip=0.05)  # clipping on at every step
    pattern = ["tp", "spd", "parallel", "parallel"]
    real = train(pattern, data, cfg, RealRanks(C))
    sim = train(pattern, data, cfg, SimulatedRanks(P))
    for r, s in zip(real, sim):
        agree(abs(r["val_loss"] - s["val_loss"]) < 1e-10 and abs(r["train_loss"] - s["train_loss"]) < 1e-10,
              f"step {r['step']}: real {r['val_loss']!r} vs simulated {s['val_loss']!r}")
    agree(real[-1]["val_loss"] < real[0]["val_loss"], "three steps did not lower the loss")
    agree(same_on_every_rank(repr([r["val_loss"] for r in real])), "ranks report different losses")


def test_bad_patterns_and_shapes_raise_on_every_rank():
    with pytest.raises(ValueError, match="unknown block type"):
        FewerSyncsGPT(dense(n_layer=2), ["tp", "megatron"], RealRanks(C))
    with pytest.raises(ValueError, match="pattern has 1 blocks, the model 2"):
        FewerSyncsGPT(dense(n_layer=2), ["tp"], RealRanks(C))
    if P > 1:
        with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
            FewerSyncsGPT(dense(n_layer=1, n_head=2 * P + 1), ["spd"], RealRanks(C))
    agree(True)


def test_comm_time_rows_on_ranks_and_on_an_emulated_network():
    from tplab.fewer_syncs.comm_time import comm_time_per_step

    n_head = 4 if 4 % P == 0 else P
    rows = comm_time_per_step(iters=1, warmup=0, batch_size=1, block_size=8, n_embd=4 * n_head, comm=C)
    agree(same_on_every_rank(repr(rows)), "ranks return different rows")
    agree([r["syncs_forward"] for r in rows] == [8, 4, 4, 1], str([r["syncs_forward"] for r in rows]))
    agree(all(r["step_ms"] >= r["step_comm_ms"] >= 0 and r["forward_ms"] >= r["forward_comm_ms"] >= 0 for r in rows),
          "times inside collectives exceed the whole")
    latency = 2e-3
    slow = comm_time_per_step(iters=1, warmup=0, batch_size=1, block_size=8, n_embd=4 * n_head, comm=C, steps=False,
                              network=dict(latency=latency))
    baseline = slow[0]
    # every all-reduce on p > 1 ranks sends at least one message across the emulated network and waits for it
    agree(P == 1 or baseline["forward_comm_ms"] >= 8 * latency * 1e3, f"{baseline['forward_comm_ms']:.2f} ms")
    agree(all(r["step_ms"] != r["step_ms"] for r in slow), "steps=False still timed steps")
