"""Optimizer parameter groups chosen by shape on sharded parameters: warned about, since shards are 1-D.

FSDP2's parameters are DTensors of the global shape, so groups built with ``p.dim() >= 2``
(nanoGPT's weight decay, timm's ``param_groups_weight_decay``) split the matrices from the
vectors. A lightning_ragged shard is a 1-D view of this rank's part: every such test says
"vector", so every parameter lands in the no-decay group and the decay group stays empty,
silently. That is the signature looked for: an empty group with weight decay beside a group
without weight decay holding trainable shards of matrices. A split that drops its empty groups
leaves no trace to find (the README says so).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def warn_shape_chosen_groups(optimizer: torch.optim.Optimizer) -> None:
    """Warn (rank 0) when ``optimizer``'s groups look like a weight-decay split made with ``p.dim()`` on shards."""
    groups = optimizer.param_groups
    empty = [index for index, group in enumerate(groups) if not group["params"] and group.get("weight_decay", 0)]
    undecayed = [
        shard for group in groups if not group.get("weight_decay", 0) for p in group["params"]
        if p.requires_grad and (shard := getattr(p, "ragged_shard", None)) is not None and len(shard.global_shape) >= 2
    ]
    if not empty or not undecayed or (dist.is_initialized() and dist.get_rank() != 0):
        return
    example = undecayed[0]
    warnings.warn(
        f"{type(optimizer).__name__}'s parameter group(s) {empty} have weight decay but no parameters, while "
        f"{len(undecayed)} matrices (tensors of 2+ dimensions, e.g. {example.name!r}, shape "
        f"{tuple(example.global_shape)}) sit in a group without weight decay. A lightning_ragged shard is a 1-D view "
        "of this rank's part, so a split made with p.dim() / p.ndim / p.shape puts every parameter in the no-decay "
        "group. Choose by len(p.ragged_shard.global_shape) >= 2 or by name instead",
        stacklevel=2,
    )
