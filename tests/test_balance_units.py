"""tplab.balance without MPI: workloads, costs, schedulers (LPT against the brute-force optimum), packed
and padded batches against separate runs, metrics, the GPipe formulas, the recorder and its Gantt chart."""

from dataclasses import astuple

import matplotlib
import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tplab.balance import cost as costs_module
from tplab.balance import packing, pipeline, schedulers
from tplab.balance.gantt import plot_gantt
from tplab.balance.metrics import per_rank, summarize
from tplab.balance.timeline import Timeline
from tplab.balance.workloads import DISTRIBUTIONS, make_lengths, make_requests, requests_from_lengths
from tplab.models import GPT, GPTConfig

matplotlib.use("Agg")

# ---- workloads -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_generators_are_seeded_and_within_bounds(distribution):
    a = make_lengths(distribution, 500, seed=3, min_length=4, max_length=300)
    assert np.array_equal(a, make_lengths(distribution, 500, seed=3, min_length=4, max_length=300))
    assert not np.array_equal(a, make_lengths(distribution, 500, seed=4, min_length=4, max_length=300))
    assert a.dtype == np.int64 and a.min() >= 4 and a.max() <= 300
    requests = make_requests(distribution, 20, seed=3, max_length=64)
    assert [r.id for r in requests] == list(range(20))
    assert torch.equal(requests[5].tokens(50), make_requests(distribution, 20, seed=3, max_length=64)[5].tokens(50))
    assert requests[5].tokens(50).shape == (requests[5].length,) and int(requests[5].tokens(50).max()) < 50


def test_length_distributions_have_their_shapes():
    lognormal = make_lengths("lognormal", 2000, seed=0, max_length=4096, median=64, sigma=1.0)
    assert 55 < np.median(lognormal) < 75 and lognormal.max() > 10 * np.median(lognormal)  # the long tail
    bimodal = make_lengths("bimodal", 2000, seed=0, max_length=1000, long_fraction=0.25)
    long = bimodal > 400
    assert 0.2 < long.mean() < 0.3 and not ((bimodal > 200) & (bimodal < 550)).any()  # nothing in between
    uniform = make_lengths("uniform", 2000, seed=0, min_length=10, max_length=20)
    assert set(uniform) == set(range(10, 21))
    assert make_lengths("lognormal", 0).shape == (0,)
    with pytest.raises(ValueError, match="distribution"):
        make_lengths("zipf", 3)
    with pytest.raises(ValueError, match="min_length"):
        make_lengths("uniform", 3, min_length=0)


# ---- cost ----------------------------------------------------------------------------------------------


def test_sequence_cost_is_linear_plus_quadratic():
    h, layers = 64, 3
    assert costs_module.sequence_flops(100, h, layers) == layers * (24 * 100 * h**2 + 4 * 100**2 * h)
    assert costs_module.sequence_flops(100, h, layers, vocab_size=10, tp=2) == (
        layers * (24 * 100 * h**2 + 4 * 100**2 * h) + 2 * 100 * h * 10) / 2
    model = costs_module.SequenceCost(overhead=1.0, per_token=0.5, per_token_squared=0.01)
    s = np.array([1, 10, 100, 1000])
    fitted = costs_module.SequenceCost.fit(s, model.seconds(s))
    assert astuple(fitted) == pytest.approx(astuple(model))
    noisy_negative = costs_module.SequenceCost.fit([1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0])  # a line: no s², no a
    assert noisy_negative.per_token_squared == pytest.approx(0) and noisy_negative.per_token == pytest.approx(1)
    assert model.batch_seconds([10, 30], "single") == pytest.approx(model(10) + model(30))
    assert model.batch_seconds([10, 30], "pad") == pytest.approx(1 + 2 * (0.5 * 30 + 0.01 * 900))
    assert model.batch_seconds([10, 30], "pack") == pytest.approx(1 + 0.5 * 40 + 0.01 * 1600)
    assert model.batch_seconds([10, 30], "pack", varlen=True) == pytest.approx(1 + 0.5 * 40 + 0.01 * 1000)
    flops = costs_module.SequenceCost.from_flops(GPTConfig(n_embd=32, n_layer=2, vocab_size=64), flops_per_second=1.0)
    assert flops(50) == pytest.approx(costs_module.sequence_flops(50, 32, 2, vocab_size=64))
    with pytest.raises(ValueError, match="3 or more"):
        costs_module.SequenceCost.fit([1, 1, 2], [1, 1, 2])


# ---- schedulers ----------------------------------------------------------------------------------------

costs_lists = st.lists(st.integers(0, 100).map(float), min_size=0, max_size=8)


def assert_partition(assignment, n, m):
    assert len(assignment) == m
    assert sorted(i for items in assignment for i in items) == list(range(n))


@settings(max_examples=150, deadline=None)
@given(costs=costs_lists, m=st.integers(1, 3))
def test_lpt_is_within_grahams_bound_of_the_optimum(costs, m):
    optimum = schedulers.optimal_makespan(costs, m)
    for name, schedule in schedulers.STATIC_SCHEDULERS.items():
        assignment = schedule(costs, m)
        assert_partition(assignment, len(costs), m)
        assert schedulers.makespan(assignment, costs) >= optimum - 1e-9, name
    lpt = schedulers.makespan(schedulers.lpt(costs, m), costs)
    assert lpt <= schedulers.graham_bound(m) * optimum + 1e-9
    greedy = schedulers.makespan(schedulers.list_schedule(costs, m), costs)  # any order: within 2 - 1/m
    assert greedy <= (2 - 1 / m) * optimum + 1e-9


def test_lpt_bound_is_tight_on_grahams_example():
    m = 3  # 2m+1 jobs: 2m-1, 2m-1, 2m-2, 2m-2, ..., m, m, m -> LPT = 4m-1, optimum = 3m
    costs = [5, 5, 4, 4, 3, 3, 3]
    assert schedulers.makespan(schedulers.lpt(costs, m), costs) == 11
    assert schedulers.optimal_makespan(costs, m) == 9
    assert 11 / 9 == pytest.approx(schedulers.graham_bound(m))


def test_static_schedules_on_a_long_tail():
    costs = [1, 1, 1, 1, 1, 1, 1, 9]  # one long request arriving last
    assert schedulers.round_robin(costs, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert schedulers.makespan(schedulers.round_robin(costs, 2), costs) == 12
    assert schedulers.sorted_by_length(costs, 2)[0][0] == 7
    assert schedulers.makespan(schedulers.lpt(costs, 2), costs) == 9  # the long one alone: optimal
    assert schedulers.imbalance(schedulers.lpt(costs, 2), costs) == pytest.approx(9 / 8)
    assert schedulers.round_robin([], 3) == [[], [], []]
    with pytest.raises(ValueError, match="positive int"):
        schedulers.lpt(costs, 0)
    with pytest.raises(ValueError, match="non-negative"):
        schedulers.lpt([1, float("nan")], 2)


@settings(max_examples=100, deadline=None)
@given(costs=st.lists(st.integers(1, 50).map(float), min_size=1, max_size=30), groups=st.integers(1, 6))
def test_guided_chunks_cover_the_list_and_shrink_to_single_items(costs, groups):
    from tplab.balance.workqueue import guided_chunks

    costs = sorted(costs, reverse=True)  # as the queue hands them out: longest first
    chunks = guided_chunks(costs, groups)
    assert [i for chunk in chunks for i in chunk] == list(range(len(costs)))
    for chunk in chunks:
        remaining = sum(costs[chunk.start:])
        assert len(chunk) == 1 or sum(costs[i] for i in chunk) <= remaining / (2 * groups)
    assert len(chunks[-1]) == 1 or sum(costs[i] for i in chunks[-1]) <= sum(costs[chunks[-1].start:]) / 2


# ---- padding and packing -------------------------------------------------------------------------------


def test_block_diagonal_causal_mask_and_positions():
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]])
    assert torch.equal(packing.block_diagonal_causal_mask([3, 2]), expected.bool())
    assert packing.packed_positions([3, 2]).tolist() == [0, 1, 2, 0, 1]


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    learned = GPT(GPTConfig(vocab_size=32, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=16,
                            dtype=torch.float64))
    return {"learned": learned}


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=5), mode=st.sampled_from(["pad", "pack"]))
def test_packed_and_padded_batches_equal_separate_runs(models, lengths, mode):
    model = models["learned"]
    generator = torch.Generator().manual_seed(sum(lengths))
    sequences = [torch.randint(0, 32, (s,), generator=generator) for s in lengths]
    batch = packing.make_batch(sequences, mode)
    together = batch.split(packing.forward(model, batch))
    with torch.no_grad():
        for tokens, got in zip(sequences, together):
            alone = model(tokens[None])[0]
            assert got.shape == alone.shape
            torch.testing.assert_close(got, alone, rtol=1e-12, atol=1e-12)
    assert batch.real_tokens == sum(lengths)
    assert batch.slots == (len(lengths) * max(lengths) if mode == "pad" else sum(lengths))
    assert batch.padding_waste == pytest.approx(1 - sum(lengths) / batch.slots)


def test_packing_a_rotary_model_matches_to_its_angle_precision():
    torch.manual_seed(1)
    try:
        model = GPT(GPTConfig(vocab_size=32, block_size=64, n_layer=2, n_head=4, n_embd=16, position="rope",
                              dtype=torch.float64))
    except TypeError:
        pytest.skip("this GPT has no rotary positions")
    sequences = [torch.randint(0, 32, (s,)) for s in (7, 3, 12)]
    batch = packing.make_batch(sequences, "pack")
    with torch.no_grad():
        for tokens, got in zip(sequences, batch.split(packing.forward(model, batch))):
            # positions run on across the pack; a rotary score depends only on distances, so only the
            # rounding of the rotation angles differs
            torch.testing.assert_close(got, model(tokens[None])[0], rtol=1e-6, atol=1e-6)


def test_batching_helpers_and_errors(models):
    lengths = [5, 1, 9, 3, 7]
    for kw in [{"max_tokens": 10}, {"batch_size": 2}, {"max_tokens": 12, "sort": True}]:
        batches = packing.make_batches(lengths, **kw)
        assert sorted(i for b in batches for i in b) == list(range(5))
        if "batch_size" in kw:
            assert max(map(len, batches)) <= 2
        else:
            assert all(sum(lengths[i] for i in b) <= kw["max_tokens"] or len(b) == 1 for b in batches)
    assert packing.make_batches(lengths, max_tokens=12, sort=True)[0] == [2]  # 9, then 7+5 would exceed 12
    with pytest.raises(ValueError, match="non-empty"):
        packing.make_batch([torch.zeros(0, dtype=torch.long)], "pack")
    with pytest.raises(ValueError, match="one sequence"):
        packing.make_batch([torch.zeros(2, dtype=torch.long)] * 2, "single")
    with pytest.raises(ValueError, match="block_size"):
        packing.forward(models["learned"], packing.make_batch([torch.zeros(65, dtype=torch.long)], "single"))


# ---- metrics, recorder, Gantt --------------------------------------------------------------------------


def test_metrics_from_intervals():
    intervals = pd.DataFrame([
        {"rank": 0, "what": "forward", "item": 0, "tokens": 10, "slots": 10, "start": 0.0, "end": 4.0},
        {"rank": 0, "what": "pull", "item": 1, "start": 4.0, "end": 4.5},
        {"rank": 1, "what": "forward", "item": 1, "tokens": 6, "slots": 8, "start": 0.0, "end": 1.0},
        {"rank": 1, "what": "forward", "item": 2, "tokens": 4, "slots": 4, "start": 1.0, "end": 2.0},
    ])
    intervals["duration"] = intervals["end"] - intervals["start"]
    table = per_rank(intervals, ranks=3)
    assert table["busy_s"].tolist() == [4.0, 2.0, 0.0] and table["idle_s"].tolist() == [0.0, 2.0, 4.0]
    assert table["queue_wait_s"].tolist() == [0.5, 0.0, 0.0]
    m = summarize(intervals, ranks=3)
    assert m["makespan_s"] == 4.0 and m["imbalance"] == pytest.approx(2.0) and m["tokens"] == 20
    assert m["tokens_per_s"] == 5.0 and m["padding_waste"] == pytest.approx(1 - 20 / 22)
    assert m["idle_fraction"] == pytest.approx(6 / 12)


def test_timeline_records_spans_and_plots():
    timeline = Timeline(rank=3, group=1)
    with timeline.span("forward", item=7) as fields:
        fields["tokens"] = 12
    df = timeline.to_dataframe()
    assert df.loc[0, ["rank", "group", "what", "item", "tokens"]].tolist() == [3, 1, "forward", 7, 12]
    assert 0 <= df.loc[0, "start"] <= df.loc[0, "end"] and df.loc[0, "duration"] >= 0
    fig = plot_gantt(pipeline.ideal_schedule([1, 2, 1], 3), label="item", title="GPipe")
    assert fig.axes[0].get_title() == "GPipe" and len(fig.axes[0].patches) == 9


# ---- pipeline formulas ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.integers(1, 9).map(float), min_size=1, max_size=8), p=st.integers(1, 5))
def test_ideal_gpipe_schedule_matches_the_formulas(costs, p):
    schedule = pipeline.ideal_schedule(costs, p)
    assert schedule["end"].max() == pytest.approx(pipeline.gpipe_makespan(costs, p))
    if len(set(costs)) == 1:
        assert pipeline.bubble_fraction(schedule, p) == pytest.approx(pipeline.gpipe_bubble(p, len(costs)))


def test_stage_layers_and_micro_batches():
    assert pipeline.stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert pipeline.stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="stages"):
        pipeline.stage_layers(2, 3)
    lengths = [100, 1, 1, 1, 1, 1, 1, 90]
    count = pipeline.micro_batches(lengths, 2, "count")
    balanced = pipeline.micro_batches(lengths, 2, "balanced")
    for split in (count, balanced):
        assert sorted(i for mb in split for i in mb) == list(range(8))
    assert max(sum(lengths[i] for i in mb) for mb in balanced) < max(sum(lengths[i] for i in mb) for mb in count)
    with pytest.raises(ValueError, match="micro-batches"):
        pipeline.micro_batches(lengths, 9)
    assert pipeline.gpipe_bubble(4, 1) == pytest.approx(0.75) and pipeline.gpipe_bubble(1, 5) == 0
    assert requests_from_lengths([3, 4])[1].length == 4
