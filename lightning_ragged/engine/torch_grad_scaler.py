"""torch's ``GradScaler`` on sharded parameters: every rank skips a step when any rank found an inf, as on FSDP2.

``scaler.step(optimizer)`` unscales the gradients and skips ``optimizer.step()`` when one holds an
inf or NaN. FSDP2's DTensor gradients make that check global; our shards' gradients are each rank's
part, so only the rank holding an overflowed element skipped the step and halved its scale while
the others stepped: weights and scales drifted apart, silently (measured: scales 128 and 256, 2.1e-2
from DDP after 3 steps). Once a model is sharded in this process, ``GradScaler.unscale_`` (torch's,
then) sums each device's found-inf flag over the shard groups of the optimizer's sharded parameters:
one all-reduce per step, what torch's ``ShardedGradScaler`` (its own ``unscale_``, left alone) does.
An optimizer without sharded parameters gets torch's function, untouched.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_TORCH_UNSCALE = torch.amp.GradScaler.unscale_


def route_grad_scaler() -> None:
    """Once per process: ``GradScaler.unscale_`` agrees on found infs over the shard groups."""
    if torch.amp.GradScaler.unscale_ is _TORCH_UNSCALE:
        torch.amp.GradScaler.unscale_ = _unscale_


def _unscale_(self: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    _TORCH_UNSCALE(self, optimizer)
    found = self._per_optimizer_states[id(optimizer)].get("found_inf_per_device", {})
    groups: dict[int, Any] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            shard = getattr(param, "ragged_shard", None)
            if shard is not None and dist.is_initialized():
                process_group = shard.process_group or dist.group.WORLD  # None: the default group
                groups.setdefault(id(process_group), process_group)
    for process_group in groups.values():
        if dist.get_world_size(process_group) > 1:
            for flag in found.values():
                dist.all_reduce(flag, group=process_group)
