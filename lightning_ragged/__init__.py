"""lightning_ragged: veScale-style FSDP with ragged, structure-aware shards for PyTorch Lightning."""

from lightning_ragged.errors import DBufferAlignmentError, RaggedShardBoundaryViolation
from lightning_ragged.fsdp import (
    fully_shard,
    full_state_dict,
    get_state,
    load_full_state_dict,
    no_sync,
    set_requires_gradient_sync,
)
from lightning_ragged.planning import Layout, TensorSpec, plan
from lightning_ragged.ragged_shard import RaggedShard
from lightning_ragged.wrapper import FullyShardedDataParallel

__all__ = [
    "DBufferAlignmentError",
    "FullyShardedDataParallel",
    "Layout",
    "RaggedShard",
    "RaggedShardBoundaryViolation",
    "TensorSpec",
    "full_state_dict",
    "fully_shard",
    "get_state",
    "load_full_state_dict",
    "no_sync",
    "plan",
    "set_requires_gradient_sync",
]
