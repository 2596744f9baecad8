"""A callback's flag-only method in place of one of Lightning's signal handlers, and the agreement on its flag.

Lightning's ``_SignalConnector.register_signal_handlers`` (run right after the strategy's ``setup``)
composes the bound methods it finds on the connector, so replacing one on *this* Trainer's
connector changes what that signal does here and nowhere else; no class is patched. The flags are
then agreed on at a batch end by :class:`SignalFlags` (one CPU all-reduce for all of them), so every
rank acts at the same batch.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

import lightning.pytorch as pl
from lightning_ragged.checkpoint.timeout import group_timeout
from lightning_ragged.lightning.side_groups import gloo_group

C = TypeVar("C")


def install(
    trainer: pl.Trainer, handler_name: str, callback_type: type[C], flag: Callable[[C], bool], without_it: str
) -> Optional[C]:
    """This Trainer's ``callback_type`` callback (added once) with its ``handle_signal`` as ``handler_name``.

    ``flag(callback)`` is registered with the Trainer's :class:`SignalFlags` (added once) under
    ``handler_name``. ``None``, with a warning ending in ``without_it``, when this Lightning version
    has no such handler.
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
    flags(trainer).sources[handler_name] = lambda: flag(callback)
    return callback


def flags(trainer: pl.Trainer) -> SignalFlags:
    """This Trainer's :class:`SignalFlags` (added to its callbacks the first time)."""
    found = next((cb for cb in trainer.callbacks if isinstance(cb, SignalFlags)), None)
    if found is None:
        found = SignalFlags()
        trainer.callbacks.append(found)
    return found


class SignalFlags(Callback):
    """This Trainer's signal flags (SIGTERM, the SLURM requeue signal), agreed in one all-reduce per batch end.

    Each flag-only handler's callback registers its flag (:func:`install`, at the strategy's setup: the
    same order on every rank); at a batch end the first :meth:`agreed` reduces all of them at once and
    the others read the result, until the next batch starts. The flags travel as a CPU tensor on a gloo
    group (:func:`flag_group`): no copy to the device and no host-device sync per batch on NCCL, where
    a device all-reduce plus ``.item()`` would stop the CPU from running ahead at every batch.
    """

    def __init__(self) -> None:
        self.sources: dict[str, Callable[[], bool]] = {}
        self.reductions = 0  # all-reduces issued (for tests and logs)
        self._agreed: Optional[dict[str, bool]] = None
        self._group = flag_group()

    def agreed(self, name: str) -> bool:
        """Whether the flag ``name`` is set on any rank, as of this batch end (every rank gets the same answer)."""
        if self._agreed is None:
            names = list(self.sources)
            values = [bool(self.sources[each]()) for each in names]
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                tensor = torch.tensor(values, dtype=torch.int32)
                dist.all_reduce(tensor, group=self._group)
                values = [bool(value) for value in tensor.tolist()]
                self.reductions += 1
            self._agreed = dict(zip(names, values))
        return self._agreed[name]

    def _next_batch(self, *args: Any, **kwargs: Any) -> None:
        self._agreed = None

    on_train_batch_start = on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _next_batch


def flag_group() -> Optional[dist.ProcessGroup]:
    """The group the flags are reduced on: the default one if it takes CPU tensors (gloo), else a gloo group.

    Built once per default group, at setup (collective: every rank's strategy builds it there), with the
    default group's timeout: a rank may reach a batch end long after another (rank-0-only work).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if "gloo" in str(dist.get_backend()):
        return None
    return gloo_group("signal flags", group_timeout())
