"""Pictures for notebook 05: who computes which part of causal attention.

    draw_causal_work(p, layout, ax)   the (query chunk x key chunk) grid of causal attention, each chunk pair
                                      coloured by the rank that computes it; the future (upper right) is
                                      never computed, a diagonal pair is half a pair
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from tplab.cost.sequence_parallel import causal_work
from tplab.sequence.layout import my_chunks, num_chunks


def draw_causal_work(p: int, layout: str, ax=None, tokens_per_chunk: int = 6):
    ax = ax or plt.gca()
    chunks = num_chunks(p, layout)
    owner = np.empty(chunks, dtype=int)  # the rank holding each chunk of queries
    for rank in range(p):
        owner[my_chunks(rank, p, layout)] = rank
    colors = plt.cm.tab10(np.arange(p) % 10)
    n = chunks * tokens_per_chunk
    query, key = np.arange(n)[:, None], np.arange(n)[None, :]
    picture = np.ones((n, n, 4))  # white: a key in the query's future, never used
    seen = key <= query  # the causal mask, token by token
    picture[seen] = colors[owner[query // tokens_per_chunk]].repeat(n, axis=1)[seen]
    ax.imshow(picture, interpolation="nearest", extent=(0, chunks, chunks, 0))
    for edge in range(1, chunks):
        ax.axhline(edge, color="white", lw=0.8)
        ax.axvline(edge, color="white", lw=0.8)
    ax.set(xlabel="key chunk", xticks=np.arange(chunks) + 0.5, xticklabels=range(chunks),
           yticks=np.arange(chunks) + 0.5, yticklabels=[f"{c}  (rank {owner[c]})" for c in range(chunks)])
    work = causal_work(chunks * 4, p, layout)  # any length: only the shares matter
    ax.set_title(f"{layout}: work per rank " + ", ".join(f"{w / sum(work):.0%}" for w in work), fontsize=9)
    return ax
