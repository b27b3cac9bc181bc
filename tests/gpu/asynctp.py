"""What the async-TP GPU tests share (test_gpu_async_tp.py, test_gpu_async_tp_graphs.py): one NCCL
communicator for the plain blocks, a small block split p ways, and whole inputs the same on every rank.
Import it after gputest.require_gpu()."""

import cupy
import torch
from mpitest import COMM

from tplab.comm import nccl_world
from tplab.models import GPT, GPTConfig
from tplab.models.parallel import ParallelBlock

P, R = COMM.size, COMM.rank
NCCL = nccl_world()
torch.cuda.set_device(cupy.cuda.Device().id)
DEVICE = torch.device("cuda", torch.cuda.current_device())
SEQ, BATCH, HIDDEN = 6 * P, 3, 16 * P
SHARD_BYTES = SEQ // P * BATCH * HIDDEN * 8   # one float64 shard


def block(seed=0, dtype=torch.float64, **config):
    """A GPT block (or another configuration of tplab's GPT) split over the P ranks, on this rank's GPU."""
    torch.manual_seed(seed)
    settings = dict(vocab_size=8, n_layer=1, n_head=2 * P, n_embd=HIDDEN, block_size=SEQ) | config
    return ParallelBlock(GPT(GPTConfig(**settings)).to(dtype).blocks[0], NCCL).to(DEVICE)


def whole_input(seed, dtype=torch.float64):
    """(BATCH, SEQ, HIDDEN), the same on every rank for one seed."""
    return torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(DEVICE)
