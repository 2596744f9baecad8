"""SIGTERM without a collective in the signal handler: every rank stops at the same batch.

Lightning's SIGTERM handler (``_SignalConnector._sigterm_notifier_fn``, Lightning 2.6) runs
``dist.broadcast`` *inside the handler* on the rank that got the signal, and sets a flag that
Lightning's loops check on that rank alone. A SIGTERM that reaches one rank mid-step (``scancel``,
Slurm preemption, torchrun stopping workers, a time limit) then pairs that broadcast with another
rank's all-gather: both wait until the process-group timeout (30 minutes by default), and the
``on_exception`` save runs on a broken group. Nothing is written.

:class:`SIGTERMAgreement` takes the place of that one handler, for the Trainer of a
``RaggedFSDPStrategy``: the handler only forwards the signal to the processes Lightning started
(as Lightning) and sets a flag. At every batch end (training, validation, test, predict) all ranks
agree on the flag with one all-reduce of CPU integers (no device sync), which replaces Lightning's
per-batch broadcast of rank 0's flag; under SLURM auto-requeue the requeue signal's flag travels in
the same all-reduce (``signal_handlers.SignalFlags``). When any rank has it, every rank sets
``trainer.received_sigterm`` at that batch, and Lightning's own checks raise ``SIGTERMException``
on all of them at the same point: the ``on_exception`` callbacks (``OnExceptionCheckpoint``) run
with every rank present and the checkpoint is written. The requeue itself is ``preemption.py``'s.
"""

from __future__ import annotations

import logging
from types import FrameType
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message

import lightning.pytorch as pl
from lightning_ragged.lightning.signal_handlers import flags, install

log = logging.getLogger(__name__)

HANDLER = "_sigterm_notifier_fn"
"""Lightning's SIGTERM handler on its ``_SignalConnector`` (2.6), replaced on this Trainer's connector."""


class SIGTERMAgreement(Callback):
    """Flag-only SIGTERM handler plus the batch-end agreement (see the module docstring). Added by :func:`attach`.

    ``received`` (this rank got the signal) and ``agreed_step`` (the global step at which all ranks
    agreed to stop) are kept for logs and tests.
    """

    def __init__(self) -> None:
        self.received = False
        self.agreed_step: Optional[int] = None
        self._trainer: Optional[pl.Trainer] = None

    def handle_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        """Installed in place of Lightning's ``_sigterm_notifier_fn``: no collective, only the flag."""
        trainer = self._trainer
        if trainer is None:
            return
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", trainer.local_rank))
        launcher = trainer.strategy.launcher
        if not self.received and launcher is not None:
            launcher.kill(signum)  # as Lightning: the processes it started get the signal too
        self.received = True

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._agree(trainer)

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._agree(trainer)

    def on_test_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._agree(trainer)

    def on_predict_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._agree(trainer)

    def _agree(self, trainer: pl.Trainer) -> None:
        # Every rank asks at the same batch: the same decision everywhere (signal_handlers.SignalFlags).
        if trainer._signal_connector.received_sigterm:
            return
        if flags(trainer).agreed(HANDLER):
            self.agreed_step = trainer.global_step
            trainer._signal_connector.received_sigterm = True  # Lightning's loops raise SIGTERMException next


def attach(trainer: pl.Trainer) -> Optional[SIGTERMAgreement]:
    """Point this Trainer's SIGTERM handling at :class:`SIGTERMAgreement` (idempotent); ``None`` if impossible.

    Called by the strategy's ``setup``; Lightning registers the handlers right after it, composing
    the bound method found on the connector. Lightning's per-batch broadcast of rank 0's flag (2.6)
    is switched off on this Trainer's loop: the agreement replaces it, one collective for one.
    """
    callback = install(
        trainer, HANDLER, SIGTERMAgreement, lambda callback: callback.received,
        "SIGTERM keeps Lightning's handling, which may stop one rank while the others wait in a collective",
    )
    if callback is None:
        return None
    epoch_loop = trainer.fit_loop.epoch_loop
    if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        epoch_loop._broadcast_sigterm_tensor = _agreed_at_batch_end
    return callback


def _agreed_at_batch_end() -> None:
    """Lightning's batch-start broadcast of rank 0's SIGTERM flag, replaced: :class:`SIGTERMAgreement` agrees."""
