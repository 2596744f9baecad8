"""An optimizer's view of one parameter: its local flat shard.

Parameters sharded by ``lightning_ragged.fully_shard`` are 1-D views carrying
``param.ragged_shard``; plain (unsharded) tensors are seen flattened, as a one-rank shard
that holds the whole parameter (``layout.ragged_shard.shard_of``), so every optimizer here
also runs without FSDP.
"""

from __future__ import annotations

import torch

from lightning_ragged.layout.ragged_shard import RaggedShard


def local_flat(tensor: torch.Tensor) -> torch.Tensor:
    """The flat local view of a parameter or gradient (sharded ones already are 1-D)."""
    return tensor if tensor.dim() == 1 else tensor.view(-1)


def shard_group_key(shard: RaggedShard) -> tuple[int, int]:
    """The shard group a parameter's pieces are spread over: its process group and size (a plain tensor is a
    one-rank shard whose group, ``None``, is also how the default process group is named)."""
    return id(shard.process_group), shard.world_size
