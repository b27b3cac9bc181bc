"""tplab.moe on one process: the router's two orders, the dispatch plan and capacity against a loop over
tokens, the layer against a token-by-token sum, the imbalance numbers, a short training run."""

import pytest
import torch

from tplab.moe import MoE, Router
from tplab.moe import dispatch, imbalance
from tplab.moe.train import train_router


def test_both_orders_choose_the_same_experts_and_weights_sum_to_one():
    torch.manual_seed(0)
    a = Router(6, 5, 2, order="softmax_then_topk", renormalize=True, dtype=torch.float64)
    b = Router(6, 5, 2, order="topk_then_softmax", dtype=torch.float64)
    b.load_state_dict(a.state_dict())
    x = torch.randn(9, 6, dtype=torch.float64)
    ra, rb = a(x), b(x)
    assert torch.equal(ra.experts, rb.experts)
    assert torch.allclose(ra.weights, rb.weights, atol=1e-15)
    assert torch.allclose(rb.weights.sum(-1), torch.ones(9, dtype=torch.float64))
    raw = Router(6, 5, 2, renormalize=False, dtype=torch.float64)
    raw.load_state_dict(a.state_dict())
    assert (raw(x).weights.sum(-1) < 1).all()  # the chosen experts' share of the whole softmax


def test_dispatch_keeps_token_order_inside_each_expert_and_drops_the_latecomers():
    experts = torch.tensor([[0, 1], [1, 0], [1, 2], [1, 0]])  # expert 1 is chosen 4 times
    plan = dispatch.plan(experts, 3, limit=2)
    assert plan.kept.tolist() == [2, 2, 1] and plan.dropped.tolist() == [1, 2, 0]
    assert plan.token.tolist() == [0, 1, 0, 1, 2]  # expert 0: tokens 0, 1; expert 1: tokens 0, 1; expert 2: 2
    ahead = torch.tensor([0, 1, 2])  # one of expert 1's and two of expert 2's slots are taken by earlier ranks
    assert dispatch.plan(experts, 3, limit=2, ahead=ahead).kept.tolist() == [2, 1, 0]
    assert dispatch.capacity(1.25, 10, 2, 4) == 7 and dispatch.capacity(None, 10, 2, 4) is None
    with pytest.raises(ValueError, match="positive"):
        dispatch.capacity(0, 10, 2, 4)


@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_the_layer_is_the_gated_sum_of_its_experts_token_by_token(capacity_factor):
    torch.manual_seed(1)
    moe = MoE(6, 4, 4, 2, capacity_factor=capacity_factor, shared_ffn=3, dtype=torch.float64)
    x = torch.randn(11, 6, dtype=torch.float64)
    r = moe.router(x)
    limit = dispatch.capacity(capacity_factor, 11, 2, 4)
    used = [0] * 4
    want = moe.shared(x).clone()
    for t in range(11):  # one token after another: the first to come get the slots
        for slot in range(2):
            e = int(r.experts[t, slot])
            if limit is None or used[e] < limit:
                used[e] += 1
                want[t] += r.weights[t, slot] * moe.experts[e](x[t:t + 1])[0]
    assert torch.allclose(moe(x), want, rtol=1e-12, atol=1e-12)
    assert moe.last["kept"].tolist() == used


def test_imbalance_numbers():
    assert imbalance.max_over_mean([2, 2, 2]) == 1.0 and imbalance.max_over_mean([6, 0, 0]) == 3.0
    assert imbalance.per_rank([1, 2, 3, 4, 5], 2).tolist() == [6, 9]  # experts 0-2 on rank 0, 3-4 on rank 1
    s = imbalance.summary([4, 0, 0, 0], 2, seconds_per_token=0.5)
    assert s["makespan"] == 2.0 and s["balanced"] == 1.0 and s["rank_imbalance"] == 2.0


def test_a_short_training_run_records_the_balance():
    ids = torch.randint(0, 10, (3000,), generator=torch.Generator().manual_seed(0))
    model, history = train_router(ids, steps=4, batch=2, block=16, aux_coef=0.01, noise=True, every=2)
    assert [h["step"] for h in history] == [0, 2, 4] and all(h["imbalance"] >= 1 for h in history)
    assert sum(history[0]["tokens_per_expert"]) == 8 * 16 * 2 and not model.training
    rows = imbalance.capacity_sweep(model.moe, model.hidden_states(ids[:64].reshape(4, 16)), [None, 0.5], 2)
    assert rows[0]["dropped_fraction"] == 0 and rows[1]["dropped_fraction"] >= 0.5


def test_dispatch_exercise_checker():
    from tplab.lab.exercises import check_dispatch_order, passed, solutions

    assert passed(check_dispatch_order(solutions.dispatch_order, progress=False))

    def unstable(experts, e):  # grouped by expert, but not in token order inside
        flat = experts.reshape(-1)
        order = torch.argsort(flat * 1000 - torch.arange(flat.numel()))
        return order, torch.bincount(flat, minlength=e)

    def counts_without_idle_experts(experts, e):
        flat = experts.reshape(-1)
        return torch.sort(flat, stable=True).indices, torch.bincount(flat)

    report = check_dispatch_order(unstable, progress=False)
    assert not passed(report) and any("token order" in r["problem"] for r in report)
    report = check_dispatch_order(counts_without_idle_experts, progress=False)
    assert any("all 4" in r["problem"] for r in report)


def test_dispatch_checker_names_a_float_order_and_expert_ids_instead_of_crashing():
    from tplab.lab.exercises import check_dispatch_order

    def from_a_list(experts, e):  # an empty Python list becomes a float tensor
        flat = experts.reshape(-1)
        return torch.tensor(torch.sort(flat, stable=True).indices.tolist()), torch.bincount(flat, minlength=e)

    def expert_ids(experts, e):
        flat = experts.reshape(-1)
        return torch.sort(flat).values, torch.bincount(flat, minlength=e)

    report = check_dispatch_order(from_a_list, progress=False)
    assert any("integer positions" in r["problem"] for r in report if r["problem"])
    assert not any("raised" in (r["problem"] or "") for r in report)
    report = check_dispatch_order(expert_ids, progress=False)
    assert any("experts' ids" in r["problem"] for r in report if r["problem"])
