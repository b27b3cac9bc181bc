"""tplab: the communication behind tensor-parallel transformer inference, by hand.

    import tplab
    comm = tplab.comm.world()                 # a Communicator over MPI.COMM_WORLD
    y = tplab.allreduce(x, comm, algorithm="ring")

The collectives are written out by hand in ``tplab.collectives`` (one file per family of algorithms);
``tplab.comm`` is the wire they run on; ``tplab.cluster`` starts MPI engines for Jupyter.
"""

__version__ = "0.1.0"

from tplab import comm  # noqa: E402  (the wire first: the collectives build on it)
from tplab.collectives import (  # noqa: E402
    ALGORITHMS,
    CollectiveArgumentError,
    allgather,
    allreduce,
    broadcast,
    reduce,
    reduce_scatter,
)

__all__ = [
    "ALGORITHMS",
    "CollectiveArgumentError",
    "allgather",
    "allreduce",
    "broadcast",
    "comm",
    "reduce",
    "reduce_scatter",
]
