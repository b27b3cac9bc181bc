"""A tensor-parallel GPT returns the same logits as the unsplit one, on every rank."""

import pytest
from mpitest import COMM, agree, same_on_every_rank

torch = pytest.importorskip("torch")

from tplab.comm import world  # noqa: E402
from tplab.layers import mappings  # noqa: E402
from tplab.models import GPT, GPTConfig, parallelize  # noqa: E402

P = COMM.size
C = world(timeout=10)

try:  # seconds to import: here, at collection, rather than inside a test's watchdog
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError:
    GPT2Config = GPT2LMHeadModel = None


@pytest.mark.parametrize("shape", ["gpt2-like", "llama-like"])
def test_sharded_gpt_gives_the_unsplit_logits(shape):
    if shape == "gpt2-like":
        config = GPTConfig(vocab_size=8 * P, n_layer=2, n_head=2 * P, n_embd=8 * P, dtype=torch.float64)
    else:  # GQA with fewer KV heads than ranks when p > 1, SwiGLU, RMSNorm, no biases
        config = GPTConfig(vocab_size=8 * P, n_layer=2, n_head=2 * P, n_kv_head=1, n_embd=8 * P, mlp="swiglu",
                           norm="rmsnorm", bias=False, dtype=torch.float64)
    torch.manual_seed(50)  # the same model on every rank
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(51))
    sharded = parallelize(model, C)
    mappings.calls.clear()
    with torch.no_grad():
        full, mine = model(tokens), sharded(tokens)
    err = float(((mine - full).abs().max() / full.abs().max()))
    agree(err < 1e-10, f"relative difference {err:.2e}")
    agree(same_on_every_rank(mine.numpy().tobytes()), "ranks hold different logits")
    agree(dict(mappings.calls) == {"allreduce": 2 * config.n_layer + 1, "allgather": 1}, str(dict(mappings.calls)))


@pytest.mark.skipif(P < 2, reason="everything splits over one rank")
def test_shapes_tensor_parallelism_cannot_split():
    with pytest.raises(ValueError, match="num_heads .* not divisible by the tensor-parallel size"):
        parallelize(GPT(GPTConfig(vocab_size=8 * P, n_head=2 * P + 1, n_embd=2 * P + 1)), C)
    with pytest.raises(ValueError, match="vocabulary size .* not divisible"):
        parallelize(GPT(GPTConfig(vocab_size=8 * P + 1, n_head=P, n_embd=4 * P)), C)
    with pytest.raises(ValueError, match=r"MLP hidden size \(ffn_size\) = .* not divisible"):
        parallelize(GPT(GPTConfig(vocab_size=8 * P, n_head=P, n_embd=4 * P, ffn_size=4 * P + 1)), C)
    with pytest.raises(ValueError, match="vocabulary size .*; MLP hidden size"):  # every problem named at once
        parallelize(GPT(GPTConfig(vocab_size=8 * P + 1, n_head=P, n_embd=4 * P, ffn_size=4 * P + 1)), C)
    sp = parallelize(GPT(GPTConfig(vocab_size=8 * P, n_head=P, n_embd=4 * P)), C, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence parallelism splits the sequence .* not divisible"):
        sp(torch.zeros(1, P + 1, dtype=torch.long))
    agree(True)


@pytest.mark.parametrize("n_kv_head", [None, 1])
def test_greedy_generation_with_kv_cache_matches_unsplit(n_kv_head):
    from tplab.models import generate

    config = GPTConfig(vocab_size=8 * P, block_size=24, n_layer=2, n_head=2 * P, n_kv_head=n_kv_head,
                       n_embd=8 * P, dtype=torch.float64)
    torch.manual_seed(60)
    model = GPT(config)
    prompt = torch.randint(0, config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(61))
    expected = generate(model, prompt, 12, use_cache=False)  # recompute everything every step
    agree(torch.equal(generate(model, prompt, 12), expected), "the KV cache changes the tokens")
    sharded = generate(parallelize(model, C), prompt, 12)
    agree(torch.equal(sharded, expected), f"sharded generation differs: {sharded[0].tolist()} vs {expected[0].tolist()}")
    agree(same_on_every_rank(sharded.numpy().tobytes()), "ranks generated different tokens")


@pytest.mark.skipif(GPT2Config is None, reason="transformers is not installed")
def test_hugging_face_gpt2_sharded_gives_its_logits():
    config = GPT2Config(vocab_size=8 * P, n_positions=32, n_embd=8 * P, n_layer=2, n_head=2 * P,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(70)  # the same random model on every rank: no download
    hf = GPT2LMHeadModel(config).double().eval()
    tokens = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(71))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = parallelize(hf, C)(tokens).logits
    err = float((got - expected).abs().max() / expected.abs().max())
    agree(err < 1e-10, f"relative difference {err:.2e}")
