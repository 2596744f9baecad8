"""torch optimizers that need whole tensors, refused on shards with the reason and a fix.

A shard is this rank's 1-D part of a parameter. torch's ``LBFGS`` takes dot products and line-search
steps over the whole gradient: on shards every rank would pick its own step (measured: 0.2 relative
from DDP after 3 steps, silently). ``Adafactor`` factors each matrix's second moment by rows and
columns, and divided by zero on a rank's empty part. A check before optimizer steps (installed by the
first ``fully_shard``, ``optimizer_checks.py``) refuses a step of either holding sharded parameters,
naming the fix. (torch's ``Muon``
refuses 1-D shards itself, when it is built: use ``lightning_ragged.optim.Muon``.)
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.optim import Optimizer

from lightning_ragged.engine.optimizer_checks import check_before_steps

_WHY: dict[str, tuple[str, bool]] = {
    "LBFGS": ("takes dot products and line-search steps over whole gradients: on shards every rank would pick its "
              "own step. Train with DDP (or one process) for LBFGS", True),
    "Adafactor": ("factors each matrix's second moment by its rows and columns, and a shard is this rank's 1-D part. "
                  "Use torch.optim.AdamW or lightning_ragged.optim.AdamW8bit", False),
}
"""torch optimizer class name -> (why and what instead, refused only when a shard group has several ranks)."""

def refuse_whole_tensor_optimizers() -> None:
    """Once per process: check optimizers before their steps."""
    check_before_steps(_refuse)


def _refuse(optimizer: Optimizer) -> None:
    kind = type(optimizer)
    if kind.__module__.startswith("torch.optim") and kind.__name__ in _WHY:
        why, across_ranks_only = _WHY[kind.__name__]
        shards = [p.ragged_shard for group in optimizer.param_groups for p in group["params"]
                  if getattr(p, "ragged_shard", None) is not None]
        if shards and (not across_ranks_only or any(_ranks(shard.process_group) > 1 for shard in shards)):
            raise ValueError(
                f"torch.optim.{kind.__name__} cannot train parameters lightning_ragged.fully_shard sharded "
                f"(e.g. {shards[0].name!r}, shape {tuple(shards[0].global_shape)}): it {why}"
            )


def _ranks(process_group: Any) -> int:
    return dist.get_world_size(process_group) if dist.is_initialized() else 1
