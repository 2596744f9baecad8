"""Lightning's ``BaseFinetuning`` (``BackboneFinetuning``, freeze/unfreeze callbacks) on sharded parameters.

Two things in Lightning's callback assume whole parameters or DDP's restore order:

* ``BaseFinetuning.filter_on_optimizer`` asks whether a parameter is already in the optimizer with
  ``torch.equal`` (values, not identity). Shards are 1-D slices, so an empty shard equals every other
  empty shard and two zero-filled bias shards of one length equal each other: on some ranks a
  parameter was "found" and left out of the new group, so ranks built different groups (different
  callback state, learning-rate logs, a full checkpoint one process could not load).
  :func:`compare_shards_by_identity` makes the check identity for shards (unchanged for others).
* The callback rebuilds the groups it added in ``on_fit_start`` from its restored state. This strategy
  restores the checkpoint after setup (the model must be sharded first), which Lightning runs after
  ``on_fit_start``, so the groups were missing when the optimizer states loaded ("holds optimizer state
  for parameters the optimizer does not have"). :func:`restore_finetuning_groups` rebuilds them just
  before the optimizer states load, DDP's order, and takes the state out of what Lightning restores
  afterwards (it would mark the callback restarting again).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.utilities import rank_zero_warn

import lightning.pytorch as pl

_original_filter = BaseFinetuning.filter_on_optimizer


def _filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Iterable) -> list:
    params = list(params)
    if not any(hasattr(p, "ragged_shard") for p in params):
        return _original_filter(optimizer, params)
    present = {id(p) for group in optimizer.param_groups for p in group["params"]}
    kept = [p for p in params if id(p) not in present]
    if len(kept) < len(params):
        rank_zero_warn("The provided params to be frozen already exist within another group of this optimizer. "
                       "Those parameters will be skipped.")  # Lightning's warning, less its hint
    return kept


def compare_shards_by_identity() -> None:
    """Point ``BaseFinetuning.filter_on_optimizer`` at an identity check for shards (idempotent, process-wide:
    a call without shards runs Lightning's own check)."""
    BaseFinetuning.filter_on_optimizer = staticmethod(_filter_on_optimizer)


def restore_finetuning_groups(trainer: "pl.Trainer", module: "pl.LightningModule", checkpoint: dict[str, Any]) -> None:
    """Give every ``BaseFinetuning`` callback its saved state and let it rebuild its parameter groups now,
    before the optimizer states load; its state is then removed from ``checkpoint["callbacks"]``."""
    saved = checkpoint.get("callbacks") or {}
    for callback in trainer.callbacks:
        if isinstance(callback, BaseFinetuning):
            key = callback.state_key if callback.state_key in saved else callback._legacy_state_key
            if saved.get(key):
                callback.load_state_dict(saved.pop(key))
                BaseFinetuning.on_fit_start(callback, trainer, module)  # the rebuild only, not a subclass's extras
