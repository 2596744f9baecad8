"""What an optimizer needs to know about one parameter: its local flat shard and its ragged layout.

Parameters sharded by ``lightning_ragged.fully_shard`` are 1-D views carrying
``param.ragged_shard``; plain (unsharded) tensors are treated as a one-rank shard that
holds the whole parameter, so every optimizer here also runs without FSDP.
"""

from __future__ import annotations

import torch

from lightning_ragged.layout.ragged_shard import RaggedShard


def shard_of(param: torch.Tensor, name: str | None = None) -> RaggedShard:
    """``param.ragged_shard``, or a single-rank description of a plain tensor."""
    shard = getattr(param, "ragged_shard", None)
    if shard is not None:
        return shard
    numel = param.numel()
    return RaggedShard(name or "<unnamed>", param.shape, max(numel, 1), ((0, numel),), 0, None)


def local_flat(tensor: torch.Tensor) -> torch.Tensor:
    """The flat local view of a parameter or gradient (sharded ones already are 1-D)."""
    return tensor if tensor.dim() == 1 else tensor.view(-1)

