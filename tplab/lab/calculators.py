"""Three calculators for the notebooks, each a plain (tested) function first and sliders second.

    memory_per_rank(config, batch, seq, tp, sequence_parallel)   parameters, activations kept for the backward
                                                                 pass, KV cache: bytes per rank
    llama_memory_gib(hidden, layers, heads, ..., tp)             the same for a Llama-shaped model, in GiB
    collective_time(algorithm, p, nbytes, link)                   α-β-γ seconds of one all-reduce (tplab.cost)
    layer_ratio(hidden, seq, batch, tp, link, peak_flops, ...)    a TP layer's communication / computation
    show(calculator, **sliders)                                   a table for the default values and, in
                                                                  JupyterLab with ipywidgets, sliders

A notebook executed without a browser (``make demo``, CI) gets the table only: the widgets need a live
frontend, the numbers do not. LINKS holds a few typical links (α, β, γ) to choose from.
"""

from __future__ import annotations

import pandas as pd

from tplab.cost import Machine, predict
from tplab.cost.tensor_parallel import layer_model
from tplab.models.gpt import GPTConfig
from tplab.models.memory import activation_bytes_computed, parameter_bytes_computed

# α (s per message), β (s per byte), γ (s per byte reduced): orders of magnitude, not measurements of yours
LINKS = {
    "shared memory (one machine, MPI)": Machine(alpha=1e-6, beta=1 / 10e9, gamma=1 / 20e9, name="shared memory"),
    "NVLink (H100, NCCL)": Machine(alpha=5e-6, beta=1 / 350e9, gamma=1 / 1500e9, name="NVLink"),
    "PCIe 4 x16 (through the host)": Machine(alpha=10e-6, beta=1 / 25e9, gamma=1 / 1500e9, name="PCIe"),
    "100 Gb/s network": Machine(alpha=5e-6, beta=1 / 12.5e9, gamma=1 / 20e9, name="100 Gb/s"),
}


def memory_per_rank(config: GPTConfig, batch: int, seq: int, tp: int, sequence_parallel: bool = False) -> dict:
    """Bytes one rank holds: its share of the parameters, the activations its blocks keep for the backward
    pass, and the KV cache of ``batch`` sequences of ``seq`` tokens (its share of the K/V heads)."""
    if config.n_head % tp or config.kv_heads % tp and tp % config.kv_heads:
        raise ValueError(f"{config.n_head} heads ({config.kv_heads} K/V heads) do not split over {tp} ranks")
    element = config.dtype.itemsize
    kv_heads = max(1, config.kv_heads // tp)  # (fewer K/V heads than ranks: each rank keeps one copy)
    parameters = parameter_bytes_computed(config, tp)["total"]
    activations = config.n_layer * activation_bytes_computed(config, batch, seq, tp, sequence_parallel)["total"]
    kv_cache = 2 * config.n_layer * batch * seq * kv_heads * config.head_dim * element
    return {"tp": tp, "sequence_parallel": sequence_parallel, "parameters_bytes": parameters,
            "activations_bytes": activations, "kv_cache_bytes": kv_cache,
            "total_bytes": parameters + activations + kv_cache}


def llama_memory_gib(hidden: int = 4096, layers: int = 32, heads: int = 32, kv_heads: int = 8, seq: int = 4096,
                     batch: int = 8, tp: int = 8, sequence_parallel: bool = False) -> dict:
    """memory_per_rank of a Llama-shaped model (bf16, SwiGLU, RMSNorm, RoPE, 32000 tokens), in GiB."""
    import torch

    config = GPTConfig(vocab_size=32000, block_size=seq, n_layer=layers, n_head=heads, n_kv_head=kv_heads,
                       n_embd=hidden, ffn_size=-(-8 * hidden // 3 // 256) * 256, mlp="swiglu", norm="rmsnorm",
                       position="rope", bias=False, dtype=torch.bfloat16)
    bytes_ = memory_per_rank(config, batch, seq, tp, sequence_parallel)
    return {k.replace("_bytes", "_GiB"): (round(v / 2**30, 3) if k.endswith("_bytes") else v) for k, v in bytes_.items()}


def collective_time(algorithm: str, p: int, nbytes: float, link: str | Machine = "NVLink (H100, NCCL)",
                    collective: str = "allreduce") -> float:
    """Seconds the α-β-γ model predicts for one collective of ``nbytes`` per rank on ``p`` ranks."""
    machine = LINKS[link] if isinstance(link, str) else link
    return predict(collective, algorithm, p, nbytes, machine)


def layer_ratio(hidden: int, seq: int, batch: int, tp: int, bus_bandwidth: float = 300e9,
                peak_flops: float = 989e12, sequence_parallel: bool = False) -> dict:
    """A TP layer's forward pass: bytes each rank sends, FLOPs it does, and communication / computation."""
    model = layer_model(hidden, seq, batch, tp, peak_flops=peak_flops, bus_bandwidth=bus_bandwidth,
                        sequence_parallel=sequence_parallel)
    return {k: model[k] for k in ("tp", "comm_bytes_per_rank", "flops_per_rank", "comm_time_s", "compute_time_s",
                                  "ratio")}


def show(calculator, **sliders):
    """The calculator's answer for each slider's default as a one-row table (returned, so an executed
    notebook shows it), and live sliders where ipywidgets and a frontend are there. ``sliders``: name ->
    (default, options) with options a list (a dropdown) or (low, high, step) (a slider)."""
    defaults = {name: default for name, (default, _) in sliders.items()}
    table = pd.DataFrame([calculator(**defaults)])
    try:
        import ipywidgets as widgets
        from IPython.display import display
    except ImportError:
        return table
    controls = {}
    for name, (default, options) in sliders.items():
        if isinstance(options, list):
            controls[name] = widgets.Dropdown(options=options, value=default, description=name)
        elif isinstance(default, bool):
            controls[name] = widgets.Checkbox(value=default, description=name)
        else:
            low, high, step = options
            kind = widgets.IntSlider if isinstance(default, int) else widgets.FloatLogSlider
            controls[name] = kind(value=default, min=low, max=high, step=step, description=name)
    display(widgets.interactive(lambda **values: display(pd.DataFrame([calculator(**values)])), **controls))
    return table
