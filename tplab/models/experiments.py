"""What notebook 04 runs on every rank (``cluster.run(fn, ...)``): each function is collective over the
world communicator, checks or measures one thing, and returns plain rows for a DataFrame.

    weight_shards(hidden, ffn, heads, kv_heads)   the shapes each rank really holds (modules on "meta")
    exactness()                                   MLP and attention, sharded vs unsplit, float64
    collectives_per_pass(config, batch, seq)      counted collectives and bytes, TP vs SP, fwd and bwd
    hugging_face_generation(new_tokens)           HF GPT-2 and Llama, sharded: the same tokens
"""

from __future__ import annotations

import torch
from torch import nn

from tplab.comm import world
from tplab.layers import ColumnParallelLinear, ParallelAttention, ParallelMLP, RowParallelLinear, mappings
from tplab.layers.attend import attend
from tplab.models.gpt import GPT, GPTConfig, generate
from tplab.models.parallel import parallelize
from tplab.models.speed import wait_sleeping_for_rank_0


def weight_shards(hidden: int, ffn: int, heads: int, kv_heads: int) -> list[dict]:
    """One row per weight of a block: its full shape (out, in) and the shard this rank holds."""
    comm = world()
    with torch.device("meta"):  # shapes only: no memory, no arithmetic
        up = ColumnParallelLinear(hidden, ffn, comm, bias=False)
        down = RowParallelLinear(ffn, hidden, comm, bias=False)
        attention = ParallelAttention(hidden, heads, comm, num_kv_heads=kv_heads)
    d = hidden // heads
    rows = [("MLP up (column)", (ffn, hidden), up.weight, 0), ("MLP down (row)", (hidden, ffn), down.weight, 1),
            ("attention q (column)", (heads * d, hidden), attention.q_proj.weight, 0),
            ("attention k, v (column)", (kv_heads * d, hidden), attention.k_proj.weight, 0),
            ("attention o (row)", (hidden, heads * d), attention.o_proj.weight, 1)]
    heads_mine, kv_mine = attention.my_heads(), attention.my_kv_heads()
    first = {"MLP up (column)": comm.rank * up.out_per_rank, "MLP down (row)": comm.rank * down.in_per_rank,
             "attention q (column)": heads_mine[0] * d, "attention k, v (column)": kv_mine[0] * d,
             "attention o (row)": heads_mine[0] * d}
    return [{"rank": comm.rank, "weight": name, "full": full, "shard": tuple(w.shape), "split_dim": dim,
             "first": first[name]} for name, full, w, dim in rows]


def _rel(a, b) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def exactness(seed: int = 0) -> list[dict]:
    """MLP (GELU, SwiGLU) and attention (MHA, GQA with KV heads replicated): sharded against unsplit,
    forward output, input gradient and this rank's weight-gradient slice, float64."""
    comm, p, rows = world(), world().size, []
    f64 = dict(dtype=torch.float64)
    h, tokens = 8 * p, 6 * p
    g = torch.Generator().manual_seed(seed + 1)
    x_full = torch.randn(2, tokens, h, generator=g, **f64)
    for activation in ("gelu", "swiglu"):
        torch.manual_seed(seed)
        up, down = nn.Linear(h, 4 * h, **f64), nn.Linear(4 * h, h, **f64)
        gate = nn.Linear(h, 4 * h, **f64) if activation == "swiglu" else None
        sharded = ParallelMLP.from_dense(up, down, comm, gate=gate, activation=activation)
        x, xr = x_full.clone().requires_grad_(), x_full.clone().requires_grad_()
        hidden = nn.functional.gelu(up(xr)) if gate is None else nn.functional.silu(gate(xr)) * up(xr)
        y_ref = down(hidden)
        y = sharded(x)
        y_ref.square().sum().backward()
        y.square().sum().backward()
        rows.append({"rank": comm.rank, "layer": f"MLP ({activation})", "output": _rel(y, y_ref),
                     "input gradient": _rel(x.grad, xr.grad),
                     "weight gradient (my slice)": _rel(sharded.up.weight.grad, up.weight.grad.chunk(p)[comm.rank])})
    n = 2 * p
    d = h // n
    for name, kv in [("attention (MHA)", n), ("attention (GQA, 1 KV head)", 1)]:
        torch.manual_seed(seed)
        q, o = nn.Linear(h, n * d, **f64), nn.Linear(n * d, h, **f64)
        k, v = nn.Linear(h, kv * d, **f64), nn.Linear(h, kv * d, **f64)
        sharded = ParallelAttention.from_dense(q, k, v, o, n, comm, num_kv_heads=kv)
        xr, x = x_full.clone().requires_grad_(), x_full.clone().requires_grad_()
        b, s, _ = xr.shape
        Q = q(xr).view(b, s, n, d).transpose(1, 2)
        K = k(xr).view(b, s, kv, d).transpose(1, 2)  # (b, kv, s, d): attend repeats them for GQA
        V = v(xr).view(b, s, kv, d).transpose(1, 2)
        y_ref = o(attend(Q, K, V, causal=True).transpose(1, 2).reshape(b, s, h))
        y = sharded(x)
        y_ref.square().sum().backward()
        y.square().sum().backward()
        mine = slice(sharded.my_heads()[0] * d, (sharded.my_heads()[-1] + 1) * d)
        rows.append({"rank": comm.rank, "layer": name, "output": _rel(y, y_ref),
                     "input gradient": _rel(x.grad, xr.grad),
                     "weight gradient (my slice)": _rel(sharded.q_proj.weight.grad, q.weight.grad[mine])})
    return rows


def collectives_per_pass(config: GPTConfig, batch: int, seq: int, algorithm: str = "ring", seed: int = 0) -> list[dict]:
    """For TP and SP: the collectives a forward and a backward pass run, and the bytes this rank sent."""
    comm, rows = world(), []
    torch.manual_seed(seed)
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    for sequence_parallel in (False, True):
        sharded = parallelize(model, comm, sequence_parallel=sequence_parallel, algorithm=algorithm)
        for pass_name in ("forward", "backward"):
            mappings.calls.clear()
            comm.reset_counters()
            if pass_name == "forward":
                logits = sharded(tokens)
            else:
                logits.float().logsumexp(-1).mean().backward()
            rows.append({"rank": comm.rank, "mode": "TP + SP" if sequence_parallel else "TP", "pass": pass_name,
                         **{kind: mappings.calls.get(kind, 0) for kind in ("allreduce", "allgather", "reduce_scatter")},
                         "bytes sent": comm.bytes_sent})
    return rows


ALPHABET = "abcdefghijklmnopqrstuvwxyz .,!?'ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"  # token i -> a character


def as_text(tokens) -> str:
    return "".join(ALPHABET[t % len(ALPHABET)] for t in tokens.tolist())


def hugging_face_generation(new_tokens: int = 16, seed: int = 0) -> list[dict]:
    """Random small HF GPT-2 and Llama (no download). Rank 0 builds them, generates greedily with Hugging
    Face (the reference) and converts them to tplab's GPT (``from_hf_gpt2``, ``from_hf_llama``); the
    converted weights go to the other ranks once, as a checkpoint would be loaded (so only rank 0 pays
    for importing transformers); then all ranks generate together, sharded (TP; and SP for the prompt).
    Tokens shown as text over a 64-letter alphabet."""
    comm = world()
    p = comm.size
    vocab = 64 if 64 % p == 0 else 16 * p
    prompt = torch.randint(1, vocab, (1, 2 * p), generator=torch.Generator().manual_seed(seed + 1))
    package = None
    if comm.rank == 0:
        package = _reference_models(vocab, p, prompt, new_tokens, seed)
    wait_sleeping_for_rank_0(comm)  # (the others would spin in MPI while rank 0 works)
    package = comm.allgather_object(package)[0]  # {name: (tplab GPT, Hugging Face's tokens)}
    rows = []
    for name, (model, expected) in package.items():
        for mode, sp in [("TP", False), ("TP + SP prompt", True)]:
            got = generate(parallelize(model, comm, sequence_parallel=sp), prompt, new_tokens)
            rows.append({"rank": comm.rank, "model": name, "mode": mode, "prompt": as_text(prompt[0]),
                         "Hugging Face": as_text(expected[0, prompt.shape[1]:]),
                         "tplab, sharded": as_text(got[0, prompt.shape[1]:]), "identical": torch.equal(got, expected)})
    return rows


def _reference_models(vocab, p, prompt, new_tokens, seed) -> dict:
    import warnings

    with warnings.catch_warnings():  # (transformers' tqdm complains about widgets on an engine)
        warnings.simplefilter("ignore")
        import transformers

    from tplab.models.hf import from_hf_gpt2, from_hf_llama

    init = 0.2  # (larger than the default 0.02: varied text, not one token repeated)
    torch.manual_seed(seed)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab, n_positions=64, n_embd=16 * p, n_layer=2, n_head=4 * p, bos_token_id=0, eos_token_id=0,
        initializer_range=init))
    torch.manual_seed(seed)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=16 * p, intermediate_size=24 * p, num_hidden_layers=2, num_attention_heads=4 * p,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
        initializer_range=init))
    package = {}
    for name, hf, convert in [("GPT-2", gpt2, from_hf_gpt2), ("Llama", llama, from_hf_llama)]:
        hf = hf.double().eval()
        with torch.no_grad():
            expected = hf.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
        package[name] = (convert(hf), expected)
    return package
