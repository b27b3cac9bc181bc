"""Whole-model sequence parallelism: activations split along the sequence between blocks, the same logits
as the unsplit model, 2 all-gathers + 2 reduce-scatters per block instead of 2 all-reduces."""

import pytest
from mpitest import COMM, agree, same_on_every_rank

torch = pytest.importorskip("torch")

from tplab.comm import world  # noqa: E402
from tplab.layers import mappings  # noqa: E402
from tplab.models import GPT, GPTConfig, generate, parallelize  # noqa: E402

P = COMM.size
C = world(timeout=10)

CONFIGS = {
    "gpt2-like": dict(vocab_size=8 * P, n_layer=2, n_head=2 * P, n_embd=8 * P),  # learned positions, biases
    "llama-like": dict(vocab_size=8 * P, n_layer=2, n_head=2 * P, n_kv_head=1, n_embd=8 * P, ffn_size=12 * P,
                       mlp="swiglu", norm="rmsnorm", norm_dtype=torch.float32, position="rope", bias=False,
                       tie_embeddings=True),
}


def model_of(shape):
    torch.manual_seed(80)  # the same model on every rank
    return GPT(GPTConfig(dtype=torch.float64, **CONFIGS[shape]))


@pytest.mark.parametrize("shape", list(CONFIGS))
def test_sequence_parallel_gpt_gives_the_unsplit_logits_with_four_collectives_per_block(shape):
    model = model_of(shape)
    tokens = torch.randint(0, model.config.vocab_size, (2, 3 * P), generator=torch.Generator().manual_seed(81))
    sharded = parallelize(model, C, sequence_parallel=True)
    mappings.calls.clear()
    with torch.no_grad():
        full, mine = model(tokens), sharded(tokens)
    err = float((mine - full).abs().max() / full.abs().max())
    agree(err < 1e-10, f"relative difference {err:.2e}")
    agree(same_on_every_rank(mine.numpy().tobytes()), "ranks hold different logits")
    L = model.config.n_layer  # embedding: 1 reduce-scatter; blocks: 2 + 2; before the LM head and after: 2 gathers
    agree(dict(mappings.calls) == {"allgather": 2 * L + 2, "reduce_scatter": 2 * L + 1}, str(dict(mappings.calls)))

    sharded.sequence_parallel = False  # the same weights, tensor-parallel communication
    mappings.calls.clear()
    with torch.no_grad():
        again = sharded(tokens)
    agree(float((again - full).abs().max() / full.abs().max()) < 1e-10, "TP after SP differs")
    agree(dict(mappings.calls) == {"allreduce": 2 * L + 1, "allgather": 1}, str(dict(mappings.calls)))


def test_sequence_parallel_prompt_then_tensor_parallel_decoding():
    """generate() runs the prompt sequence-parallel (its length splits) and the one-token steps TP."""
    model = model_of("llama-like")
    prompt = torch.randint(0, model.config.vocab_size, (2, 2 * P), generator=torch.Generator().manual_seed(82))
    expected = generate(model, prompt, 6)
    sharded = parallelize(model, C, sequence_parallel=True)
    got = generate(sharded, prompt, 6)
    agree(torch.equal(got, expected), f"{got[0].tolist()} vs {expected[0].tolist()}")
    agree(sharded.sequence_parallel, "generate did not restore sequence_parallel")


def test_float32_sequence_parallel_within_float32_rounding():
    torch.manual_seed(83)
    model = GPT(GPTConfig(**CONFIGS["llama-like"]))  # float32
    tokens = torch.randint(0, model.config.vocab_size, (1, 2 * P), generator=torch.Generator().manual_seed(84))
    with torch.no_grad():
        full, mine = model(tokens), parallelize(model, C, sequence_parallel=True)(tokens)
    err = float((mine - full).abs().max() / full.abs().max())
    agree(err < 1e-5, f"relative difference {err:.2e}")
