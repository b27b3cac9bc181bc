"""What tensor parallelism costs a transformer layer: bytes on the wire, FLOPs, and their ratio.

Megatron-style TP splits each layer over p GPUs (Megatron-LM; Korthikanti et al. 2022): attention and MLP each end in
a row-parallel linear whose partial outputs are all-reduced, so the forward pass of one layer runs

    2 all-reduces of M = b·s·h·bytes       each moves 2(p-1)/p·M per rank (ring; bandwidth-optimal)

Sequence parallelism replaces each all-reduce by a reduce-scatter + an all-gather: the same bytes, but
LayerNorm and dropout work on s/p tokens, which halves activation memory in those regions.

The layer computes 24·b·s·h² + 4·b·s²·h FLOPs (the four h×h projections and the h×4h MLP: 24bsh²;
QKᵀ and attention×V: 4bs²h), split p ways. Time to talk over time to compute is then

    r = comm / compute = [2·2(p-1)/p·bsh·bytes / B] / [4bsh(6h + s) / (p·F)] = (p-1)·bytes·F / (B·(6h + s))

with F the peak FLOP/s and B the bus bandwidth: independent of the batch b (both grow with it), growing
with p, shrinking with h. Above r = 1 the GPUs wait on the wire more than they compute (unless the two
overlap: async TP).
"""

from __future__ import annotations

GB = 1e9  # bandwidths in GB/s mean 10^9 bytes per second, as nccl-tests and vendors count


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _positive_number(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def tensor_parallel_allreduce_cost(hidden_size, sequence_length, batch_size, num_gpus, num_layers,
                                   bytes_per_element=2, bandwidth_gb_per_sec=300.0,
                                   allreduces_per_layer=2) -> dict:
    """The all-reduce traffic of tensor-parallel forward passes.

    The all-reduced activation has shape (batch_size, sequence_length, hidden_size). With the ring
    algorithm each GPU sends 2(p-1)/p of it per all-reduce; ``allreduces_per_layer`` of those per layer,
    over ``num_layers`` layers, at ``bandwidth_gb_per_sec`` (GB = 10^9 bytes). One GPU: nothing to send.

    >>> tensor_parallel_allreduce_cost(4096, 2048, 1, 8, 32)["total_comm_time_ms"]
    6.2635
    """
    for name, value in [("hidden_size", hidden_size), ("sequence_length", sequence_length),
                        ("batch_size", batch_size), ("num_gpus", num_gpus), ("num_layers", num_layers),
                        ("bytes_per_element", bytes_per_element), ("allreduces_per_layer", allreduces_per_layer)]:
        _positive_int(name, value)
    _positive_number("bandwidth_gb_per_sec", bandwidth_gb_per_sec)

    p = num_gpus
    message_size = batch_size * sequence_length * hidden_size * bytes_per_element
    per_allreduce = 2 * (p - 1) / p * message_size  # ring: reduce-scatter (p-1)/p + allgather (p-1)/p
    total = per_allreduce * allreduces_per_layer * num_layers
    seconds = total / (bandwidth_gb_per_sec * GB)
    return {
        "message_size_bytes": message_size,
        "comm_volume_per_allreduce_bytes": round(float(per_allreduce), 4),
        "total_comm_volume_bytes": round(float(total), 4),
        "total_comm_time_ms": round(seconds * 1000, 4),
    }


def layer_model(hidden_size, sequence_length, batch_size, tp, bytes_per_element=2, peak_flops=989e12,
                bus_bandwidth=300e9, sequence_parallel=False, num_heads=None) -> dict:
    """One transformer layer's forward pass under tensor parallelism of degree ``tp``.

    ``peak_flops`` in FLOP/s (default: H100 SXM dense bf16, 989e12); ``bus_bandwidth`` in bytes/s, in
    the nccl-tests sense (busbw: a collective moving V bytes per rank takes V / busbw; default 300e9,
    about what NCCL reaches on NVLink, measured on 4x H100). Returns the collectives, bytes per rank, FLOPs,
    times and their ratio; with ``num_heads``, also the activation memory per rank that Korthikanti et
    al. (arXiv 2205.05198, table 2) give for 16-bit activations without recomputation.
    """
    for name, value in [("hidden_size", hidden_size), ("sequence_length", sequence_length),
                        ("batch_size", batch_size), ("tp", tp), ("bytes_per_element", bytes_per_element)]:
        _positive_int(name, value)
    _positive_number("peak_flops", peak_flops)
    _positive_number("bus_bandwidth", bus_bandwidth)
    h, s, b, p = hidden_size, sequence_length, batch_size, tp

    message = b * s * h * bytes_per_element  # the activation that crosses the wire
    if sequence_parallel:  # g -> reduce-scatter, f -> all-gather, in both attention and MLP
        collectives = {"allgather": 2, "reduce_scatter": 2}
        comm_bytes = 4 * (p - 1) * message / p  # 4 collectives x (p-1)/p M each
    else:
        collectives = {"allreduce": 2}
        comm_bytes = 2 * 2 * (p - 1) * message / p  # 2 all-reduces x 2(p-1)/p M each
    flops = 24 * b * s * h**2 + 4 * b * s**2 * h
    comm_time = comm_bytes / bus_bandwidth
    compute_time = flops / p / peak_flops
    out = {
        "tp": p, "sequence_parallel": bool(sequence_parallel), "collectives": collectives,
        "message_bytes": message, "comm_bytes_per_rank": comm_bytes,
        "flops": flops, "flops_per_rank": flops / p,
        "comm_time_s": comm_time, "compute_time_s": compute_time,
        "ratio": comm_time / compute_time,  # = (p-1)·bytes·F / (B·(6h + s))
    }
    if num_heads is not None:  # bytes per element of the s·b·h activation, 16-bit, no recomputation
        _positive_int("num_heads", num_heads)
        a = num_heads
        if sequence_parallel:  # everything split p ways
            bytes_per_sbh = 34 / p + 5 * a * s / (h * p)
        else:  # LayerNorm and dropout regions (10 of the 34) stay replicated on every rank
            bytes_per_sbh = 10 + 24 / p + 5 * a * s / (h * p)
        out["activation_bytes_per_rank"] = s * b * h * bytes_per_sbh
    return out
