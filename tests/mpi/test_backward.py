"""Backward through a tensor-parallel GPT (TP and SP): every split weight's gradient is exactly the
matching slice of the unsplit model's gradient; replicated weights get the full gradient (TP) or parts
that sum to it over the ranks (SP); and the backward pass runs the conjugate collectives, counted."""

import pytest
from mpitest import COMM, agree

torch = pytest.importorskip("torch")

from tplab.comm import world  # noqa: E402
from tplab.layers import mappings  # noqa: E402
from tplab.models import GPT, GPTConfig, parallelize  # noqa: E402

P = COMM.size
C = world(timeout=10)

CONFIGS = {
    "gpt2-like": dict(vocab_size=8 * P, n_layer=2, n_head=2 * P, n_embd=8 * P),  # learned positions, biases, MHA
    "llama-like": dict(vocab_size=8 * P, n_layer=2, n_head=2 * P, n_kv_head=1, n_embd=8 * P, ffn_size=12 * P,
                       mlp="swiglu", norm="rmsnorm", norm_dtype=torch.float32, position="rope", bias=False,
                       tie_embeddings=True),  # GQA with one KV head: replicated when p > 1
}


def summed_over_ranks(t: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(COMM.allreduce(t.detach().numpy()))


class GradientCheck:
    """Collects every mismatch between the sharded model's gradients and the unsplit one's."""

    def __init__(self):
        self.problems, self.checked = [], 0

    def compare(self, name, got, want):
        self.checked += 1
        scale = max(float(want.abs().max()), 1e-6)  # (k's bias gets ~0: softmax ignores a shift of all keys)
        err = float((got - want).abs().max()) / scale
        if err > 1e-10:
            self.problems.append(f"{name}: relative error {err:.1e}")

    def split(self, name, mine, full_grad):  # this rank's slice: exactly the matching slice
        self.compare(name, mine.grad, full_grad)

    def placed(self, name, mine, full, rows):  # (replicated) KV heads: my rows, summed over ranks = full
        canvas = torch.zeros_like(full.grad)
        canvas[rows] = mine.grad
        self.compare(name, summed_over_ranks(canvas), full.grad)

    def replicated(self, name, mine, full, sequence_parallel):  # TP: the whole gradient; SP: parts of it
        self.compare(name, summed_over_ranks(mine.grad) if sequence_parallel else mine.grad, full.grad)


def check_gradients(sharded, model, sequence_parallel) -> GradientCheck:
    check, r = GradientCheck(), COMM.rank
    first, rows = sharded.wte.first, sharded.wte.rows
    check.split("token embedding", sharded.wte.weight, model.wte.weight.grad[first:first + rows])
    if not model.config.tie_embeddings:
        check.split("LM head", sharded.lm_head.weight, model.lm_head.weight.grad.chunk(P, dim=0)[r])
    if model.wpe is not None:
        check.replicated("position embedding", sharded.wpe.weight, model.wpe.weight, sequence_parallel)
    for norm in ("norm_f",):
        check.replicated(norm, getattr(sharded, norm).weight, getattr(model, norm).weight, sequence_parallel)
    for i, (mine, full) in enumerate(zip(sharded.blocks, model.blocks)):
        a, fa = mine.attention, full.attention
        d = a.head_dim
        q_rows = slice(a.my_heads()[0] * d, (a.my_heads()[-1] + 1) * d)
        kv_rows = slice(a.my_kv_heads()[0] * d, (a.my_kv_heads()[-1] + 1) * d)
        check.split(f"{i}.q", a.q_proj.weight, fa.q_proj.weight.grad[q_rows])
        check.placed(f"{i}.k", a.k_proj.weight, fa.k_proj.weight, kv_rows)
        check.placed(f"{i}.v", a.v_proj.weight, fa.v_proj.weight, kv_rows)
        check.split(f"{i}.o", a.o_proj.weight, fa.o_proj.weight.grad[:, q_rows])
        m, fm = mine.mlp, full.mlp
        check.split(f"{i}.up", m.up.weight, fm.up.weight.grad.chunk(P, dim=0)[r])
        check.split(f"{i}.down", m.down.weight, fm.down.weight.grad.chunk(P, dim=1)[r])
        if fm.gate is not None:
            check.split(f"{i}.gate", m.gate.weight, fm.gate.weight.grad.chunk(P, dim=0)[r])
        for norm in ("norm1", "norm2"):
            check.replicated(f"{i}.{norm}", getattr(mine, norm).weight, getattr(full, norm).weight, sequence_parallel)
        if model.config.bias:
            check.split(f"{i}.q bias", a.q_proj.bias, fa.q_proj.bias.grad[q_rows])
            check.placed(f"{i}.k bias", a.k_proj.bias, fa.k_proj.bias, kv_rows)
            check.replicated(f"{i}.o bias", a.o_bias, fa.o_proj.bias, sequence_parallel)
            check.split(f"{i}.up bias", m.up.bias, fm.up.bias.grad.chunk(P)[r])
            check.replicated(f"{i}.down bias", m.down.bias, fm.down.bias, sequence_parallel)
    return check


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("shape", list(CONFIGS))
def test_gradients_of_the_shards_are_the_slices_of_the_unsplit_gradients(shape, sequence_parallel):
    torch.manual_seed(100)  # the same model on every rank
    model = GPT(GPTConfig(dtype=torch.float64, **CONFIGS[shape]))
    sharded = parallelize(model, C, sequence_parallel=sequence_parallel)
    g = torch.Generator().manual_seed(101)
    tokens = torch.randint(0, model.config.vocab_size, (2, 2 * P), generator=g)
    targets = torch.randint(0, model.config.vocab_size, (2, 2 * P), generator=g)

    def loss(m):  # every rank computes the whole loss from the whole logits
        return torch.nn.functional.cross_entropy(m(tokens).flatten(0, 1), targets.flatten())

    loss(model).backward()
    full_loss = loss(sharded)
    mappings.calls.clear()
    full_loss.backward()
    L = model.config.n_layer
    want = ({"allgather": 2 * L + 1, "reduce_scatter": 2 * L + 1} if sequence_parallel  # each op's conjugate
            else {"allreduce": 2 * L + 1})  # f before each column-parallel layer (and the LM head)
    agree(dict(mappings.calls) == want, f"backward ran {dict(mappings.calls)}, expected {want}")
    check = check_gradients(sharded, model, sequence_parallel)
    agree(not check.problems, "; ".join(check.problems[:5]))
    agree(check.checked >= 9 * L, f"only {check.checked} gradients checked")
