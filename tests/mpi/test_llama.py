"""A Hugging Face LlamaForCausalLM (random weights from a small config, no download), sharded: the same
logits as Hugging Face's (float64: 1e-10), the same greedy tokens, clear errors for what cannot split."""

import pytest
from mpitest import COMM, agree, same_on_every_rank

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402  (seconds: at collection, not in a test)

from tplab.comm import world  # noqa: E402
from tplab.layers import mappings  # noqa: E402
from tplab.models import parallelize  # noqa: E402
from tplab.models.hf import from_hf_llama  # noqa: E402

P = COMM.size
C = world(timeout=10)


def hf_llama(kv_heads, tie=False, heads=2 * P, dtype=torch.float64, seed=90, **overrides):
    config = dict(vocab_size=8 * P, hidden_size=4 * heads, intermediate_size=12 * P, num_hidden_layers=2,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                  tie_word_embeddings=tie, rope_theta=500000.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config.update(overrides)
    torch.manual_seed(seed)  # the same random model on every rank
    return LlamaForCausalLM(LlamaConfig(**config)).to(dtype).eval()


# KV heads: one (replicated on every rank when p > 1), two (replicated in pairs), one per rank, two per rank
KV_CASES = {"1": lambda: 1, "2": lambda: 2, "p": lambda: P, "2p (MHA)": lambda: 2 * P}


@pytest.mark.parametrize("kv", list(KV_CASES))
@pytest.mark.parametrize("tie", [False, True])
def test_sharded_llama_gives_hugging_face_logits(kv, tie):
    kv_heads = KV_CASES[kv]()
    if P % kv_heads and kv_heads % P:
        pytest.skip(f"{kv_heads} KV heads neither split over nor replicate onto {P} ranks")
    hf = hf_llama(kv_heads, tie)
    tokens = torch.randint(0, 8 * P, (2, 2 * P + 1), generator=torch.Generator().manual_seed(91))
    sharded = parallelize(hf, C)
    mappings.calls.clear()
    with torch.no_grad():
        expected, got = hf(tokens).logits, sharded(tokens).logits
    err = float((got - expected).abs().max() / expected.abs().max())
    agree(err < 1e-10, f"relative difference {err:.2e} (kv heads {kv_heads}, tied {tie})")
    agree(same_on_every_rank(got.numpy().tobytes()), "ranks hold different logits")
    agree(dict(mappings.calls) == {"allreduce": 2 * 2 + 1, "allgather": 1}, str(dict(mappings.calls)))
    if tie:
        agree(sharded.gpt.lm_head.weight is sharded.gpt.wte.weight, "the tied table is held twice")


def test_sharded_llama_generates_hugging_faces_tokens():
    hf = hf_llama(1 if P > 1 else 2, tie=True, heads=2 * P if P > 1 else 4)
    prompt = torch.randint(1, 8 * P, (1, 5), generator=torch.Generator().manual_seed(92))
    expected = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    for sequence_parallel in (False, True):
        sharded = parallelize(hf, C, sequence_parallel=sequence_parallel)
        got = sharded.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        agree(torch.equal(got, expected), f"SP={sequence_parallel}: {got[0].tolist()} vs HF {expected[0].tolist()}")


def test_float32_llama_within_float32_rounding():
    hf = hf_llama(1, dtype=torch.float32)
    tokens = torch.randint(0, 8 * P, (1, 7), generator=torch.Generator().manual_seed(93))
    with torch.no_grad():
        expected, got = hf(tokens).logits, parallelize(hf, C)(tokens).logits
    err = float((got - expected).abs().max() / expected.abs().max())
    agree(err < 1e-5, f"relative difference {err:.2e}")


@pytest.mark.skipif(P < 2, reason="every shape splits over one rank")
def test_llama_shapes_tensor_parallelism_cannot_split():
    cases = [  # (config changes, the error names)
        (dict(num_attention_heads=2 * P + 1, hidden_size=4 * (2 * P + 1), num_key_value_heads=1),
         "num_heads .* not divisible"),
        (dict(num_key_value_heads=P + 1, num_attention_heads=2 * (P + 1), hidden_size=8 * (P + 1)),
         "not divisible|multiple of num_kv_heads"),
        (dict(vocab_size=8 * P + 1), "vocabulary size = .* not divisible"),
        (dict(intermediate_size=12 * P + 1), r"MLP hidden size \(ffn_size\) = .* not divisible"),
    ]
    for changes, message in cases:
        heads = changes.pop("num_attention_heads", 2 * P)
        kv = changes.pop("num_key_value_heads", 1)
        hf = hf_llama(kv, heads=heads, dtype=torch.float32, **changes)
        with pytest.raises(ValueError, match=message):
            parallelize(hf, C)
    agree(True)


def test_what_tplab_cannot_convert_is_a_clear_error():
    with pytest.raises(ValueError, match="head_dim"):
        from_hf_llama(hf_llama(2, heads=2, dtype=torch.float32, head_dim=8, hidden_size=8))
    with pytest.raises(ValueError, match="RoPE type 'linear'"):
        from_hf_llama(hf_llama(2, heads=2, dtype=torch.float32, rope_scaling={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(ValueError, match="unsupported activation"):
        from_hf_llama(hf_llama(2, heads=2, dtype=torch.float32, hidden_act="gelu"))
    agree(True)


def test_rmsnorm_computes_like_hugging_face():
    """In float32 whatever the model's dtype, cast back before the weight: bitwise equal to theirs."""
    from tplab.layers.norms import RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    theirs = LlamaRMSNorm(8, eps=1e-5).double()
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(8, generator=torch.Generator().manual_seed(94), dtype=torch.float64))
    ours = RMSNorm(8, eps=1e-5, compute_dtype=torch.float32, dtype=torch.float64)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(95), dtype=torch.float64)
    agree(torch.equal(ours(x), theirs(x)), "RMSNorm differs from LlamaRMSNorm")
