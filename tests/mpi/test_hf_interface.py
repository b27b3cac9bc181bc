"""A sharded Hugging Face model answers as the model it came from: ``sharded(ids).logits`` (HF's output type,
HF's logits in float64 to 1e-10) and ``sharded.generate(ids, max_new_tokens=k, do_sample=False)`` (HF's
greedy tokens, end-of-sequence and padding of ended rows included); what it cannot do is a clear error.
Small random models from configs, nothing downloaded."""

import pytest
from mpitest import COMM, agree, same_on_every_rank

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from tplab.comm import world  # noqa: E402
from tplab.models import parallelize  # noqa: E402

P = COMM.size
C = world(timeout=10)
VOCAB = 8 * P


def tiny_gpt2():
    torch.manual_seed(80)  # the same random model on every rank
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=8 * P, n_layer=2, n_head=2 * P,
                        bos_token_id=0, eos_token_id=0, initializer_range=0.2)  # (0.2: varied tokens)
    return GPT2LMHeadModel(config).double().eval()


def tiny_llama():
    torch.manual_seed(81)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=8 * P, intermediate_size=12 * P, num_hidden_layers=2,
                         num_attention_heads=2 * P, num_key_value_heads=P, max_position_embeddings=32,
                         bos_token_id=0, eos_token_id=0, initializer_range=0.2)
    return LlamaForCausalLM(config).double().eval()


MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def prompts(batch, length, seed):  # ids from 1: 0 is the models' pad/eos token
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(MODELS))
def test_output_object_holds_hugging_faces_logits(name):
    hf = MODELS[name]()
    ids = prompts(2, 2 * P + 1, 82)
    with torch.no_grad():
        expected, out = hf(ids), parallelize(hf, C)(ids, attention_mask=torch.ones_like(ids))
    err = float((out.logits - expected.logits).abs().max() / expected.logits.abs().max())
    agree(type(out) is type(expected), f"{type(out).__name__} vs HF's {type(expected).__name__}")
    agree(err < 1e-10, f"{name}: relative difference {err:.2e}")
    agree(same_on_every_rank(out.logits.numpy().tobytes()), "ranks hold different logits")


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_greedy_generate_gives_hugging_faces_tokens(name, sequence_parallel):
    hf = MODELS[name]()
    prompt = prompts(2, P, 83)  # (a length that splits over the ranks: SP runs the prompt split)
    sharded = parallelize(hf, C, sequence_parallel=sequence_parallel)
    args = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False, eos_token_id=None)
    expected, got = hf.generate(prompt, **args), sharded.generate(prompt, **args)
    agree(torch.equal(got, expected), f"{name}: {got.tolist()} vs HF {expected.tolist()}")
    agree(sharded.sequence_parallel == sequence_parallel, "generate left sequence parallelism switched")


@pytest.mark.parametrize("name", list(MODELS))
def test_rows_end_at_eos_as_in_hugging_face(name):
    """Pick as end-of-sequence a token the first row produces early: it ends there, is padded while the other
    row goes on, and decoding stops once every row has ended (HF's output is then shorter)."""
    hf = MODELS[name]()
    prompt = prompts(2, 3, 84)
    mask = torch.ones_like(prompt)  # (all ones: no padding; passing it quiets HF's warning)
    free = hf.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                       pad_token_id=0)
    eos = int(free[0, 3 + 1])
    args = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0)
    expected, got = hf.generate(prompt, **args), parallelize(hf, C).generate(prompt, **args)
    agree(torch.equal(got, expected), f"{name}, eos {eos}: {got.tolist()} vs HF {expected.tolist()}")
    # the model's own generation_config (eos 0, pad unset: HF pads with eos) and max_length instead
    expected = hf.generate(prompt, attention_mask=mask, max_length=9, do_sample=False)
    got = parallelize(hf, C).generate(prompt, attention_mask=mask, max_length=9)
    agree(torch.equal(got, expected), f"{name}, config's eos: {got.tolist()} vs HF {expected.tolist()}")


def test_what_greedy_generate_cannot_do_is_a_clear_error():
    hf = tiny_gpt2()
    sharded, ids = parallelize(hf, C), prompts(1, 3, 85)
    refused = [  # (generate's arguments, the error names)
        (dict(do_sample=True), "sampling"),
        (dict(num_beams=2), "num_beams"),
        (dict(repetition_penalty=1.3), "repetition_penalty"),
        (dict(return_dict_in_generate=True), "return_dict_in_generate"),
        (dict(attention_mask=torch.tensor([[0, 1, 1]])), "padding"),
        (dict(beam_width=3), "does not know"),
    ]
    for kwargs, message in refused:
        with pytest.raises((NotImplementedError, TypeError), match=message):
            sharded.generate(ids, max_new_tokens=2, **kwargs)
    with pytest.raises(NotImplementedError, match="pad_token_id 0"):  # HF would mask the 0s as padding
        sharded.generate(torch.tensor([[0, 3, 4]]), max_new_tokens=2, eos_token_id=5, pad_token_id=0)
    hf.generation_config.do_sample = True  # a checkpoint that samples by default
    with pytest.raises(NotImplementedError, match="do_sample=False"):
        parallelize(hf, C).generate(ids, max_new_tokens=2)
    with pytest.raises(NotImplementedError, match="labels"):
        sharded(ids, labels=ids)
    # options that only tune sampling are ignored under greedy decoding, as Hugging Face ignores them
    plain = sharded.generate(ids, max_new_tokens=2, do_sample=False)
    agree(torch.equal(sharded.generate(ids, max_new_tokens=2, do_sample=False, temperature=0.7, top_k=5), plain))
