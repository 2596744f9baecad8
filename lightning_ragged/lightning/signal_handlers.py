"""A callback's flag-only method in place of one of Lightning's signal handlers, and the agreement on its flag.

Lightning's ``_SignalConnector.register_signal_handlers`` (run right after the strategy's ``setup``)
composes the bound methods it finds on the connector, so replacing one on *this* Trainer's
connector changes what that signal does here and nowhere else; no class is patched. The flag is
then agreed on at a batch end by :func:`any_rank`, so every rank acts at the same batch.
"""

from __future__ import annotations

from typing import Optional, TypeVar

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

import lightning.pytorch as pl

C = TypeVar("C")


def install(trainer: pl.Trainer, handler_name: str, callback_type: type[C], without_it: str) -> Optional[C]:
    """This Trainer's ``callback_type`` callback (added once) with its ``handle_signal`` as ``handler_name``.

    ``None``, with a warning ending in ``without_it``, when this Lightning version has no such handler.
    """
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None or not hasattr(connector, handler_name):
        rank_zero_warn(f"lightning_ragged: this Lightning version has no `_SignalConnector.{handler_name}`; {without_it}")
        return None
    callback = next((cb for cb in trainer.callbacks if isinstance(cb, callback_type)), None)
    if callback is None:
        callback = callback_type()
        trainer.callbacks.append(callback)
    callback._trainer = trainer
    setattr(connector, handler_name, callback.handle_signal)
    return callback


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is set on any rank: one all-reduce every rank enters at the same point (none at world 1).

    Not ``strategy.reduce_boolean_decision``, which adds a barrier before its all-reduce.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    tensor = torch.tensor([int(flag)], device=device)
    dist.all_reduce(tensor)
    return bool(tensor.item())
