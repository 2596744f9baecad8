"""Checkpoints from Lightning's exception path only when every rank is on it.

A rank that raises alone (a bug, a bad batch, an out-of-memory on one device) runs the
``on_exception`` callbacks (``OnExceptionCheckpoint``) while the others wait inside a collective
of the training step. A sharded save is collective, so it would hang every rank until the
process-group timeout (30 minutes by default) and hide the error (Lightning #6430). Before the
checkpoint callbacks run, each rank handling an exception checks, on a gloo group of its own
with a bounded wait, that all ranks are handling one (``dist.monitored_barrier``). If some are
not, this rank's saves and barriers are skipped with a warning naming them, and the exception
propagates: the process exits, the waiting ranks' collectives fail, and they take the same path.
When every rank raised (Ctrl+C, the same error everywhere) the checkpoint is written as usual.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

if TYPE_CHECKING:
    import lightning.pytorch as pl

AGREEMENT_TIMEOUT = timedelta(seconds=60)
"""How long a rank handling an exception waits for the others (at most the process-group timeout)."""

_GROUPS: dict[int, dist.ProcessGroup] = {}
"""The agreement's gloo group, per default process group (built once, at a run's setup)."""


def agreement_group(timeout: timedelta) -> Optional[dist.ProcessGroup]:
    """The gloo group the agreement runs on (collective the first time: every rank builds it at setup).

    Its own ``timeout`` bounds the wait on every rank (``monitored_barrier``'s only bounds rank 0's).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    key = id(dist.distributed_c10d._get_default_group())
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend="gloo", timeout=timeout)
    return _GROUPS[key]


class ExceptionAgreement(Callback):
    """Runs first among ``on_exception`` callbacks; sets ``strategy.alone_in_exception`` where ranks disagree."""

    def __init__(self, timeout: Optional[timedelta]) -> None:
        self.timeout = min(timeout, AGREEMENT_TIMEOUT) if timeout is not None else AGREEMENT_TIMEOUT
        self.group = agreement_group(self.timeout)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if self.group is None:
            return
        try:
            dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as error:
            trainer.strategy.alone_in_exception = True
            print(
                f"[rank {dist.get_rank()}] RaggedFSDPStrategy: {type(exception).__name__} on this rank, but not every "
                f"rank is handling an exception (waited at most {self.timeout.total_seconds():.0f} s: {error}); checkpoints "
                "from on_exception callbacks (OnExceptionCheckpoint) are skipped: a sharded save needs every rank. "
                "The exception is re-raised; the other ranks stop when this process exits. The last completed "
                "checkpoint stays valid.",
                file=sys.stderr,
                flush=True,
            )


def add_exception_agreement(trainer: "pl.Trainer", timeout: Optional[timedelta]) -> None:
    """Put one :class:`ExceptionAgreement` first in the Trainer's callbacks (before the checkpoint callbacks)."""
    trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, ExceptionAgreement)]
    trainer.callbacks.insert(0, ExceptionAgreement(timeout))

