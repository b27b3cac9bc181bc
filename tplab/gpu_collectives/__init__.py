"""tplab.gpu_collectives — whole collectives as GPU kernels of tplab's own (one node, one process per GPU).

Not the wire (that is tplab.comm) and not algorithms over send/recv (tplab.collectives): each all-reduce
here is one kernel, or a few copy-engine copies, that moves and sums the data itself through memory the
GPUs share (CUDA IPC over NVLink).

    peer_memory.py      PeerMemory: shared buffers and flags; one_shot / two_shot / ring all-reduce kernels
    peer_agreement.py   the agreement every call starts with, and a failed one's error on every rank (the
                        host's side); the flags area's layout
    kernels/            the kernels, one concept per file (compiled at first use as one source, NVRTC through CuPy)
    peer_alltoall.py    peer_alltoall: each rank writes each destination's block into that peer's buffer
    peer_kernels.py     compiling, launching (cuLaunchKernel, arguments packed once), torch <-> CuPy views
    signature.py        a call's arguments in 64 bits, compared by the kernels before they touch data
    peer_comm.py        PeerMemoryComm: a Communicator (NCCL inside) whose own all-reduce is the kernels,
                        with per-kind-of-tensor plans: tplab.allreduce at the kernel's cost
    copy_engine.py      CopyEngineComm: an all-reduce whose bytes move by the copy engines (no SMs)
    copy_engine_exchange.py  CopyEngineExchange: token shards pulled and partial sums pushed by the copy
                        engines, for GEMMs that consume them as they land (tplab.overlap.async_tp)
    copy_engine_calls.py     its calls' handles: a gather's shards as they land, a scatter's pushes
    matmul_allgather.py MatmulAllGather: a Triton GEMM whose epilogue writes each output tile into every rank's
                        memory (TMA stores over NVLink): an all-gather run under the GEMM (tplab.sequence.FusedKV)

CuPy (and Triton) are imported only when one of them is made.
"""

from tplab.gpu_collectives.peer_comm import PeerMemoryComm

__all__ = ["PeerMemoryComm"]
