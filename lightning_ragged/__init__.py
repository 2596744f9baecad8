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

__all__ = [
    "DBufferAlignmentError",
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
