"""Notebook 05's exercises: attention from all-gathered K and V, and the zig-zag layout's token positions.

    report = cluster.run(check_allgather_attention, my_attention)[0]   # fn(q, k, v, causal, comm) -> my rows
    print(format_report(check_zigzag_positions(my_positions)))          # fn(seq_len, p, rank) -> positions

The first runs on every rank: q, k, v (batch, heads, s/p, head dim) are this rank's tokens under the
contiguous layout (rank r holds positions r·s/p ... (r+1)·s/p - 1), float64; the result must equal rank r's
rows of full attention over the whole sequence (to 1e-12), and each rank must send what the ring all-gather of
K and V sends: 2 (p-1) times its shard of K (the queries never travel). The second needs no cluster.
"""

from __future__ import annotations

from tplab.comm import world
from tplab.lab.exercises.runner import Case, run_cases, run_local

# (name, batch, heads, tokens per rank, head dim, causal)
SHAPES = [("causal, 3 tokens per rank", 1, 2, 3, 4, True), ("full (not causal)", 2, 1, 2, 3, False),
          ("causal, 1 token per rank", 1, 1, 1, 2, True), ("causal, 5 tokens per rank, 2 heads", 2, 2, 5, 8, True)]


def _full(batch, heads, seq_len, head_dim, seed):
    import torch

    g = torch.Generator().manual_seed(seed)  # the same on every rank
    return [torch.randn(batch, heads, seq_len, head_dim, generator=g, dtype=torch.float64) for _ in range(3)]


def _close(a, b) -> bool:
    import torch

    return tuple(a.shape) == tuple(b.shape) and bool(torch.allclose(a, b, rtol=1e-12, atol=1e-12))


def _top_left(q, k, v):
    """What torch's scaled_dot_product_attention(..., is_causal=True) gives for fewer queries than keys."""
    import torch

    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _slips(q, k_all, v_all, k, v, causal):
    """Typical wrong attempts and what each tells the reader."""
    from tplab.layers.attend import attend

    slips = [(attend(q, k, v, causal=causal),
              "you attended to your own tokens' keys only: all-gather K and V first (every query needs every key)")]
    if causal:
        slips += [(attend(q, k_all, v_all, causal=False),
                   "the causal mask is missing: a query at position t may only see keys 0..t"),
                  (attend(q, k_all, v_all, causal=True),
                   ("causal mask aligned to the last rank (bottom right): right on the last rank only. Rank r's queries "
                   "sit at positions r·s/p ... (r+1)·s/p - 1: query i may see keys 0 .. r·s/p + i")),
                  (_top_left(q, k_all, v_all),
                   ("causal mask aligned top left (what is_causal=True does with fewer queries than keys): right on "
                   "rank 0 only. Rank r's query i sits at position r·s/p + i and may see keys 0 .. r·s/p + i"))]
    else:
        slips.append((attend(q, k_all, v_all, causal=True), "you masked the future, but this case is not causal"))
    return slips


def _diagnose_attention(got, case, p):
    out, sent_bytes, sent_messages = got
    expected, slips, want_bytes = case.expected
    if out is None:
        return "returned None (return this rank's rows of the attention output)"
    if tuple(out.shape) != tuple(expected.shape):
        return (f"returned shape {tuple(out.shape)}, expected {tuple(expected.shape)}: (batch, heads, s/p, head dim), "
                "your own queries' rows only")
    own_keys, own_hint = slips[0]
    if p > 1 and sent_bytes == 0 and _close(out, own_keys):  # (right by luck on rank 0 when causal: say the same)
        return own_hint
    if not _close(out, expected):
        for wrong, hint in slips:
            if _close(out, wrong):
                return hint
        return f"wrong values (largest difference {float((out - expected).abs().max()):.3g})"
    if sent_bytes != want_bytes:
        text = (f"right values, but sent {sent_bytes} B in {sent_messages} messages where the ring all-gather of K and "
                f"V sends {want_bytes} B")
        if want_bytes and sent_bytes >= 1.4 * want_bytes:
            text += (": did the queries travel too? Only K and V are needed by others (use algorithm='ring', and "
                     "gather k and v, not q)")
        elif sent_bytes < want_bytes:
            text += ": both K and V must reach every rank"
        return text
    return None


def check_allgather_attention(fn, comm=None, *, timeout: float = 5.0, progress=True, stop_at_first_failure=False):
    """``fn(q, k, v, causal, comm)``: q, k, v (batch, heads, s/p, d) this rank's tokens (contiguous layout),
    float64. Must return this rank's rows of attention over the whole sequence, (batch, heads, s/p, d),
    having sent 2 (p-1) · k.nbytes bytes (the ring all-gathers of K and V). Call it on every rank."""
    base = comm or world()
    p, r = base.size, base.rank
    cases = []
    for i, (name, batch, heads, per_rank, head_dim, causal) in enumerate(SHAPES):
        from tplab.layers.attend import attend

        q_all, k_all, v_all = _full(batch, heads, per_rank * p, head_dim, seed=10 + i)
        mine = slice(r * per_rank, (r + 1) * per_rank)
        q, k, v = (t[:, :, mine].clone() for t in (q_all, k_all, v_all))
        expected = attend(q_all, k_all, v_all, causal=causal)[:, :, mine]
        want_bytes = 2 * (p - 1) * k.numel() * k.element_size()
        cases.append(Case(name, (q, k, v, causal), (expected, _slips(q, k_all, v_all, k, v, causal), want_bytes),
                          {"s": per_rank * p}))

    def run(q, k, v, causal, c):
        out = fn(q, k, v, causal, c)
        return out, c.bytes_sent, c.messages_sent

    return run_cases(run, cases, _diagnose_attention, comm=base, timeout=timeout, title="all-gather attention: ",
                     progress=progress, same_result=False, stop_at_first_failure=stop_at_first_failure)


# ---- zig-zag positions ------------------------------------------------------------------------------------------
def _zigzag(seq_len, p, rank):
    n = seq_len // (2 * p)
    return list(range(rank * n, (rank + 1) * n)) + list(range((2 * p - 1 - rank) * n, (2 * p - rank) * n))


def _diagnose_positions(result, case, _):
    seq_len, p, rank = case.args
    expected = case.expected
    if expected is None:  # the sequence does not cut into 2p equal chunks
        if isinstance(result, tuple) and result[:1] == ("ValueError",):
            return None
        return (f"s = {seq_len} does not cut into 2p = {2 * p} equal chunks: raise ValueError with a clear message "
                f"(returned {result!r})")
    if isinstance(result, tuple) and result[:1] == ("ValueError",):
        return f"raised ValueError ({result[1]}) for s = {seq_len}, p = {p}, which cuts into {2 * p} chunks evenly"
    try:
        got = [int(t) for t in result]
    except TypeError:
        return f"returned {result!r}, not a list of token positions"
    where = f"s = {seq_len}, p = {p}, rank {rank}: got {got}, expected {expected}"
    if got == expected:
        return None
    n = seq_len // (2 * p)
    if got == list(range(rank * seq_len // p, (rank + 1) * seq_len // p)):
        return f"{where} -- that is the contiguous layout: zig-zag cuts 2p chunks and gives rank r chunks r and 2p-1-r"
    if sorted(got) == sorted(expected):
        return f"{where} -- the right tokens in the wrong order: chunk r first, then chunk 2p-1-r"
    if rank > 0 and got == list(range(rank * n, (rank + 1) * n)) + list(range((2 * p - rank) * n, (2 * p - rank + 1) * n)):
        return f"{where} -- off by one: the chunks are numbered 0 .. 2p-1, so rank r's partner chunk is 2p-1-r"
    if len(got) != len(expected):
        return f"{where} -- each rank holds s/p tokens: two chunks of s/(2p)"
    return where


def check_zigzag_positions(fn, *, progress=True):
    """``fn(seq_len, p, rank)``: the global positions of rank ``rank``'s tokens under the zig-zag layout (a list
    of ints, in the order they sit in its local tensor: chunk r, then chunk 2p-1-r), or ValueError when the
    sequence does not cut into 2p equal chunks."""
    cases = []
    for seq_len, p in [(8, 2), (16, 4), (12, 3), (6, 1), (24, 4), (10, 2)]:
        for rank in range(p):
            even = seq_len % (2 * p) == 0
            cases.append(Case(f"s = {seq_len}, p = {p}, rank {rank}", (seq_len, p, rank),
                              _zigzag(seq_len, p, rank) if even else None))

    def run(seq_len, p, rank):
        try:
            return fn(seq_len, p, rank)
        except ValueError as e:
            return ("ValueError", str(e))

    return run_local(run, cases, _diagnose_positions, title="zig-zag: ", progress=progress)
