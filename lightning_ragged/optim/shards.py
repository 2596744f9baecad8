"""An optimizer's view of one parameter: its local flat shard.

Parameters sharded by ``lightning_ragged.fully_shard`` are 1-D views carrying
``param.ragged_shard``; plain (unsharded) tensors are seen flattened, as a one-rank shard
that holds the whole parameter (``layout.ragged_shard.shard_of``), so every optimizer here
also runs without FSDP.
"""

from __future__ import annotations

import torch


def local_flat(tensor: torch.Tensor) -> torch.Tensor:
    """The flat local view of a parameter or gradient (sharded ones already are 1-D)."""
    return tensor if tensor.dim() == 1 else tensor.view(-1)

