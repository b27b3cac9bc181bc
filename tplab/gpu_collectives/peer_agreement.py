"""The agreement every peer-memory call starts with, and what a failed one leaves behind: the host's side.

Before a kernel of tplab's peer memory moves a byte, the ranks' kernels compare the calls' signatures
(signature.py) in the flags area (kernels/agreement.cuh): ranks that disagree, or one that refuses its input,
make every rank's kernel stop before it writes any output and report to pinned host memory (``status``).
The host reads that word at the next call (``raise_pending``) and raises the same error on every rank. A
failed call may have pushed into the peers' buffers already, so every rank then queues one barrier
(``_barrier_on``) before it goes on; a peer that never comes is given up on after the timeout, and the
peer memory is unusable (``broken``).

The flags area of every rank (``flags[q]`` as mapped by each peer) holds MAX_BLOCKS slots of MAX_RANKS
32-bit flags: slot b for the kernels' block b, and three slots at the top for the barriers and the
agreement (BARRIER_SLOT, STREAM_SLOT, AGREE_SLOT); the signatures' lines follow (SIGNATURE_BYTES).

GpuAgreement is PeerMemory's base class: it needs ``rank``, ``size``, ``device``, ``control``, ``status``,
``broken``, ``flag_pointers``, ``epochs`` and ``everyone``, which PeerMemory makes.
"""

from __future__ import annotations

import numpy as np

from tplab.comm.base import CollectiveArgumentError, CommTimeoutError
from tplab.gpu_collectives.peer_kernels import kernel
from tplab.gpu_collectives.signature import REFUSED, describe
from tplab.toolkit.arrays import external_stream

MAX_RANKS = 8               # as in kernels/memory_model.cuh
MAX_BLOCKS = 1024           # flag slots per rank; grids use slots below min(SLOT, multiprocessors)
BARRIER_SLOT = MAX_BLOCKS - 1  # the slot of flag_barrier (copy_engine.py)
STREAM_SLOT = MAX_BLOCKS - 2   # the slot of barriers made of stream memory operations (copy_engine.py)
AGREE_SLOT = MAX_BLOCKS - 3    # the slot of the agreement every collective call starts with (kernels/agreement.cuh)
REPLAY_SLOTS = (MAX_BLOCKS - 6, MAX_BLOCKS - 5, MAX_BLOCKS - 4)  # replayable stream barriers' slots, in turn (copy_engine.py)
SIGNATURE_BYTES = 2 * MAX_RANKS * 16  # two rows of the peers' signature lines (16 bytes each), after the flags
STATUS_WORDS = 8               # what a failed agreement reports to the host (agree in kernels/agreement.cuh)
MISMATCH, PEER_REFUSED, TIMEOUT = 1, 2, 3


class GpuAgreement:
    """The host side of the GPU agreement (module docstring); PeerMemory's base class."""

    def launch_agreement(self, sig: int) -> None:
        """Queue an agreement alone on the current stream (one block): for a call that then runs by other
        means (NCCL, hand-written algorithms), so that ranks on different paths still meet."""
        kernel("agree_only")((1,), (32,), (self.control, np.uint64(sig), self.flag_pointers, self.epochs,
                                          np.int32(self.rank), np.int32(self.size)))

    def agree(self, sig: int) -> str | None:
        """Collective: compare ``sig`` with every rank's on the GPUs, wait for the answer. None if all are
        equal, else the message to raise (every rank gets one)."""
        import cupy

        self.raise_pending()
        if self.size == 1:
            return None
        self.launch_agreement(sig)
        cupy.cuda.get_current_stream().synchronize()
        message = self._take_status()
        if sig == REFUSED and message is None:   # this rank's call fails too, but its own refusal leaves no
            self._after_failure(cupy.cuda.get_current_stream().ptr)  # status to take. (A status taken here is an
        return message                           # earlier call's, whose failure stopped this agreement unmet.)

    def raise_pending(self, stream: int | None = None) -> None:
        """Raise what an earlier call's agreement found, once its kernel has finished (a call that did not
        wait: its result is not a sum). Free: it reads a word of host memory the kernels write. ``stream``:
        where this rank's calls run (default: CuPy's current stream)."""
        if self.broken:
            raise CommTimeoutError(self.broken)
        if self.status[0]:
            raise CollectiveArgumentError(self._take_status(stream) + " (found after that call returned: its "
                                          "result is not a sum; this call was not run)")

    def _take_status(self, stream: int | None = None) -> str | None:
        import cupy

        code = int(self.status[0])
        if not code:
            return None
        stream = cupy.cuda.get_current_stream().ptr if stream is None else stream
        message = self._status_message(code)
        if capturing(stream):   # (clearing it and the barrier would be recorded into the graph, not run)
            return message + " (found while a CUDA graph was being captured: raised again outside it)"
        cupy.cuda.runtime.memsetAsync(self.control.data.ptr + 32, 0, 4, stream)  # Control.failed: kernels agree again
        self.status[0] = 0
        if code == TIMEOUT:
            self.broken = message
            return message
        self._after_failure(stream)   # (every rank fails a call once -- a refusing one in agree: the barriers pair up)
        return message

    def _status_message(self, code: int) -> str:
        peer, call = int(self.status[1]), int(self.status[4])
        theirs = int(self.status[2]) | int(self.status[3]) << 32
        mine = int(self.status[5]) | int(self.status[6]) << 32
        if code == TIMEOUT:
            return (f"rank {self.rank}: rank {peer} did not join collective call {call} within the timeout "
                    "(a program whose ranks diverged?); this peer memory is unusable: make a new one")
        if code == PEER_REFUSED:
            return f"rank {peer} refused its input in collective call {call} (its error says why)"
        same = describe(mine) == describe(theirs)
        return (f"ranks disagree in collective call {call}: rank {self.rank} passed {describe(mine)}, "
                f"rank {peer} passed {describe(theirs)}" + (" (and a different op, algorithm or shape, or an "
                                                           "input in the shared buffer on one rank only)"
                                                           if same else ""))

    def refuse(self, problem: str, what: str = "peer all-reduce"):
        """This rank cannot take part in the call: tell the peers (their kernels stop at once), then raise."""
        earlier = self.agree(REFUSED)   # (which queues this rank's barrier; the peers' raise queues theirs)
        raise CollectiveArgumentError(f"{what} on rank {self.rank}: {problem}"
                                      + (f" (and an earlier call failed: {earlier})" if earlier else ""))

    def _after_failure(self, stream: int) -> None:
        """What every rank queues on ``stream`` once a call has failed: a barrier (``_barrier_on``), then
        whatever the subclass must put right behind it (``_clean_after_failure``)."""
        self._barrier_on(stream)
        self._clean_after_failure(stream)

    def _clean_after_failure(self, stream: int) -> None:
        """Put right, on ``stream``, what a failed call's pushes left in this rank's memory (none here)."""

    def _barrier_on(self, stream: int) -> None:
        """A barrier queued on ``stream`` after a call that failed: the pushed one-shots (one_shot_ll,
        one_shot_lamport), and a two_shot right after a two_shot, push into the peers' buffers before they know
        whether the ranks agree, and such a push may still be on its way when this rank has raised and goes
        on -- to write an input into buffer(), say.
        The barrier waits on the GPU until every peer's failed kernel has ended; a peer that never comes
        (its program went elsewhere) ends it after the timeout, which the next call raises (CommTimeoutError)."""
        with external_stream(stream, self.device):
            kernel("failure_barrier")((1,), (32,), (self.control, self.flag_pointers, self.epochs, np.int32(self.rank),
                                                    self.everyone, np.int32(BARRIER_SLOT)))


def capturing(stream: int) -> bool:
    """Is ``stream`` being captured into a CUDA graph? (Asking about the legacy stream while another stream
    of this thread captures is itself an error: that counts as capturing too.)"""
    import cupy

    try:
        return bool(cupy.cuda.runtime.streamIsCapturing(stream))
    except cupy.cuda.runtime.CUDARuntimeError:
        return True
