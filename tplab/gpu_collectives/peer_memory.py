"""All-reduce through peer memory with flags in GPU memory: one kernel launch, no host in the loop.

On one NVLink node each GPU maps every other GPU's shared buffer (CUDA IPC) and a kernel reads it as if it
were local. The ranks synchronise through *flags* that each GPU writes into its peers' memory: block b of
rank r tells rank q "I passed barrier e" by storing e into q's ``flags[b][r]`` (a release store at system
scope), and waits until its own ``flags[b][q]`` reaches e (an acquire load). No host call, no stream
drain: the whole all-reduce is one kernel, so it can be captured in a CUDA graph, and its latency is a few
NVLink round trips rather than a few host barriers (cuda_ipc.py is the host-synchronised first version).
This is how vLLM's and TensorRT-LLM's custom all-reduces work; the kernels are in kernels/ (peer_kernels.KERNEL_FILES).

    algorithm      rounds  NVLink bytes per rank          for
    one_shot       1       (p-1)·n read                    small messages: latency is all that counts
    one_shot_ll    1       2(p-1)·n written: each 8 bytes  small messages (to 256 KiB): the data carries
                           of data go with a 4-byte flag   its own "ready" flag, so no barrier and no
                           twice (NCCL's LL protocol)      remote read
    one_shot_      1       (p-1)·n written: the area       the same for 16- and 32-bit floats, half the
      lamport              holds a "not yet" value no      bytes: the data is its own flag (TensorRT-
                           input can, until data lands     LLM's Lamport all-reduce)
    two_shot_      2       2(p-1)/p·n written into         mid sizes (to p/2 MiB): two_shot's bytes, and
      lamport              one_shot_lamport's area: the    no barrier -- each half waits for its data
                           data is its own flag            (TensorRT-LLM's two-shot Lamport)
    two_shot       2       2(p-1)/p·n written: push the    large messages on a switch (NVSwitch): every
                           chunks to their owners, then    link busy at once
                           the results to everyone
    two_shot_pull  2       the same, the chunks pulled     inputs already in the shared buffer (registered):
                           from the peers, the results     two meetings in place, as torch's symmetric-
                           pushed                          memory two-shot
    ring           2(p-1)  2(p-1)/p·n, written to the      the textbook ring, steps synchronised by flags
                           right neighbour (push)
    ring_pull      2(p-1)  the same, read from the left    inputs already in the shared buffer

Every algorithm sums in a fixed order and each result element is computed on exactly one rank (one_shot:
on every rank, in rank order), so all ranks hold bitwise the same result. 16-bit floats are summed in
float32 and rounded once (one_shot, two_shot) or after every step (ring, like NCCL's ring).

    pm = PeerMemory(mpi_comm, max_bytes=64 << 20)   # collective; one process per GPU, one node
    y = pm.allreduce(x)                             # x: CuPy array (or torch CUDA tensor via DLPack)
    buf = pm.buffer(n, "float32")                   # this rank's shared buffer: write the input there and
    pm.allreduce(buf, out=buf, algorithm="two_shot")  # nothing is copied in (in place, as NCCL can)
    pm.close()                                      # collective
"""

from __future__ import annotations

import ctypes

import numpy as np

from tplab.comm.base import CollectiveArgumentError
from tplab.gpu_collectives.peer_agreement import (AGREE_SLOT, BARRIER_SLOT, MAX_BLOCKS, MAX_RANKS,  # noqa: F401
                                                  MISMATCH, PEER_REFUSED, SIGNATURE_BYTES, STATUS_WORDS,
                                                  STREAM_SLOT, TIMEOUT, GpuAgreement, capturing)
from tplab.gpu_collectives.peer_kernels import (LAMPORT_KERNELS, LAMPORT_TYPES, LINE_PACKS, PACK, fast_launcher,
                                                kernel, programmatic_launch_works, raw_bytes, type_name, whole_packs)
from tplab.gpu_collectives.signature import AGREED_ALREADY, REFUSED, signature
from tplab.toolkit.arrays import external_stream

ALGORITHMS = ("one_shot", "one_shot_ll", "one_shot_lamport", "two_shot_lamport", "two_shot", "two_shot_pull", "ring",
              "ring_pull")
SMALL_BYTES = 8 << 20       # one_shot's limit: it has a double-buffered area of its own, 2 x this
LL_BYTES = 256 << 10        # one_shot_ll's limit: its area holds 2 halves x p senders x twice this (data + flags)
LAMPORT_BYTES = 1 << 20     # one_shot_lamport's limit: its area, after one_shot_ll's, 2 halves x p senders x this
CLOCK_RATE_ATTRIBUTE = 13  # cudaDevAttrClockRate: the SM clock at its peak, in kHz
PULLED = 1 << 40  # flipped in a call's signature when its input is pulled from the shared buffer (same count, dtype)
# (1 << 41 is the kernels' early bit: two_shot.cu flips it in the signature of a call that pushes before it agrees)
THREADS = 512
MIN_THREADS = 128           # the two-shots' smallest blocks, where their grid would leave SMs idle (block_threads):
                            #  4x H100, 64 KiB-1 MiB: 12.5-15.0 us against 13.4-15.9 with 512 (~7%; 2 GPUs ~4%;
                            #  data/gpu_two_shot_variants_4x-h100.csv); blocks of 64 were slower from 2 MiB;
                            #  two_shot_pull 10.4 / 12.8 / 27.9 us at 512 KiB / 1 / 4 MiB against 10.7 / 13.1 /
                            #  30.5 with 512 (data/gpu_two_shot_registered_4x-h100_block-size.csv)
LL_THREADS = 64             # one_shot_ll: more, smaller blocks -- its pushes are limited by how many SMs store
                            #  (4x H100: 9.1-9.3 us at 256 KiB against 14.7-14.8 with 128, 10.5-10.6 with 32)
LAMPORT_THREADS = (64, 256)  # one_shot_lamport: blocks of 64 threads, doubled (to 256) while the grid would need more
                            #  blocks than it may have: one pack per thread where it can. 4x H100, with the agreement:
                            #  64 / 128 / 256 threads 4.51-4.59 / 4.54-4.60 / 4.72-4.79 us at 64 KiB, 6.7-7.0 /
                            #  6.3-6.4 / 6.5 at 256 KiB, 11.3 / 8.7-8.9 / 8.7-8.8 at 512 KiB, 19.9-20.4 / 15.0-15.2 /
                            #  13.3-13.4 at 1 MiB (data/gpu_allreduce_time_parts_h100.csv, "threads" stages);
                            #  512 threads do not launch (registers). two_shot_lamport's too (its work: a chunk):
                            #  4x H200, a first sweep, 32-128 threads within 2% at 16 KiB-2 MiB, 256 3-7% slower
# What "auto" runs, by bytes per rank: (up to this size, algorithm), the fastest measured with NVLink from
# CUDA graphs. On 4x H100: one_shot_lamport for the floats it sums (one_shot_ll for the others, to its 256 KiB
# limit): 4.1 / 4.5 / 4.9 / 6.6 / 9.0 us at 1 / 16 / 64 / 256 / 512 KiB, against one_shot_ll's 4.3 / 5.0 /
# 5.9 / 9.2 and two_shot's 12.5 at 512 KiB (data/gpu_frontier_4x-h100_small-messages_lamport.csv, start 3).
# Then two_shot_lamport to 2 MiB (its limit at p = 4; two_shot for the types it cannot sum), measured on
# 4x H200: 11.5 / 15.5 us at 1 / 2 MiB against one_shot_lamport's 13.4 and two_shot's 12.8 / 18.1, and
# behind one_shot_lamport at 512 KiB (9.2 against 8.6; data/gpu_allreduce_time_parts_h200.csv); two_shot to
# 16 MiB, the ring beyond (_256MiB_pushed-two-shot.csv). tune() measures it again on the machine at hand (at
# p = 2 the one-shots win up to larger sizes).
DEFAULT_TABLE = ((512 << 10, "one_shot_lamport"), (2 << 20, "two_shot_lamport"), (16 << 20, "two_shot"),
                 (1 << 62, "ring"))
# On 2 GPUs a one-shot writes (or reads) as many bytes as two_shot moves and synchronises once: measured on
# 2x H100 (data/gpu_frontier_2x-h100_small-messages_lamport.csv, _256MiB.csv), one_shot_lamport to its
# 1 MiB limit (8.2 us there against one_shot's 10.7), one_shot to 4 MiB, two_shot beyond (at 256 MiB ahead
# of the ring).
TABLE_FOR_RANKS = {2: ((1 << 20, "one_shot_lamport"), (4 << 20, "one_shot"), (1 << 62, "two_shot"))}


class PeerMemory(GpuAgreement):
    """Shared buffers and flags of ``max_bytes`` per rank, mapped by every rank of ``mpi_comm`` (one node,
    one GPU per process, at most 8 ranks). Collective to build and to close. ``blocks`` caps the kernels'
    grid (default: one block per SM), leaving SMs to work that should overlap (like NCCL_MAX_NCHANNELS).
    All calls of one PeerMemory must go to one stream at a time (its flags count calls in order).

    Every call starts with the ranks' kernels comparing the calls' signatures (signature.py): ranks that
    disagree, or one that refuses its input, make every rank's kernel stop before it writes any output and
    report to host memory, from where the next call (or ``raise_pending``) raises on every rank. (The
    pushed one-shots, and a two_shot right after a two_shot, push into the peers' shared buffers before they
    know: after a call that failed, what a shared buffer holds -- a ``buffer()`` input too -- is undefined;
    the raise queues a barrier, so an input written after it, on the same stream, stays as written, and
    puts one_shot_lamport's area back to its sentinel: _clean_after_failure.) A rank that
    never comes is given up on after ``timeout`` seconds; this PeerMemory is then unusable."""

    def __init__(self, mpi_comm, max_bytes: int = 64 << 20, *, blocks: int | None = None, timeout: float = 30.0):
        import cupy

        rt = cupy.cuda.runtime
        self.mpi = mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        node = mpi_comm.Split_type(_shared_type(), key=self.rank)
        one_node = node.Get_size() == self.size
        node.Free()
        if not all(mpi_comm.allgather(one_node)):
            raise ValueError("PeerMemory needs every rank on one node (CUDA IPC does not cross nodes)")
        if self.size > MAX_RANKS:
            raise ValueError(f"PeerMemory handles at most {MAX_RANKS} ranks, not {self.size}")
        self.device = cupy.cuda.Device().id
        multiprocessors = rt.getDeviceProperties(self.device)["multiProcessorCount"]
        # fewer: SMs left over. The same on every rank: block b meets only block b of its peers, and reads the
        # packs that their block b wrote (a rank with a larger grid would read slots nobody filled).
        self.max_blocks = min(mpi_comm.allgather(min(AGREE_SLOT, multiprocessors, blocks or multiprocessors)))
        line = 2 * PACK * LINE_PACKS * self.size      # (two_shot's two areas: p whole cache lines each, at least)
        self.nbytes = -(-int(max_bytes) // line) * line                 # two_shot, ring: the main area
        self.small = min(self.nbytes, SMALL_BYTES)                      # one_shot: 2 halves after it
        self.ll_bytes = min(self.small, LL_BYTES)                       # one_shot_ll: its area after those
        self.ll_slot_lines = 2 * self.ll_bytes // PACK                  # 16-byte lines per sender
        ll_area = 2 * self.size * self.ll_slot_lines * PACK
        self.lamport_bytes = min(self.small, LAMPORT_BYTES)             # one_shot_lamport: its area after that
        self.lamport_slot_packs = self.lamport_bytes // PACK
        self.lamport_area = (self.nbytes + 2 * self.small + ll_area, 2 * self.size * self.lamport_slot_packs * PACK)
        if len(set(mpi_comm.allgather((self.nbytes, self.small)))) != 1:  # (kernels write into peers' areas)
            raise ValueError("PeerMemory: every rank must pass the same max_bytes")
        flag_bytes = MAX_BLOCKS * MAX_RANKS * 4 + SIGNATURE_BYTES + MAX_BLOCKS * MAX_RANKS * 4  # (+ two_shot's
                                                                        #  first barriers: EARLY_FLAGS)
        self._shared_bytes = sum(self.lamport_area)
        self._own = allocate_everywhere(mpi_comm, [self._shared_bytes, flag_bytes], rt.malloc, rt.free,
                                        "PeerMemory")                           # (IPC exports whole allocations)
        rt.memset(self._own[1], 0, flag_bytes)
        rt.memset(self._own[0] + self.nbytes + 2 * self.small, 0, ll_area)   # flags 0: no call's yet
        rt.memset(self._own[0] + self.lamport_area[0], 0xFF, self.lamport_area[1])   # all "not yet landed"
        self.epochs = cupy.zeros(MAX_BLOCKS, dtype=cupy.uint32)      # barriers passed, per block (local)
        self._status_pointer = rt.hostAlloc(STATUS_WORDS * 4, 3)     # pinned, mapped (cudaHostAllocPortable | Mapped)
        self.status = np.ctypeslib.as_array((ctypes.c_uint32 * STATUS_WORDS).from_address(self._status_pointer))
        self.status[:] = 0
        self.broken: str | None = None                               # set when a peer never came
        # struct Control of kernels/agreement.cuh: calls | finished, verdict, timeout_cycles, status pointer,
        # failed | written, two_shot_call | unused. The timeout in SM cycles at the GPU's peak clock (kHz).
        cycles = int(timeout * 1e3 * rt.deviceGetAttribute(CLOCK_RATE_ATTRIBUTE, self.device))
        self.control = cupy.asarray(np.array([0, 0, cycles, self._status_pointer, 0, 0], dtype=np.uint64))
        cupy.cuda.Device().synchronize()
        handles = mpi_comm.allgather([rt.ipcGetMemHandle(p) for p in self._own])
        self._opened, data, flags = [], [], []
        for q, (data_handle, flag_handle) in enumerate(handles):
            if q == self.rank:
                pointers = self._own
            else:
                pointers = [rt.ipcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess)
                            for h in (data_handle, flag_handle)]
                self._opened += pointers
            data.append(pointers[0])
            flags.append(pointers[1])
        self._data, self._flags = data, flags
        self.data_pointers = cupy.asarray(np.array(data, dtype=np.uint64))   # bufs[q] in the kernels
        self.flag_pointers = cupy.asarray(np.array(flags, dtype=np.uint64))  # flags[q]
        self.programmatic = programmatic_launch_works()       # the next kernel starts as this one ends
        self.table = list(TABLE_FOR_RANKS.get(self.size, DEFAULT_TABLE))  # (bytes per rank up to, algorithm)
        self.everyone = np.uint32((1 << self.size) - 1)       # the bit mask of all ranks, for barrier()
        cupy.cuda.Device().synchronize()
        mpi_comm.Barrier()                                    # every flag array is zero before any kernel

    # ---- the shared buffer ------------------------------------------------------------------------------
    def buffer(self, count: int, dtype="float32"):
        """This rank's shared buffer as ``count`` elements: an input written here is not copied in. The buffer
        is also every other call's scratch space (the peers push into it): write the input just before the
        call that takes it, on the stream the calls run on, and read a result left here before the next call.
        two_shot and the ring then pull the inputs where they lie, so every rank's input of that call must
        lie in its buffer, or the ranks disagree (an error on every rank): a two_shot right after a two_shot
        pushes into the peers' buffers before the ranks meet, so a peer on a plain input may already be
        writing where this rank writes its input. (A call agreed beforehand, ``agreed=True``, copies it.)"""
        dtype = np.dtype(dtype)
        if count * dtype.itemsize > self.nbytes:
            raise ValueError(f"{count} x {dtype} do not fit the {self.nbytes}-byte peer buffers")
        return self.peer_buffer(self.rank, count, dtype)

    def peer_buffer(self, q: int, count: int, dtype="uint8", offset: int = 0):
        """Rank q's shared buffer (mapped here) as ``count`` elements from byte ``offset``."""
        import cupy

        dtype = np.dtype(dtype)
        memory = cupy.cuda.UnownedMemory(self.data_pointer(q), self.nbytes + 2 * self.small, self, self.device)
        return cupy.ndarray((count,), dtype, cupy.cuda.MemoryPointer(memory, offset))

    def queue_barrier(self) -> None:
        """Queue a barrier with every peer on the current stream: a kernel of one block that returns when
        all peers' streams have reached theirs (nothing waits on the host)."""
        kernel("flag_barrier")((1,), (32,), (self.flag_pointers, self.epochs, np.int32(self.rank), self.everyone,
                                             np.int32(BARRIER_SLOT)))

    def queue_timed_barrier(self, stream: int) -> None:
        """``queue_barrier`` on ``stream``, but a peer that never comes ends the wait after the timeout instead
        of leaving this GPU spinning: the next ``raise_pending()`` raises CommTimeoutError (and this PeerMemory
        is unusable from then on)."""
        self._barrier_on(stream)

    def _clean_after_failure(self, stream: int) -> None:
        """one_shot_lamport's area back to "not yet landed" everywhere after a failed call, whose pushes nobody
        read (kernels/one_shot_lamport.cu), then one more barrier: no peer pushes into it before that."""
        import cupy

        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.memsetAsync(self._own[0] + self.lamport_area[0], 0xFF, self.lamport_area[1], stream)
        self._barrier_on(stream)

    @property
    def buffer_address(self) -> int:
        """The device address of this rank's shared buffer (where ``buffer()`` starts)."""
        return self._own[0]

    def _is_buffer(self, a) -> bool:
        return a.data.ptr == self.buffer_address

    def _in_buffer(self, a) -> bool:
        """Whether ``a`` overlaps this rank's shared memory, where the peers write."""
        return self.overlaps(a.data.ptr, a.nbytes)

    def overlaps(self, pointer: int, nbytes: int) -> bool:
        """Whether ``nbytes`` from device address ``pointer`` overlap this rank's shared memory."""
        return pointer < self._own[0] + self._shared_bytes and self._own[0] < pointer + max(nbytes, 1)

    # ---- the all-reduce ---------------------------------------------------------------------------------
    def limit(self, algorithm: str) -> int:
        """The most bytes per rank ``algorithm`` takes (the one-shots stage in areas of their own; two_shot_lamport
        fills p slots of half one_shot_lamport's, and like every algorithm no more than the buffers hold)."""
        slots = self.size * self.lamport_slot_packs // 2 * PACK
        return {"one_shot": self.small, "one_shot_ll": self.ll_bytes, "one_shot_lamport": self.lamport_bytes,
                "two_shot_lamport": min(self.nbytes, slots)}.get(algorithm, self.nbytes)

    def choose(self, nbytes: int, element: str = "float") -> str:
        """What "auto" runs for ``nbytes`` per rank of ``element``s (peer_kernels.KERNEL_TYPES' values): the
        fastest measured at the nearest size at or above that its area takes (``tune`` measures them here;
        until then, the switch points measured on 4x H100, or on 2x H100 for two ranks). one_shot_lamport
        and two_shot_lamport where the table says so are one_shot_ll and two_shot for the types they cannot sum."""
        def takes(algorithm):
            if algorithm in LAMPORT_KERNELS and element not in LAMPORT_TYPES:
                return {"one_shot_lamport": "one_shot_ll", "two_shot_lamport": "two_shot"}[algorithm]
            return algorithm

        for upper, algorithm in self.table:
            if nbytes <= upper and nbytes <= self.limit(takes(algorithm)):   # (the one-shots' areas may be smaller)
                return takes(algorithm)
        last = takes(self.table[-1][1]) if self.table else "two_shot"
        return last if nbytes <= self.limit(last) else "two_shot"

    def allreduce(self, x, algorithm: str = "auto", out=None, *, bf16: bool = False, check: bool = True,
                  agreed: bool = False):
        """The sum over ranks of ``x`` (a contiguous CuPy array on this rank's GPU; ``bf16=True``: 16-bit
        integers holding bfloat16 bits), in ``out`` (new if None), bitwise identical on every rank, queued
        on the current stream. Collective. The kernel compares the ranks' arguments first (on the GPU);
        ``check`` waits for the kernel so that a disagreement raises here (else at the next call);
        ``agreed``: the caller has run the agreement already (tplab.collectives)."""
        import cupy

        problem = _problem(self, x, algorithm, out, bf16)
        if problem:
            if agreed:
                raise CollectiveArgumentError(f"peer all-reduce on rank {self.rank}: {problem}")
            self.refuse(problem)
        self.raise_pending()
        if out is None:
            out = cupy.empty_like(x)
        sig = AGREED_ALREADY if agreed else self.signature_of(x, algorithm, bf16)
        self._launcher(x, out, algorithm, bf16, fast=False, sig=sig)()   # (packing for cuLaunchKernel costs
        if check and not agreed:                                        #  more than it saves on one call)
            cupy.cuda.get_current_stream().synchronize()
            self.raise_pending()
        return out

    @staticmethod
    def signature_of(x, algorithm: str, bf16: bool = False, collective: str = "peer allreduce") -> int:
        return signature({"collective": collective, "shape": (x.size,), "algorithm": algorithm,
                          "dtype": "bfloat16" if bf16 else str(x.dtype)})

    def allreduce_init(self, x, out, algorithm: str = "auto", *, bf16: bool = False, fast: bool = True,
                       sig: int | None = None):
        """A persistent all-reduce (MPI 4's MPI_Allreduce_init): everything is worked out once, and the
        returned function only launches the kernel, summing whatever ``x`` holds into ``out``. For
        latency-bound loops and CUDA graphs. ``sig``: the signature the kernel compares across ranks
        (default: from count, dtype and algorithm). ``fast``: launch through cuLaunchKernel with the
        arguments packed once (CuPy's launcher otherwise)."""
        problem = _problem(self, x, algorithm, out, bf16)
        if problem:
            self.refuse(problem)
        sig = self.signature_of(x, algorithm, bf16) if sig is None else sig
        return self._launcher(x, out, algorithm, bf16, fast, sig)

    def _launcher(self, x, out, algorithm: str, bf16: bool, fast: bool, sig: int):
        """allreduce_init's function, for arguments already checked (_problem)."""
        import cupy

        element = "bf16_bits" if bf16 else type_name(x.dtype)
        if algorithm == "auto":
            algorithm = self.choose(x.nbytes, element)
        registered, staged = self._is_buffer(x), False
        if algorithm in ("two_shot", "ring") and registered:
            if sig == AGREED_ALREADY:             # (the peers chose their kernels without seeing this input:
                staged = True                     #  the same kernel as theirs, on a copy of it. Safe: a call
                                                  #  that agreed before never pushes first, nor lets the next)
            else:
                algorithm += "_pull"              # the input lies where the pushed slots would: pull it
        if algorithm.endswith("_pull") and registered and sig not in (AGREED_ALREADY, REFUSED):
            sig ^= PULLED                         # (a peer's kernel on a plain input meets its peers more often)
        if self.size == 1:
            return lambda: cupy.copyto(out, x)
        if x.size == 0:                           # nothing to add, but the ranks still meet
            return (lambda: self.launch_agreement(sig)) if sig != AGREED_ALREADY else (lambda: None)
        source, target = whole_packs(x), whole_packs(out)
        if staged:
            source = cupy.empty(-(-x.nbytes // PACK) * PACK, cupy.uint8)
            target = cupy.empty_like(source) if self._in_buffer(out) else target
        launch, blocks, threads, args = self.allreduce_kernel(source, target, algorithm, element, sig)
        if source is x and target is out:
            return ((fast and fast_launcher(launch, blocks, threads, args, programmatic=self.programmatic))
                    or (lambda: launch((blocks,), (threads,), args)))

        def padded():                                  # odd sizes or misaligned views: through copies
            if source is not x:
                source[: x.nbytes] = x.ravel().view(cupy.uint8)
            launch((blocks,), (threads,), args)
            if target is not out:
                out.ravel()[...] = target.view(out.dtype)[: out.size]
        return padded

    def allreduce_kernel(self, source, target, algorithm: str, element: str, sig: int):
        """(kernel, blocks, threads per block, arguments) of an all-reduce of ``source`` (whole 16-byte packs)
        into ``target`` by ``algorithm`` (not "auto"), summing ``element``s (peer_kernels.KERNEL_TYPES' values)."""
        packs = source.nbytes // PACK
        chunk = -(-packs // (self.size * LINE_PACKS)) * LINE_PACKS     # packs per chunk, whole cache lines
        if algorithm == "two_shot":                                    # two areas of p chunks: in rounds
            chunk = two_shot_chunk(packs, self.size, self.nbytes // PACK)
        work = packs if algorithm.startswith("one_shot") else chunk   # (two_shot_lamport: one chunk, p at a time)
        threads = block_threads(algorithm, work, self.max_blocks)
        blocks = max(1, min(self.max_blocks, -(-work // threads)))
        args = [source, target, self.data_pointers, self.flag_pointers, self.epochs,
                np.int32(self.rank), np.int32(self.size)]
        if algorithm == "one_shot":
            args += [np.int64(packs), np.int64(self.nbytes // PACK), np.int64(self.small // PACK)]
        elif algorithm == "one_shot_ll":
            args += [np.int64(packs), np.int64((self.nbytes + 2 * self.small) // PACK), np.int64(self.ll_slot_lines)]
        elif algorithm == "one_shot_lamport":
            args += [np.int64(packs), np.int64(self.lamport_area[0] // PACK), np.int64(self.lamport_slot_packs)]
        elif algorithm == "two_shot_lamport":                          # 2p slots per half: scatter, gather
            args += [np.int64(chunk), np.int64(packs), np.int64(self.lamport_area[0] // PACK),
                     np.int64(self.lamport_slot_packs // 2)]
        else:
            args += [np.int64(chunk), np.int64(packs)]
        if algorithm == "two_shot":                                    # its result slots: the second half
            args += [np.int64(self.nbytes // PACK // 2)]
        args += [self.control, np.uint64(sig)]
        return kernel(f"{algorithm}<{element}>"), blocks, threads, tuple(args)

    # ---- all-gather ----------------------------------------------------------------------------------------
    def allgather(self, x, out=None, *, check: bool = True):
        """Every rank's ``x`` (contiguous CuPy arrays of one size and dtype), concatenated in rank order:
        ``out`` has p·x.size elements. One kernel: copy x into the shared buffer, one barrier, read all
        peers at once, one barrier. Collective, queued on the current stream."""
        import cupy

        problem = ""
        if x.nbytes > self.nbytes:
            problem = f"{x.nbytes} bytes do not fit the {self.nbytes}-byte peer buffers"
        elif not x.flags.c_contiguous:
            problem = "peer all-gather needs a contiguous array"
        elif out is not None and (out.size != self.size * x.size or out.dtype != x.dtype or not out.flags.c_contiguous):
            problem = f"out must be {self.size * x.size} contiguous {x.dtype}, not {out.size} {out.dtype}"
        if problem:
            self.refuse(problem, "peer all-gather")
        self.raise_pending()
        sig = self.signature_of(x, "allgather", collective="peer allgather")
        out = cupy.empty(self.size * x.size, dtype=x.dtype) if out is None else out
        if x.size == 0:
            self.launch_agreement(sig)
            return out
        if self.size == 1:
            out.ravel()[...] = x.ravel()
            return out
        source = whole_packs(x)
        packs = source.nbytes // PACK
        direct = source is x and out.data.ptr % PACK == 0
        target = out if direct else cupy.empty(self.size * packs * PACK, dtype=cupy.uint8)
        blocks = max(1, min(self.max_blocks, -(-packs // THREADS)))
        kernel("allgather")((blocks,), (THREADS,), (source, target, self.data_pointers, self.flag_pointers,
                                                     self.epochs, np.int32(self.rank), np.int32(self.size),
                                                     np.int64(packs), self.control, np.uint64(sig)))
        if not direct:                                     # parts padded to whole packs: close the gaps
            flat = out.ravel().view(cupy.uint8)
            for q in range(self.size):
                flat[q * x.nbytes:(q + 1) * x.nbytes] = target[q * packs * PACK: q * packs * PACK + x.nbytes]
        if check:
            cupy.cuda.get_current_stream().synchronize()
            self.raise_pending()
        return out

    def allgather_torch(self, tensor, *, check: bool = False):
        """Every rank's ``tensor`` concatenated along dim 0 (torch CUDA tensors; any dtype), on torch's
        current stream: the ``gather`` of tplab.sequence (the course project's all-gather of K and V)."""
        import torch

        tensor = tensor.contiguous()
        out = torch.empty((self.size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        x = raw_bytes(tensor)
        with external_stream(torch.cuda.current_stream().cuda_stream):
            self.allgather(x, raw_bytes(out), check=check)
        return out

    def data_pointer(self, q: int) -> int:
        """The address of rank q's shared buffer, as mapped in this process (this rank's own for q = rank)."""
        return self._data[q]

    def barrier(self) -> None:
        """Host barrier: this GPU's queued work is done, and so is every other rank's."""
        import cupy

        cupy.cuda.Device().synchronize()
        self.mpi.Barrier()

    def allgather_object(self, obj) -> list:
        return self.mpi.allgather(obj)

    def tune(self, sizes=None, iters: int = 20, reps: int = 5, dtype="float32"):
        """Time the kernels that take any input (one_shot, two_shot, ring) at ``sizes`` (bytes per rank)
        here: ``iters`` persistent launches back to back between CUDA events, the median of ``reps`` such
        loops, the slowest rank's. "auto" then picks the fastest by size. Returns the timings (a DataFrame)."""
        import cupy
        import pandas as pd

        sizes = sizes or [1 << k for k in range(10, 29, 2) if (1 << k) <= self.nbytes]
        rows = []
        for nbytes in sizes:
            x = cupy.ones(nbytes // np.dtype(dtype).itemsize, dtype=dtype)
            out = cupy.empty_like(x)
            for algorithm in ("one_shot_ll", "one_shot_lamport", "one_shot", "two_shot_lamport", "two_shot", "ring"):
                if nbytes > self.limit(algorithm) or (algorithm in LAMPORT_KERNELS
                                                      and type_name(dtype) not in LAMPORT_TYPES):
                    continue
                run = self.allreduce_init(x, out, algorithm)
                for _ in range(3):
                    run()
                times = []
                for _ in range(reps):
                    start, end = cupy.cuda.Event(), cupy.cuda.Event()
                    start.record()
                    for _ in range(iters):
                        run()
                    end.record()
                    end.synchronize()
                    times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / iters)
                rows.append({"size": nbytes, "algorithm": algorithm,
                             "time_us": max(self.mpi.allgather(float(np.median(times))))})
        table = pd.DataFrame(rows)
        best = table.loc[table.groupby("size")["time_us"].idxmin()].sort_values("size")
        self.table = list(zip(best["size"], best["algorithm"]))
        return table

    def close(self) -> None:
        """Collective: unmap the peers' buffers, free this rank's."""
        import cupy

        rt = cupy.cuda.runtime
        cupy.cuda.Device().synchronize()                      # (a failed call's status is written by its kernel)
        if self._own and self.status[0] and not self.broken:  # a failure this rank has not raised: its peers
            self._take_status()                                #  queued a barrier when they raised theirs
            cupy.cuda.Device().synchronize()
        self.mpi.Barrier()                                    # nobody reads our memory any more
        for pointer in self._opened:
            rt.ipcCloseMemHandle(pointer)
        # Every peer unmaps ours before it is freed: freeing memory that another process still has open is
        # undefined (cudaIpcCloseMemHandle's documentation), and the next allocation here may reuse it.
        self.mpi.Barrier()
        for pointer in self._own:
            rt.free(pointer)
        self._opened, self._own = [], []
        if self._status_pointer:
            self.status = np.zeros(STATUS_WORDS, dtype=np.uint32)   # (nothing reads the freed memory)
            rt.freeHost(self._status_pointer)
            self._status_pointer = 0


def allocate_everywhere(mpi_comm, sizes, malloc, free, what: str) -> list:
    """``malloc(n)`` for each of ``sizes`` on every rank of ``mpi_comm``, or, where any rank could not (out of
    memory), nothing kept and the same MemoryError on every rank: a rank that raised alone would leave its
    peers waiting in the exchange of handles that follows. Collective."""
    got, problem = [], ""
    try:
        for n in sizes:
            got.append(malloc(n))
    except Exception as error:  # (CUDA's out of memory, typically: CuPy raises its own error type)
        problem = f"{type(error).__name__}: {error}"
    problems = mpi_comm.allgather(problem)
    failed = [q for q, said in enumerate(problems) if said]
    if failed:
        for pointer in got:
            free(pointer)
        q = failed[0]
        raise MemoryError(f"{what} on rank {mpi_comm.Get_rank()}: rank {q} could not allocate its "
                          f"{sum(sizes)} bytes ({problems[q]})")
    return got


def block_threads(algorithm: str, work: int, max_blocks: int) -> int:
    """Threads per block of an all-reduce kernel whose blocks share ``work`` packs (each block handles the
    same packs on every rank): one_shot_ll's LL_THREADS; one_shot_lamport's LAMPORT_THREADS, doubled from the
    first to the second while the grid would need more than ``max_blocks``; the two-shots' THREADS, halved down
    to MIN_THREADS while the grid would leave multiprocessors idle (pushes and pulls over NVLink are limited by
    how many SMs issue them); THREADS."""
    if algorithm == "one_shot_ll":
        return LL_THREADS
    if algorithm in LAMPORT_KERNELS:
        threads, most = LAMPORT_THREADS
        while threads < most and -(-work // threads) > max_blocks:
            threads *= 2
        return threads
    threads = THREADS
    if algorithm not in ("two_shot", "two_shot_pull"):   # (one_shot measured slower with smaller blocks on 2 GPUs)
        return threads
    while threads > MIN_THREADS and -(-work // threads) < max_blocks:
        threads //= 2
    return threads


def two_shot_chunk(packs: int, p: int, area_packs: int) -> int:
    """two_shot's packs per chunk (whole cache lines): its buffer holds two areas of p chunks (the partial
    sums it receives, the results), so an input of more than half the buffer goes through in rounds of
    p chunks, as few rounds as fit and chunks as equal as cache lines allow."""
    most = area_packs // (2 * p * LINE_PACKS) * LINE_PACKS            # the largest chunk that fits
    rounds = -(-packs // (p * most))
    per_round = -(-packs // rounds)
    return -(-per_round // (p * LINE_PACKS)) * LINE_PACKS


def _problem(pm: PeerMemory, x, algorithm: str, out, bf16: bool) -> str:
    """What is wrong with these arguments on this rank ('' if nothing)."""
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        return f"unknown algorithm {algorithm!r}; choose one of {ALGORITHMS + ('auto',)}"
    if bf16 and x.dtype.itemsize != 2:
        return f"bf16=True needs 16-bit integers holding bfloat16 bits, not {x.dtype}"
    if not bf16:
        try:
            type_name(x.dtype)
        except TypeError as e:
            return str(e)
    if x.nbytes > pm.nbytes:
        return f"{x.nbytes} bytes do not fit the {pm.nbytes}-byte peer buffers"
    if not x.flags.c_contiguous or (out is not None and not out.flags.c_contiguous):
        return "peer all-reduce needs contiguous arrays"
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        return f"out is {out.shape} {out.dtype}, x is {x.shape} {x.dtype}"
    if pm._in_buffer(x) and not pm._is_buffer(x):          # (the peers write into the rest of it)
        return "x may lie in the shared buffer only from its start (PeerMemory.buffer)"
    if out is not None and pm._in_buffer(out) and not (pm._is_buffer(out) and pm._is_buffer(x)):
        return "out may lie in the shared buffer only as x itself, in place (PeerMemory.buffer)"
    if x.device.id != pm.device:
        return f"x is on GPU {x.device.id}, this rank's peer memory on GPU {pm.device}"
    element = "bf16_bits" if bf16 else type_name(x.dtype)
    chosen = pm.choose(x.nbytes, element) if algorithm == "auto" else algorithm
    if chosen in LAMPORT_KERNELS and element not in LAMPORT_TYPES:
        return f"{chosen} sums float32, bfloat16 and float16 only (its sentinel is a NaN of theirs)"
    if x.nbytes > pm.limit(chosen):
        return f"{chosen} handles up to {pm.limit(chosen)} bytes, not {x.nbytes}: use two_shot or ring"
    return ""


def _shared_type():
    from mpi4py import MPI

    return MPI.COMM_TYPE_SHARED
