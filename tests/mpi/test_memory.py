"""Memory per rank: the parameters a sharded model holds equal the count from its config, and the
activations autograd keeps equal tplab's per-tensor accounting, TP and TP + SP."""

import pytest
from mpitest import COMM, agree

torch = pytest.importorskip("torch")

from tplab.comm import world  # noqa: E402
from tplab.models import GPT, GPTConfig, parallelize  # noqa: E402
from tplab.models.memory import (  # noqa: E402
    activation_bytes_computed,
    activation_bytes_measured,
    megatron_activation_bytes,
    parameter_bytes,
    parameter_bytes_computed,
)

P = COMM.size
C = world(timeout=10)

CONFIGS = {
    "gpt2-like": dict(vocab_size=8 * P, n_layer=2, n_head=2 * P, n_embd=8 * P, dtype=torch.float64),
    "llama-like float32 norms": dict(vocab_size=8 * P, n_layer=2, n_head=2 * P, n_kv_head=1, n_embd=8 * P,
                                     ffn_size=12 * P, mlp="swiglu", norm="rmsnorm", norm_dtype=torch.float32,
                                     position="rope", bias=False, tie_embeddings=True, dtype=torch.float64),
    "llama-like float32": dict(vocab_size=8 * P, n_layer=2, n_head=4 * P, n_kv_head=2 * P, n_embd=8 * P,
                               ffn_size=12 * P, mlp="swiglu", norm="rmsnorm", position="rope", bias=False),
}


@pytest.mark.parametrize("shape", list(CONFIGS))
def test_parameter_bytes_per_rank_measured_equal_computed(shape):
    torch.manual_seed(110)
    model = GPT(GPTConfig(**CONFIGS[shape]))
    agree(parameter_bytes(model) == parameter_bytes_computed(model.config)["total"], "unsplit model")
    sharded = parallelize(model, C)
    got, want = parameter_bytes(sharded), parameter_bytes_computed(model.config, P)["total"]
    agree(got == want, f"sharded: holds {got} bytes, computed {want}")
    if P > 1:
        agree(got < parameter_bytes(model), "sharding did not shrink the parameters")


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("shape", list(CONFIGS))
def test_activation_bytes_per_block_measured_equal_computed(shape, sequence_parallel):
    """Exact for torch 2.13 on CPU (fused attention keeps q, k, v, output, log-sum-exp); 2% allowed for
    other versions, whose kernels may keep a little more or less."""
    torch.manual_seed(111)
    model = GPT(GPTConfig(**CONFIGS[shape]))
    b, s = 2, 4 * P
    tokens = torch.randint(0, model.config.vocab_size, (b, s), generator=torch.Generator().manual_seed(112))
    measured = activation_bytes_measured(parallelize(model, C, sequence_parallel=sequence_parallel), tokens)
    computed = activation_bytes_computed(model.config, b, s, P, sequence_parallel)
    for block in measured["blocks"]:
        for region in ("norms", "attention", "MLP"):
            err = abs(block[region] - computed[region]) / computed[region]
            agree(err <= 0.02, f"{region}: measured {block[region]}, computed {computed[region]:.0f}")


def test_sequence_parallel_shrinks_the_norms_activations_by_p():
    config = GPTConfig(**CONFIGS["gpt2-like"])
    tp, sp = (activation_bytes_computed(config, 2, 4 * P, P, flag) for flag in (False, True))
    agree(abs(sp["norms"] * P - tp["norms"]) < 1e-9 and sp["attention"] == tp["attention"], f"{tp} vs {sp}")
    # the paper's formula: with SP everything is split, so TP+SP = (no parallelism) / t
    agree(abs(megatron_activation_bytes(4096, 1, 4096, 32, P, True) * P - megatron_activation_bytes(4096, 1, 4096, 32))
          < 1e-3, "Megatron SP formula")
