"""Optimizer parameter groups chosen by shape on sharded parameters: warned about, since shards are 1-D.

FSDP2's parameters are DTensors of the global shape, so groups built with ``p.dim() >= 2``
(nanoGPT's weight decay, timm's ``param_groups_weight_decay``) split the matrices from the
vectors. A lightning_ragged shard is a 1-D view of this rank's part: every such test says
"vector", so every parameter lands in one group and the other stays empty, silently (no weight
decay at all). An empty group in an optimizer that holds shards of matrices is that signature.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def warn_shape_chosen_groups(optimizer: torch.optim.Optimizer) -> None:
    """Warn (rank 0) when ``optimizer`` has an empty parameter group beside shards of tensors of 2+ dimensions."""
    empty = [index for index, group in enumerate(optimizer.param_groups) if not group["params"]]
    shards = [getattr(p, "ragged_shard", None) for group in optimizer.param_groups for p in group["params"]]
    matrices = [shard for shard in shards if shard is not None and len(shard.global_shape) >= 2]
    if not empty or not matrices or (dist.is_initialized() and dist.get_rank() != 0):
        return
    example = matrices[0]
    warnings.warn(
        f"{type(optimizer).__name__}'s parameter group(s) {empty} are empty while it holds lightning_ragged shards "
        f"of {len(matrices)} tensors with 2 or more dimensions (e.g. {example.name!r}, shape "
        f"{tuple(example.global_shape)}). A sharded parameter is a 1-D view of this rank's part, so groups chosen by "
        "p.dim() / p.ndim / p.shape (weight decay on matrices only) put every parameter in one group. Choose by "
        "p.ragged_shard.global_shape (len(...) >= 2) or by name instead",
        stacklevel=3,
    )
