"""A callback's flag-only method in place of one of Lightning's signal handlers, for one Trainer.

Lightning's ``_SignalConnector.register_signal_handlers`` (run right after the strategy's ``setup``)
composes the bound methods it finds on the connector, so replacing one on *this* Trainer's
connector changes what that signal does here and nowhere else; no class is patched.
"""

from __future__ import annotations

from typing import Optional, TypeVar

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
