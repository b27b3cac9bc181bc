"""Fewer synchronisations: the student project's TP, SPD and parallel blocks as tensor-parallel modules.

    ranks.py           SimulatedRanks(p) (all shards in this process) / RealRanks(comm) (one per MPI rank)
    shard.py           BlockShard (one rank's heads and MLP columns) and what the blocks share
    tp_block.py        TPBlock: Megatron's block, 2 all-reduces per forward (exactly the unsplit block)
    spd_block.py       SPDBlock: the attention's all-reduce merged into the MLP's, 1 per forward
    parallel_block.py  UnsyncedBlock (the project's Parallel_Block) / ParallelRun: no sync inside a run, 1 at its end
    model.py           FewerSyncsGPT from a block pattern; PATTERNS; syncs_per_forward (the formula)
    train.py           nanoGPT's shakespeare_char training loop for any pattern, simulated or real ranks
    comm_time.py       communication time per step on real ranks and on an emulated slow network
"""

from tplab.fewer_syncs.model import (
    BLOCK_TYPES,
    PATTERNS,
    PROJECT_SYNC_COUNTS,
    FewerSyncsGPT,
    dense_gpt,
    stages_of,
    syncs_per_forward,
    weight_grad_syncs,
)
from tplab.fewer_syncs.parallel_block import ParallelRun, UnsyncedBlock
from tplab.fewer_syncs.ranks import RealRanks, SimulatedRanks
from tplab.fewer_syncs.shard import BlockShard
from tplab.fewer_syncs.spd_block import SPDBlock
from tplab.fewer_syncs.tp_block import TPBlock
from tplab.fewer_syncs.train import TrainConfig, learning_rate, train

__all__ = [
    "BLOCK_TYPES",
    "PATTERNS",
    "PROJECT_SYNC_COUNTS",
    "BlockShard",
    "FewerSyncsGPT",
    "ParallelRun",
    "RealRanks",
    "SPDBlock",
    "SimulatedRanks",
    "TPBlock",
    "TrainConfig",
    "UnsyncedBlock",
    "dense_gpt",
    "learning_rate",
    "stages_of",
    "syncs_per_forward",
    "train",
    "weight_grad_syncs",
]
