"""What sequence-parallel attention costs: bytes, messages, memory, causal work, and why staging hurts.

One attention forward, p ranks, b·s tokens split s/p per rank, hidden h = n·d, key/value hidden
h_kv = n_kv·d (= h without GQA), e bytes per element:

    scheme         bytes sent per rank                messages      K/V held per rank
    allgather_kv   2 (p-1)/p · b·s·h_kv·e             2 (p-1)       2·b·s·h_kv·e          (all of it)
    ring           2 (p-1)/p · b·s·h_kv·e             p - 1         3 · 2·b·(s/p)·h_kv·e  (mine, now, next)
    ulysses        (p-1)/p² · b·s·(2h + 2h_kv)·e       4 (p-1)       2·b·s·(h_kv/p)·e      (all tokens, my heads)
    streamed_kv    2 (p-1)/p · b·s·h_kv·e             p - 1         2·b·s·h_kv·e          (every block lands)
    tensor parallel (for comparison): 2 all-reduces of b·s·h per layer: 4 (p-1)/p · b·s·h·e

(ring all-gather, ring attention carrying k and v in one message, pairwise all-to-all: what tplab runs
and the Communicator counts.) Ulysses' volume is ≈ 4·N·h/p for N = b·s (DeepSpeed's "4Nh/P per link"):
it falls with p, the all-gather's grows towards 2·N·h_kv.

    attention_bytes("ring", batch=4, seq_len=4096, hidden=5120, p=4)     # bytes per rank
    causal_work(seq_len=4096, p=4, layout="contiguous")                 # score pairs per rank
    staged_vs_direct(4, 4096, 5120, p=4, compute_time_1=0.236)          # the course project's slowdown, explained
"""

from __future__ import annotations

from tplab.cost.tensor_parallel import _positive_int, _positive_number

SCHEMES = ("allgather_kv", "ring", "ulysses", "streamed_kv")


def _check(scheme, batch, seq_len, hidden, p, kv_hidden, bytes_per_element):
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}: choose one of {list(SCHEMES)}")
    for name, value in [("batch", batch), ("seq_len", seq_len), ("hidden", hidden), ("p", p),
                        ("bytes_per_element", bytes_per_element)]:
        _positive_int(name, value)
    _positive_int("kv_hidden", hidden if kv_hidden is None else kv_hidden)
    return hidden if kv_hidden is None else kv_hidden


def attention_bytes(scheme, batch, seq_len, hidden, p, *, kv_hidden=None, bytes_per_element=4) -> float:
    """Bytes one rank sends in one sequence-parallel attention forward (the table above)."""
    h_kv = _check(scheme, batch, seq_len, hidden, p, kv_hidden, bytes_per_element)
    tokens, e = batch * seq_len, bytes_per_element
    # (multiply first, divide last: exact whenever the counts divide, as they must for the schemes to run)
    if scheme == "ulysses":
        return (p - 1) * tokens * (2 * hidden + 2 * h_kv) * e / p**2
    return 2 * (p - 1) * tokens * h_kv * e / p  # all-gather of K and V, or K/V blocks (around the ring)


def attention_messages(scheme, p) -> int:
    """Messages one rank sends in one attention forward."""
    _check(scheme, 1, 1, 1, p, None, 1)
    return {"allgather_kv": 2 * (p - 1), "ring": p - 1, "ulysses": 4 * (p - 1), "streamed_kv": p - 1}[scheme]


def kv_memory(scheme, batch, seq_len, hidden, p, *, kv_hidden=None, bytes_per_element=4) -> float:
    """Bytes of keys and values one rank holds at the peak of the scheme (the table above)."""
    h_kv = _check(scheme, batch, seq_len, hidden, p, kv_hidden, bytes_per_element)
    both = 2 * batch * seq_len * h_kv * bytes_per_element  # K and V of the whole sequence
    return {"allgather_kv": both, "ring": 3 * both / p if p > 1 else both, "ulysses": both / p,
            "streamed_kv": both}[scheme]


def causal_work(seq_len, p, layout="contiguous") -> list[float]:
    """Query-key pairs each rank scores under a causal mask (per batch element and head), when whole
    chunk pairs in the future are skipped and a diagonal chunk pair counts half (ring.py's ``stats``).

    Contiguous (chunks of L = s/p): rank i scores i past chunks + 1 diagonal = (i + 1/2)·L² — rank p-1
    does 2p-1 times rank 0's work. Zig-zag (chunks of L = s/2p, rank i holds i and 2p-1-i): (i + 1/2) +
    (2p-1-i + 1/2) = 2p chunk pairs of L² on every rank. Either way the sum is s²/2."""
    _positive_int("seq_len", seq_len)
    _positive_int("p", p)
    if layout == "contiguous":
        length = seq_len / p
        return [(i + 0.5) * length**2 for i in range(p)]
    if layout == "zigzag":
        length = seq_len / (2 * p)
        return [2 * p * length**2 for _ in range(p)]
    raise ValueError(f"unknown layout {layout!r}: 'contiguous' or 'zigzag'")


def sp_vs_tp(batch, seq_len, hidden, p, *, num_heads, num_kv_heads=None, bytes_per_element=2) -> list[dict]:
    """One transformer layer's forward (4h MLP) under tensor parallelism and the three SP schemes: bytes
    sent per rank, weights and the largest activations held per rank (bytes). A guide to *when* SP wins:
    it sends fewer bytes, but keeps every weight on every rank; TP splits the weights, but every rank
    holds the whole b·s·h activation between the blocks."""
    for name, value in [("num_heads", num_heads), ("batch", batch), ("seq_len", seq_len), ("hidden", hidden),
                        ("p", p)]:
        _positive_int(name, value)
    kv_heads = num_kv_heads or num_heads
    h, h_kv, e, tokens = hidden, hidden * kv_heads // num_heads, bytes_per_element, batch * seq_len
    weights = (2 * h * h + 2 * h * h_kv + 8 * h * h) * e  # Q, O; K, V; MLP up and down
    mlp_hidden = 4 * tokens * h * e / p  # every scheme splits the MLP's 4h activation p ways
    rows = [{"scheme": "tensor_parallel", "bytes_per_rank": 4 * (p - 1) / p * tokens * h * e,
             "weights_per_rank": weights / p,
             "activations_per_rank": tokens * h * e + tokens * (h + 2 * h_kv) * e / p + mlp_hidden}]
    for scheme in SCHEMES:
        kv = kv_memory(scheme, batch, seq_len, h, p, kv_hidden=h_kv, bytes_per_element=e)
        queries = tokens * h * e / p  # my tokens' x and q (Ulysses: all tokens of my heads, the same size)
        rows.append({"scheme": scheme, "bytes_per_rank": attention_bytes(scheme, batch, seq_len, h, p, kv_hidden=h_kv,
                                                                          bytes_per_element=e),
                     "weights_per_rank": weights, "activations_per_rank": 2 * queries + kv + mlp_hidden})
    for row in rows:
        row["memory_per_rank"] = row["weights_per_rank"] + row["activations_per_rank"]
    return rows


def staged_vs_direct(batch, seq_len, hidden, p, *, compute_time_1, kv_hidden=None, bytes_per_element=4,
                     pcie_bandwidth=12e9, host_bandwidth=4e9, host_alpha=20e-6, link_bandwidth=300e9,
                     link_alpha=20e-6, gathers=2) -> list[dict]:
    """The course project's layer (all-gather K/V) on p GPUs: why CPU staging made 4 GPUs slower than one, and
    what direct GPU transfers leave. Returns one row per path with the time broken down.

    Each of the ``gathers`` all-gathers moves a shard of m = b·(s/p)·h_kv·e bytes per rank into the full
    p·m on every rank.
      staged (GPU -> host -> MPI -> host -> GPU):
          m / pcie_bandwidth                      copy my shard to the host (tensor.cpu())
        + (p-1)·host_alpha + (p-1)·m / host_bandwidth     ring all-gather through host memory
        + p·m / pcie_bandwidth                    copy the whole gathered tensor back to the GPU
      direct (GPU to GPU, NVLink):  (p-1)·link_alpha + (p-1)·m / link_bandwidth
    compute: ``compute_time_1`` (the layer on one GPU, measured) / p, ideally split.

    The staged copies *grow* with p (p·m = b·s·h_kv·e back to every GPU, whatever p), while the compute
    shrinks as 1/p: past some p the layer gets slower. Defaults: PCIe ~12 GB/s for pageable copies;
    host MPI ~4 GB/s per rank (measured: MPICH all-reduces 32 MiB in 21-26 ms on 4 host ranks,
    ~2 GB/s with the arithmetic; an all-gather has none); NVLink ~300 GB/s (NCCL's bus bandwidth,
    measured on 4x H100). Measure your own with scripts/gpu_sequence_parallel.py --components."""
    h_kv = _check("allgather_kv", batch, seq_len, hidden, p, kv_hidden, bytes_per_element)
    for name, value in [("compute_time_1", compute_time_1), ("pcie_bandwidth", pcie_bandwidth),
                        ("host_bandwidth", host_bandwidth), ("link_bandwidth", link_bandwidth)]:
        _positive_number(name, value)
    shard = batch * seq_len * h_kv * bytes_per_element / p  # m
    compute = compute_time_1 / p
    rows = []
    for path in ("staged", "direct"):
        if p == 1:  # nothing to gather
            copies = wire = 0.0
        elif path == "staged":
            copies = gathers * (shard + p * shard) / pcie_bandwidth
            wire = gathers * ((p - 1) * host_alpha + (p - 1) * shard / host_bandwidth)
        else:
            copies = 0.0
            wire = gathers * ((p - 1) * link_alpha + (p - 1) * shard / link_bandwidth)
        total = compute + copies + wire
        rows.append({"path": path, "p": p, "shard_bytes": shard, "compute_s": compute, "pcie_copies_s": copies,
                     "wire_s": wire, "total_s": total, "speedup": compute_time_1 / total})
    return rows
