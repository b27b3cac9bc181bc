"""Hugging Face MixtralForCausalLM and Qwen2MoeForCausalLM (small random configs, no download), sharded: heads
over the ranks (TP), experts over the ranks (EP, 5 experts: uneven for most p). HF's logits in float64 and HF's
greedy tokens."""

import pytest
from mpitest import COMM, agree, same_on_every_rank

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM  # noqa: E402

from tplab.comm import world  # noqa: E402
from tplab.models import parallelize  # noqa: E402
from tplab.moe import ReplicatedTokensMoE  # noqa: E402

P = COMM.size
C = world(timeout=10)
# the rank counts the issue asks for (p = 1, 2, 4); the suite's time budget leaves the others to test_moe.py
pytestmark = pytest.mark.skipif(P not in (1, 2, 4), reason="Hugging Face MoE models are checked at p = 1, 2, 4")


def hf_mixtral(seed=7):
    config = MixtralConfig(vocab_size=8 * P, hidden_size=8 * P, intermediate_size=10, num_hidden_layers=2,
                           num_attention_heads=2 * P, num_key_value_heads=P, max_position_embeddings=64,
                           num_local_experts=5, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0)
    config._experts_implementation = "eager"  # HF's default experts kernel has no float64
    torch.manual_seed(seed)  # the same random model on every rank
    return MixtralForCausalLM(config).to(torch.float64).eval()


def test_sharded_mixtral_gives_hugging_face_logits_and_tokens():
    hf = hf_mixtral()
    sharded = parallelize(hf, C)
    agree(all(isinstance(b.mlp, ReplicatedTokensMoE) for b in sharded.gpt.blocks), "the FFNs are not split by experts")
    tokens = torch.randint(0, 8 * P, (2, 7), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected, got = hf(tokens).logits, sharded(tokens).logits
    err = float((got - expected).abs().max() / expected.abs().max())
    agree(err < 1e-12, f"relative difference {err:.2e}")
    agree(same_on_every_rank(got.numpy().tobytes()), "ranks hold different logits")
    agree(type(sharded(tokens)).__name__ == type(hf(tokens)).__name__, "not HF's output type")
    sp = parallelize(hf, C, sequence_parallel=True)  # each rank's slice of the sequence goes to the experts as is
    with torch.no_grad():
        err = float((sp(tokens[:, :4]).logits - hf(tokens[:, :4]).logits).abs().max() / expected.abs().max())
    agree(err < 1e-12, f"sequence-parallel: relative difference {err:.2e}")
    prompt = tokens[:1, :4]
    want = hf.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    have = sharded.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    agree(torch.equal(have, want), f"{have[0].tolist()} vs HF {want[0].tolist()}")


def test_sharded_qwen_moe_with_a_shared_expert_and_a_dense_layer():
    config = Qwen2MoeConfig(vocab_size=8 * P, hidden_size=8 * P, intermediate_size=4 * P, moe_intermediate_size=6,
                            shared_expert_intermediate_size=10, num_hidden_layers=2, num_attention_heads=2 * P,
                            num_key_value_heads=P, max_position_embeddings=64, num_experts=5, num_experts_per_tok=2,
                            norm_topk_prob=False, mlp_only_layers=[1], bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config._experts_implementation = "eager"
    torch.manual_seed(9)
    hf = Qwen2MoeForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():  # q, k, v biases (HF initialises them to zero): make them count
        for name, tensor in hf.named_parameters():
            if name.endswith("bias"):
                tensor.normal_()
    sharded = parallelize(hf, C)
    agree([type(b.mlp).__name__ for b in sharded.gpt.blocks] == ["ReplicatedTokensMoE", "ParallelMLP"],
          "layer 0 should be split by experts, layer 1 (dense) by columns")
    tokens = torch.randint(0, 8 * P, (2, 6), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        expected, got = hf(tokens).logits, sharded(tokens).logits
    err = float((got - expected).abs().max() / expected.abs().max())
    agree(err < 1e-12, f"relative difference {err:.2e}")
    prompt = tokens[:1, :3]
    want = hf.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    have = sharded.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    agree(torch.equal(have, want), f"{have[0].tolist()} vs HF {want[0].tolist()}")
