"""The notebooks' calculators are plain functions: they agree with the formulas they wrap."""

import pytest

torch = pytest.importorskip("torch")

from tplab.cost import critical_path  # noqa: E402
from tplab.lab.calculators import LINKS, collective_time, layer_ratio, llama_memory_gib, memory_per_rank, show  # noqa: E402
from tplab.models.gpt import GPTConfig  # noqa: E402


def test_memory_per_rank_splits_what_tp_splits():
    config = GPTConfig(vocab_size=512, block_size=256, n_layer=2, n_head=8, n_embd=64, dtype=torch.bfloat16)
    one, four = memory_per_rank(config, 2, 128, 1), memory_per_rank(config, 2, 128, 4)
    assert four["kv_cache_bytes"] * 4 == one["kv_cache_bytes"] == 2 * 2 * 2 * 128 * 64 * 2
    assert four["parameters_bytes"] < one["parameters_bytes"] / 2  # most weights are split
    sp = memory_per_rank(config, 2, 128, 4, sequence_parallel=True)
    assert sp["activations_bytes"] < four["activations_bytes"] and sp["parameters_bytes"] == four["parameters_bytes"]
    with pytest.raises(ValueError, match="do not split"):
        memory_per_rank(config, 2, 128, 3)


def test_collective_time_is_the_alpha_beta_gamma_model():
    link = LINKS["NVLink (H100, NCCL)"]
    path = critical_path("allreduce", "ring", 4, 1 << 20)
    assert collective_time("ring", 4, 1 << 20) == pytest.approx(path.time(link))
    assert collective_time("ring", 8, 1 << 20) > collective_time("ring", 2, 1 << 20)


def test_layer_ratio_and_the_static_table():
    small, large = layer_ratio(4096, 128, 1, 8), layer_ratio(4096, 4096, 1, 8)
    assert small["ratio"] > large["ratio"]  # longer sequences: more compute per byte sent
    table = show(layer_ratio, hidden=(4096, (1024, 16384, 1024)), seq=(2048, (128, 32768, 128)), batch=(1, (1, 64, 1)),
                 tp=(8, [1, 2, 4, 8]))
    assert list(table["tp"]) == [8] and table["ratio"].iloc[0] == pytest.approx(layer_ratio(4096, 2048, 1, 8)["ratio"])


def test_a_llama_in_gib():
    eight, one = llama_memory_gib(tp=8), llama_memory_gib(tp=1)
    assert 12 < llama_memory_gib(kv_heads=32, tp=1)["parameters_GiB"] < 13  # Llama-2 7B's shape in bf16: 12.6 GiB
    assert eight["kv_cache_GiB"] == one["kv_cache_GiB"] / 8
