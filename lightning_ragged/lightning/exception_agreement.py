"""Checkpoints from Lightning's exception path only when every rank is on it.

A rank that raises alone (a bug, a bad batch, an out-of-memory on one device) runs the
``on_exception`` callbacks (``OnExceptionCheckpoint``) while the others wait inside a collective
of the training step. A sharded save is collective, so it would hang every rank until the
process-group timeout (30 minutes by default) and hide the error (Lightning #6430). Before the
checkpoint callbacks run, each rank handling an exception checks, on a gloo group of its own
with a bounded wait, that all ranks are handling one (``dist.monitored_barrier``). If some are
not, this rank's saves and barriers are skipped with a warning naming them, and the exception
propagates: the process exits, the waiting ranks' collectives fail, and they take the same path.
When every rank raised (Ctrl+C, the same error everywhere) the checkpoint is written as usual,
unless a collective failed on some rank (a timeout, a lost peer: ranks waiting in different
collectives, e.g. a collective only some ranks call): the default group is then out of step, a
save's first collective would pair with a stale one and fail with a misleading error, so the saves
are skipped with a warning naming those ranks and their errors, and the exceptions propagate.
When no ``on_exception`` hook can save (no ``OnExceptionCheckpoint``, no ``ModelCheckpoint`` with
``save_on_exception``, no hook of the user's), there is nothing to agree on and nobody waits: a rank
raising alone exits at once, as under DDP, instead of after the agreement's bounded wait.
"""

from __future__ import annotations

import re
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import LightningDataModule
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, RichProgressBar

from lightning_ragged.lightning.callbacks import RaggedFSDPMetrics
from lightning_ragged.lightning.side_groups import gloo_group
from lightning_ragged.engine.collective_errors import PEER_LOST_PATTERNS, TIMEOUT_PATTERNS, CollectiveTimeoutError

if TYPE_CHECKING:
    import lightning.pytorch as pl

AGREEMENT_TIMEOUT = timedelta(seconds=60)
"""How long a rank handling an exception waits for the others (at most the process-group timeout)."""

_BACKEND = re.compile(r"gloo|nccl|c10d|ProcessGroup|pair closure|watchdog", re.IGNORECASE)
"""Marks of a backend's error (a bare ``RuntimeError`` from a collective), not a user's "timed out"."""

def agreement_group(timeout: timedelta) -> Optional[dist.ProcessGroup]:
    """The gloo group the agreement runs on (collective the first time: every rank builds it at setup).

    Its own ``timeout`` bounds the wait on every rank (``monitored_barrier``'s only bounds rank 0's).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return gloo_group("exception agreement", timeout)


class ExceptionAgreement(Callback):
    """Runs first among ``on_exception`` callbacks; sets ``strategy.out_of_step`` where ranks disagree."""

    def __init__(self, timeout: Optional[timedelta]) -> None:
        self.timeout = min(timeout, AGREEMENT_TIMEOUT) if timeout is not None else AGREEMENT_TIMEOUT
        self.group = agreement_group(self.timeout)

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if self.group is None or not _may_save_on_exception(trainer):
            return
        try:
            dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as error:
            trainer.strategy.out_of_step = True
            print(
                f"[rank {dist.get_rank()}] RaggedFSDPStrategy: {type(exception).__name__} on this rank, but not every "
                f"rank is handling an exception (waited at most {self.timeout.total_seconds():.0f} s: {error}); checkpoints "
                "from on_exception callbacks (OnExceptionCheckpoint) are skipped: a sharded save needs every rank. "
                "The exception is re-raised; the other ranks stop when this process exits. The last completed "
                "checkpoint stays valid.",
                file=sys.stderr,
                flush=True,
            )
            return
        failed = _failed_collective(exception)
        flags = torch.zeros(dist.get_world_size(self.group), dtype=torch.int32)
        flags[dist.get_rank(self.group)] = failed is not None
        try:
            dist.all_reduce(flags, group=self.group)
        except RuntimeError:
            flags[:] = 1  # the agreement's own group failed: nothing collective can be trusted
        if flags.any():
            trainer.strategy.out_of_step = True
            ranks = flags.nonzero().flatten().tolist()
            print(
                f"[rank {dist.get_rank()}] RaggedFSDPStrategy: a collective failed on ranks {ranks}"
                f"{f' (here: {type(failed).__name__}: {str(failed)[:300]})' if failed is not None else ''}; the ranks "
                "are out of step in the process group, so checkpoints from on_exception callbacks "
                "(OnExceptionCheckpoint) are skipped: their collectives would pair with stale ones. The exception is "
                "re-raised. The last completed checkpoint stays valid.",
                file=sys.stderr,
                flush=True,
            )


_LOCAL_HOOKS = (RichProgressBar.on_exception, RaggedFSDPMetrics.on_exception)
"""``on_exception`` hooks that run no collective (a progress bar stopped, our metrics' endpoint closed)."""


def _may_save_on_exception(trainer: "pl.Trainer") -> bool:
    """Whether an ``on_exception`` hook Lightning runs next may start a collective (a save): a callback or data
    module hook not known to be local counts as one, as does a ``ModelCheckpoint`` with ``save_on_exception``."""
    for callback in trainer.callbacks:
        hook = type(callback).on_exception
        if hook is Callback.on_exception or isinstance(callback, ExceptionAgreement):
            continue
        if hook is ModelCheckpoint.on_exception and not getattr(callback, "save_on_exception", True):
            continue
        if hook in _LOCAL_HOOKS:
            continue
        return True
    datamodule = trainer.datamodule
    return datamodule is not None and type(datamodule).on_exception is not LightningDataModule.on_exception


def _failed_collective(exception: BaseException) -> Optional[BaseException]:
    """The collective failure (a timeout, a lost peer) in ``exception``'s cause chain, if any."""
    seen: set[int] = set()
    error: Optional[BaseException] = exception
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error) if isinstance(error, RuntimeError) else ""
        if isinstance(error, (CollectiveTimeoutError, dist.DistError)) or (
            _BACKEND.search(text) and (TIMEOUT_PATTERNS.search(text) or PEER_LOST_PATTERNS.search(text))
        ):
            return error
        error = error.__cause__ or error.__context__
    return None


def add_exception_agreement(trainer: "pl.Trainer", timeout: Optional[timedelta]) -> None:
    """Put one :class:`ExceptionAgreement` first in the Trainer's callbacks (before the checkpoint callbacks)."""
    trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, ExceptionAgreement)]
    trainer.callbacks.insert(0, ExceptionAgreement(timeout))

