"""tplab.balance on real ranks: every scheduler runs every request exactly once and returns the serial
model's logits; the dynamic queue terminates with every item handed out once (also with one rank, no
items, or fewer items than groups); packed batches on a TP model equal separate runs; the GPipe
pipeline returns the unpipelined logits."""

import pytest
from mpitest import COMM, agree

torch = pytest.importorskip("torch")

from tplab.balance import make_requests, requests_from_lengths, run_requests  # noqa: E402
from tplab.balance.groups import data_parallel_groups  # noqa: E402
from tplab.balance.packing import forward, make_batch  # noqa: E402
from tplab.balance.pipeline import micro_batches, run_pipeline  # noqa: E402
from tplab.balance.runner import STRATEGIES  # noqa: E402
from tplab.balance.timeline import Timeline  # noqa: E402
from tplab.balance.workqueue import WorkQueue  # noqa: E402
from tplab.comm import world  # noqa: E402
from tplab.models import GPT, GPTConfig, parallelize  # noqa: E402

P = COMM.size
C = world()
TP_SIZES = [t for t in (1, 2) if P % t == 0]
VOCAB = 16


def small_gpt(n_layer=2, seed=5):
    torch.manual_seed(seed)  # the same model on every rank
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=64, n_layer=n_layer, n_head=4, n_embd=16, dtype=torch.float64))


MODEL = small_gpt()
REQUESTS = make_requests("lognormal", 9, seed=2, min_length=1, max_length=24, median=6, sigma=1.0)


def serial(model, request):
    with torch.no_grad():
        return model(request.tokens(VOCAB)[None])[0]


def check_result(result, model, requests):
    """Every request exactly once over all groups, and this rank's outputs equal the serial run."""
    work = result.intervals[(result.intervals["what"] == "forward") & (result.intervals["tp_rank"] == 0)]
    ran = sorted(i for k in work["item"] for i in result.items[k])
    agree(ran == sorted(r.id for r in requests), f"requests run: {ran}")
    by_id = {r.id: r for r in requests}
    errors = [float((out - serial(model, by_id[i])).abs().max()) for i, out in result.outputs.items()]
    agree(max(errors, default=0.0) < 1e-10, f"largest difference from the serial run {max(errors, default=0.0):.2e}")
    my_group = COMM.rank // result.tp
    expected = sorted(i for k in work[work["group"] == my_group]["item"] for i in result.items[k])
    agree(sorted(result.outputs) == expected, f"outputs for {sorted(result.outputs)}, group ran {expected}")


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_runs_each_request_once_with_the_serial_result(strategy, tp):
    result = run_requests(MODEL, REQUESTS, C, strategy=strategy, tp=tp, keep_outputs=True, timeout=20)
    check_result(result, MODEL, REQUESTS)
    if result.assignment is not None:  # a static plan is the same on every rank
        agree(COMM.allgather(result.assignment) == [result.assignment] * P, "ranks planned differently")


@pytest.mark.parametrize("strategy", ["lpt", "dynamic"])
@pytest.mark.parametrize("batching", ["pad", "pack"])
def test_padded_and_packed_items_give_the_serial_result(batching, strategy):
    tp = TP_SIZES[-1]
    result = run_requests(MODEL, REQUESTS, C, strategy=strategy, tp=tp, batching=batching, max_tokens=24,
                          sort_batches=batching == "pad", keep_outputs=True, timeout=20)
    check_result(result, MODEL, REQUESTS)
    work = result.intervals[result.intervals["what"] == "forward"].drop_duplicates("item")
    agree(len(result.items) < len(REQUESTS), "batching made no batches of several requests")
    if batching == "pack":
        agree((work["slots"] == work["tokens"]).all(), "packing computed padding")


@pytest.mark.parametrize("lookahead, chunking", [(0, "single"), (1, "single"), (1, "guided")])
@pytest.mark.parametrize("n_items", [0, 1, max(P - 1, 1), 3 * P + 1])
@pytest.mark.parametrize("tp", TP_SIZES)
def test_dynamic_queue_hands_out_every_item_once_and_terminates(n_items, tp, lookahead, chunking):
    groups = data_parallel_groups(C, tp, timeout=20)
    timeline = Timeline(COMM.rank)
    order = list(range(n_items))[::-1]  # any order: here backwards
    costs = [1.0 + (i % 3) for i in range(n_items)]
    got = list(WorkQueue(groups, order, timeline, lookahead, costs, chunking))
    everyone = COMM.allgather((groups.index, groups.is_leader, got))
    per_group = {g: items for g, leader, items in everyone if leader}
    handed = sorted(i for items in per_group.values() for i in items)
    agree(handed == list(range(n_items)), f"items handed out: {handed}")
    agree(all(items == per_group[g] for g, _, items in everyone), "a group's ranks got different items")
    pulls = [row["count"] for row in timeline.rows]
    agree(sum(pulls) == len(got) and pulls[-1] == 0, f"pulls {pulls} for {len(got)} items")
    if chunking == "single":
        agree(len(pulls) == len(got) + 1, "one pull per item plus the final DONE")


def test_packed_batch_on_a_tensor_parallel_model_equals_separate_runs():
    torch.manual_seed(9)
    model = GPT(GPTConfig(vocab_size=8 * P, block_size=64, n_layer=2, n_head=2 * P, n_kv_head=P if P > 1 else None,
                          n_embd=8 * P, dtype=torch.float64))
    sharded = parallelize(model, C)
    generator = torch.Generator().manual_seed(10)
    sequences = [torch.randint(0, 8 * P, (s,), generator=generator) for s in (5, 1, 11, 4)]
    batch = make_batch(sequences, "pack")
    packed = batch.split(forward(sharded, batch))
    with torch.no_grad():
        errors = [float((got - model(t[None])[0]).abs().max()) for got, t in zip(packed, sequences)]
    agree(max(errors) < 1e-10, f"packed TP logits differ from separate runs by {max(errors):.2e}")


PIPELINE_LAYOUTS = [(P, 1)] + ([(P // 2, 2)] if P % 2 == 0 else [])  # (stages, tp)


@pytest.mark.parametrize("mode", ["pack", "pad"])
@pytest.mark.parametrize("stages, tp", PIPELINE_LAYOUTS)
def test_pipeline_output_equals_the_unpipelined_model(stages, tp, mode):
    model = small_gpt(n_layer=max(P, 2), seed=6)
    lengths = [r.length for r in REQUESTS]
    for m, how in [(1, "count"), (3, "balanced")]:
        ids = micro_batches(lengths, m, how)
        result = run_pipeline(model, REQUESTS, ids, C, stages=stages, tp=tp, mode=mode, keep_outputs=True, timeout=20)
        last = COMM.rank // tp == stages - 1
        expected = sorted(r.id for r in REQUESTS) if last else []
        agree(sorted(result.outputs) == expected, f"outputs for {sorted(result.outputs)}")
        errors = [float((out - serial(model, REQUESTS[i])).abs().max()) for i, out in result.outputs.items()]
        agree(max(errors, default=0.0) < 1e-10, f"pipelined logits differ by {max(errors, default=0.0):.2e}")
        stage_rows = result.intervals[result.intervals["what"] == "stage"]
        agree(len(stage_rows) == P * m, f"{len(stage_rows)} stage spans, expected {P * m}")
        agree(0 <= result.bubble < 1, f"bubble {result.bubble}")


def test_bad_layouts_raise_the_same_error_on_every_rank():
    with pytest.raises(ValueError, match="tp must divide"):
        run_requests(MODEL, REQUESTS, C, tp=P + 1)
    with pytest.raises(ValueError, match="strategy"):
        run_requests(MODEL, REQUESTS, C, strategy="fastest")
    with pytest.raises(ValueError, match="ranks, but there are"):
        run_pipeline(MODEL, REQUESTS, [[0]], C, stages=P + 1, tp=1)
    if P > 1:
        with pytest.raises(ValueError, match="1 <= stages <= n_layer"):
            run_pipeline(small_gpt(n_layer=1), REQUESTS, [[0]], C, stages=P, tp=1)
    with pytest.raises(ValueError, match="unique"):
        run_requests(MODEL, requests_from_lengths([2, 3]) * 2, C)
    with pytest.raises(ValueError, match="longer than the model's block_size"):
        run_requests(MODEL, requests_from_lengths([2, 65]), C, strategy="dynamic")
    with pytest.raises(ValueError, match="each at most once"):
        run_pipeline(small_gpt(n_layer=max(P, 2)), REQUESTS, [[0, 1], [1]], C, stages=P, tp=1)
    agree(True)
