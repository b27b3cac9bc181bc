"""Request batches with realistic sequence lengths, seeded: the same batch on every rank, every run.

Inference traffic is not a grid of equal sequences. Chat prompts are short, pasted documents long, and
lengths spread over two orders of magnitude. Three shapes cover what the literature reports:

    uniform     lengths spread evenly over [min_length, max_length]       (a synthetic baseline)
    lognormal   a long tail: most requests short, a few 10-100x longer    (ShareGPT/Azure traces look so)
    bimodal     a mix of short chats and long documents                   (two peaks, nothing between)

A request is an id and a length; its tokens are drawn from a generator seeded by (batch seed, id), so
any rank can rebuild any request's tokens without receiving them: a scheduler only ships ids.

    requests = make_requests("lognormal", 64, seed=0, max_length=1024)
    lengths = [r.length for r in requests]
    tokens = requests[3].tokens(vocab_size=64)          # (length,) int64, identical on every rank
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DISTRIBUTIONS = ("uniform", "lognormal", "bimodal")


@dataclass(frozen=True)
class Request:
    id: int
    length: int
    seed: int = 0  # the batch's seed: with the id it fixes the tokens

    def tokens(self, vocab_size: int):
        """This request's token ids, (length,) int64, the same wherever they are drawn."""
        import torch

        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.id)
        return torch.randint(0, vocab_size, (self.length,), generator=generator)


def make_lengths(distribution: str, n: int, seed: int = 0, *, min_length: int = 1, max_length: int = 512,
                 median: float | None = None, sigma: float = 1.0, long_fraction: float = 0.2,
                 short_length: float | None = None, long_length: float | None = None) -> np.ndarray:
    """``n`` sequence lengths, ints in [min_length, max_length].

    lognormal: exp(N(log median, sigma)), clipped (sigma = 1 puts the 99th percentile ~10x the median);
    bimodal: a ``long_fraction`` of lengths near ``long_length`` (default 3/4 of max), the rest near
    ``short_length`` (default min_length + 1/16 of the range), each spread +-20%.
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, not {distribution!r}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative int, not {n!r}")
    if not 1 <= min_length <= max_length:
        raise ValueError(f"need 1 <= min_length <= max_length, got {min_length}, {max_length}")
    rng = np.random.default_rng(seed)
    if distribution == "uniform":
        lengths = rng.integers(min_length, max_length + 1, size=n)
    elif distribution == "lognormal":
        median = median or max(min_length, max_length / 16)
        lengths = np.exp(rng.normal(np.log(median), sigma, size=n))
    else:
        short = short_length or min_length + (max_length - min_length) / 16
        long = long_length or 0.75 * max_length
        centres = np.where(rng.random(n) < long_fraction, long, short)
        lengths = centres * rng.uniform(0.8, 1.2, size=n)
    return np.clip(np.rint(lengths), min_length, max_length).astype(np.int64)


def make_requests(distribution: str, n: int, seed: int = 0, **length_options) -> list[Request]:
    """``n`` requests with ids 0..n-1 and lengths from ``make_lengths`` (same keyword options)."""
    lengths = make_lengths(distribution, n, seed, **length_options)
    return [Request(i, int(length), seed) for i, length in enumerate(lengths)]


def requests_from_lengths(lengths, seed: int = 0) -> list[Request]:
    """Requests of given lengths (ids in order), for hand-made examples and tests."""
    return [Request(i, int(length), seed) for i, length in enumerate(lengths)]


def check_requests(requests, block_size: int) -> dict:
    """{id: request}; a clear error (raised alike on every rank, before any work is shared out) for
    repeated ids or a request longer than the model's ``block_size``."""
    by_id = {r.id: r for r in requests}
    if len(by_id) != len(requests):
        raise ValueError("request ids must be unique")
    too_long = [r.id for r in requests if r.length > block_size]
    if too_long:
        raise ValueError(f"requests {too_long[:5]} are longer than the model's block_size {block_size}")
    return by_id


def describe(lengths) -> dict:
    """Summary of a batch's lengths: what a scheduler is up against."""
    lengths = np.asarray(lengths)
    if lengths.size == 0:
        return {"n": 0, "tokens": 0}
    return {"n": int(lengths.size), "tokens": int(lengths.sum()), "min": int(lengths.min()),
            "median": float(np.median(lengths)), "p99": float(np.percentile(lengths, 99)),
            "max": int(lengths.max()), "max_over_median": float(lengths.max() / np.median(lengths))}
