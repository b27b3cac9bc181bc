"""Memory per rank of a tensor-parallel GPT: parameters and activations, computed and measured.

Parameters: each rank holds 1/p of every split weight and all of every replicated one (norms, position
table, biases added after a reduce). ``parameter_bytes_computed`` adds that up from the config,
``parameter_bytes`` counts what a (sharded) module really holds (a tied table once).

Activations: what the forward pass keeps for the backward pass, per transformer layer. Korthikanti et
al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Megatron) count, in bytes,
for 16-bit activations with dropout and the attention scores stored (a heads, t ranks):

    no parallelism            s b h (34 + 5 a s / h)
    tensor parallel (TP)      s b h (10 + 24/t + 5 a s / (h t))     the 10: norms, their inputs, dropout
                                                                     masks, replicated on every rank
    TP + sequence parallel    s b h (34 + 5 a s / h) / t            everything split

``megatron_activation_bytes`` is that formula. tplab's layers keep less (no dropout; fused attention keeps
q, k, v, its output and the softmax's log-sum-exp, not the s x s scores), in the model's dtype.
``activation_bytes_computed`` counts what they keep, tensor by tensor (N = b s h elements, e bytes each,
f = the MLP's hidden size):

    region      TP                                     SP (ours)
    norms       block input + mid residual: 2 N e      2 N e / t     (+ norm statistics; RMSNorm also keeps
                                                                       its normalised x; computing in float32
                                                                       it keeps x's float32 copy instead of x)
    attention   input N e + q, k, v, output 4 N e / t  the same       (+ log-sum-exp, + RoPE's cos, sin)
    MLP         input N e + 2 (GELU) or 4 (SwiGLU)     the same
                x b s f e / t

Under SP the inputs of attention and MLP are the *all-gathered* sequence, which the projections keep:
our SP saves the norms' 2 N e (1 - 1/t), not the whole 4 N e (1 - 1/t) the paper's does. Megatron
keeps only its slice and all-gathers it again in the backward pass: memory for one more collective.
``activation_bytes_measured`` records every tensor autograd saves during a forward pass
(``torch.autograd.graph.saved_tensors_hooks``), each storage once, parameters left out, by block.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from tplab.layers.attention import heads_per_rank
from tplab.models.gpt import GPTConfig


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters ``module`` holds (on this rank), each one once (tied weights share)."""
    return sum(p.nbytes for p in module.parameters())  # .parameters() yields a shared one once


def parameter_bytes_computed(config: GPTConfig, tp: int = 1) -> dict:
    """Bytes per rank of each part of ``config``'s model split over ``tp`` ranks, and the total."""
    h, f, v, d = config.n_embd, config.ffn, config.vocab_size, config.head_dim
    heads, kv_heads = heads_per_rank(config.n_head, config.kv_heads, tp)
    bias = int(config.bias)
    attention = h * heads * d + 2 * h * kv_heads * d + heads * d * h  # q, k, v: column; o: row
    attention += bias * (heads * d + 2 * kv_heads * d + h)  # o's bias whole: added once, after the reduce
    column_parallel = 2 if config.mlp == "swiglu" else 1  # up (and gate): column-parallel; down: row-parallel
    mlp = (column_parallel + 1) * h * f // tp + bias * (column_parallel * f // tp + h)
    norm = h * (2 if config.norm == "layernorm" else 1)  # weight (and LayerNorm's bias), replicated
    elements = {
        "token embedding": v // tp * h,
        "position embedding": config.block_size * h if config.position == "learned" else 0,
        "blocks": config.n_layer * (attention + mlp + 2 * norm),
        "final norm": norm,
        "LM head": 0 if config.tie_embeddings else v // tp * h,
    }
    e = torch.finfo(config.dtype).bits // 8
    parts = {name: n * e for name, n in elements.items()}
    parts["total"] = sum(parts.values())
    return parts


def megatron_activation_bytes(s, b, h, a, t=1, sequence_parallel=False, scores_stored=True) -> float:
    """Korthikanti et al.'s activation bytes per layer per rank (16-bit, dropout, scores stored).
    ``scores_stored=False`` drops the 5as/h term: the s x s attention scores recomputed in the backward
    pass (their "selective recomputation"; fused attention kernels never store them)."""
    scores = 5 * a * s / h if scores_stored else 0.0
    if sequence_parallel:
        return s * b * h * (34 + scores) / t
    return s * b * h * (10 + 24 / t + scores / t)


def activation_bytes_computed(config: GPTConfig, batch: int, seq: int, tp: int = 1,
                              sequence_parallel: bool = False) -> dict:
    """Bytes tplab's blocks keep for backward, per block per rank, by region (see the module docstring)."""
    e = torch.finfo(config.dtype).bits // 8
    c = torch.finfo(config.norm_dtype).bits // 8 if config.norm_dtype is not None else e
    n = batch * seq * config.n_embd  # N: one activation of the whole sequence
    tokens = batch * seq
    shard = tp if sequence_parallel else 1  # the norms see s/t tokens under SP
    if config.norm == "layernorm":
        norm = (n * e + 2 * tokens * e) / shard  # input, mean and 1/std
    else:
        norm = (n * c + tokens * c + n * e) / shard  # input (its float32 copy if c != e), 1/rms, x/rms
    heads, _ = heads_per_rank(config.n_head, config.kv_heads, tp)
    local = tokens * heads * config.head_dim  # q (and k, v repeated to the query heads, and the output)
    attention = n * e + 4 * local * e + tokens * heads * max(e, 4)  # + the log-sum-exp
    if config.position == "rope":
        attention += 2 * seq * config.head_dim * e  # cos, sin
    mlp = n * e + (4 if config.mlp == "swiglu" else 2) * tokens * config.ffn // tp * e
    parts = {"norms": 2 * norm, "attention": attention, "MLP": mlp}
    parts["total"] = sum(parts.values())
    return parts


def activation_bytes_measured(model, tokens) -> dict:
    """Run ``model(tokens)`` with gradients and add up what autograd saves, by block and by region
    (norms / attention / MLP; each storage once, where first saved; parameters left out). Returns
    {"blocks": [{region: bytes, "total": bytes}, ...], "outside blocks": bytes, "total": bytes}."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set = set()
    where = ["outside blocks"]  # the region being run now
    counts = defaultdict(int)

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            counts[where[-1]] += storage.nbytes()
        return t

    def enter(label):
        return lambda module, args: where.append(label)

    def leave(module, args, out):
        where.pop()

    handles = []
    for i, block in enumerate(model.blocks):
        for label, module in [((i, "norms"), block), ((i, "attention"), block.attention), ((i, "MLP"), block.mlp)]:
            handles += [module.register_forward_pre_hook(enter(label)), module.register_forward_hook(leave)]
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    blocks = []
    for i in range(len(model.blocks)):
        parts = {region: counts[(i, region)] for region in ("norms", "attention", "MLP")}
        parts["total"] = sum(parts.values())
        blocks.append(parts)
    return {"blocks": blocks, "outside blocks": counts["outside blocks"],
            "total": sum(b["total"] for b in blocks) + counts["outside blocks"]}


def memory_vs_tp(config: GPTConfig, batch: int, seq: int, comm=None, degrees=None, seed: int = 0) -> list[dict]:
    """Parameters and activations per rank, computed and measured, for each TP degree t (groups of t
    ranks, all at once) with and without sequence parallelism. Collective (``comm``: default the world);
    each rank returns its own group's rows (every group holds the same shapes)."""
    from tplab.comm import world
    from tplab.models.gpt import GPT
    from tplab.models.parallel import parallelize
    from tplab.models.speed import tp_degrees

    comm = comm or world()
    rows = []
    tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    for t in degrees or tp_degrees(config, comm.size):
        group = comm.split(color=comm.rank // t, key=comm.rank)
        torch.manual_seed(seed)
        model = GPT(config)
        for sequence_parallel in (False, True):
            if sequence_parallel and seq % t:
                continue
            sharded = parallelize(model, group, sequence_parallel=sequence_parallel)
            measured = activation_bytes_measured(sharded, tokens)["blocks"]
            computed = activation_bytes_computed(config, batch, seq, t, sequence_parallel)
            rows.append({"tp": t, "mode": "TP + SP" if sequence_parallel else "TP",
                         "parameters measured": parameter_bytes(sharded),
                         "parameters computed": parameter_bytes_computed(config, t)["total"],
                         **{f"{region} measured": sum(b[region] for b in measured) / len(measured)
                            for region in ("norms", "attention", "MLP", "total")},
                         **{f"{region} computed": computed[region]
                            for region in ("norms", "attention", "MLP", "total")}})
    return rows
