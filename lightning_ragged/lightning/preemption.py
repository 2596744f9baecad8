"""SLURM auto-requeue without the deadlock: defer the save to a point every rank agrees on.

Lightning's ``SLURMEnvironment(auto_requeue=True)`` (the default under ``srun``) registers
``_SignalConnector._slurm_sigusr_handler_fn`` for the requeue signal (``SIGUSR1`` unless
``requeue_signal`` says otherwise). That handler saves the hpc checkpoint *inside the signal
handler*. Slurm delivers the signal to every task at roughly the same time, but each rank is
somewhere else in the step: one inside a group's all-gather, another in a reduction. The
save's collectives (broadcast of the path, DCP's gathers, barriers) then pair with the
training collectives of the other ranks, and the job hangs until Slurm kills it, with no
checkpoint (Lightning issue #21406).

:class:`SLURMRequeue` replaces that one handler, for the Trainer of a ``RaggedFSDPStrategy``:

1. the handler only sets a flag (and records where it landed, for logs);
2. at the end of every training batch that stepped the optimizers, all ranks agree on the
   flag (``signal_handlers.SignalFlags``: one all-reduce of CPU integers per batch end, shared
   with the SIGTERM flag, no device sync); a rank that has not seen
   the signal yet still takes part, so every rank takes the same branch at the same batch;
3. when it is set: the loggers are finalized, the hpc checkpoint
   (``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``, as Lightning) is saved by all ranks at the
   same point, together with every rank's RNG states, and waited for;
4. rank 0 requeues the job with Lightning's command (``scontrol requeue $SLURM_JOB_ID``, or
   ``<array job>_<task>``); the result is broadcast. On success every rank absorbs the
   ``SIGTERM`` Slurm sends to end the allocation (Lightning's SIGTERM handler would run a
   collective inside the handler), waits a moment for it, and leaves ``trainer.fit`` with
   :class:`RequeueExit` (a ``SIGTERMException``: exit status 0, ``on_exception`` hooks run,
   code after ``fit`` does not, as when Slurm kills the job). If the requeue fails, training
   goes on (as Lightning) and a later signal tries again.

On the requeued run, Lightning finds the hpc checkpoint (``fit(ckpt_path=None)`` under SLURM)
and restores model, optimizers, schedulers and loops; this callback restores each rank's RNG
states at the first training batch, so dropout and other random ops continue exactly where
they stopped: the resumed run equals an uninterrupted one bit for bit (tests/test_slurm.py),
given a data position that resumes too (a resumable loader, or data keyed by the step).

Everything else stays Lightning's: the handler is installed only when the cluster environment
is a ``SLURMEnvironment`` with ``auto_requeue=True``, on its ``requeue_signal``, by Lightning's
own ``register_signal_handlers`` (which also skips it when the process already has a handler
for that signal, and restores the previous handlers at teardown). Nothing is patched on a
class: :func:`attach` (called from ``RaggedFSDPStrategy.setup``, just before Lightning
registers the handlers) points *this* Trainer's signal connector at the deferred handler.

Outside ``fit`` (``validate``/``test``/``predict`` under SLURM), the flag is agreed on at the
end of each batch of that loop and handled the same way (Lightning, too, saves and requeues
then). During ``fit``, a signal that arrives in a validation loop is handled at the next
training batch end, after validation.
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import subprocess
import threading
import time
from types import FrameType
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

import lightning.pytorch as pl
from lightning_ragged.lightning.signal_handlers import flags, install

log = logging.getLogger(__name__)

SCONTROL_TIMEOUT_S = 30.0
"""How long rank 0 waits for ``scontrol requeue`` (the other ranks wait for its answer in a broadcast)."""
HANDLER = "_slurm_sigusr_handler_fn"
"""Lightning's handler of the requeue signal on its ``_SignalConnector``, replaced on this Trainer's connector."""
SIGTERM_POLL_S = 0.05
SIGTERM_WAIT_S = 5.0
"""How long a rank waits, after a successful requeue, for the SIGTERM with which Slurm ends the job."""


class RequeueExit(SIGTERMException):
    """Raised on every rank, at the same batch, after the hpc checkpoint is saved and the job requeued.

    A ``SystemExit`` with status 0 (Lightning's ``SIGTERMException``): ``trainer.fit`` runs the
    ``on_exception`` hooks and tears down, and the script ends like a job Slurm stopped.
    """

    def __init__(self, message: str = "") -> None:
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


class SLURMRequeue(Callback):
    """Deferred SLURM auto-requeue (see the module docstring). Added by :func:`attach`.

    Attributes (for logs and tests): ``signal_step`` / ``signal_where`` (global step and the
    Python function the signal interrupted on this rank), ``saved_step`` and ``saved_path``
    (where all ranks agreed and saved), ``requeued``, ``sigterm_after_requeue`` (Slurm's SIGTERM
    arrived and was absorbed).
    """

    def __init__(self, sigterm_wait_s: float = SIGTERM_WAIT_S) -> None:
        self.sigterm_wait_s = sigterm_wait_s
        self.requested = False
        self.signal_step: Optional[int] = None
        self.signal_where: Optional[str] = None
        self.saved_step: Optional[int] = None
        self.saved_path: Optional[str] = None
        self.requeued = False
        self.requeue_attempts = 0
        self.sigterm_after_requeue = False
        self._trainer: Optional[pl.Trainer] = None
        self._step_at_batch_start: Optional[int] = None
        self._rng_states_to_save: Optional[list[dict[str, Any]]] = None
        self._rng_states_to_restore: Optional[dict[str, Any]] = None

    # ------------------------------------------------------------------ the signal
    def handle_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        """Installed in place of Lightning's ``_slurm_sigusr_handler_fn``: only sets the flag."""
        if self.requested:
            return
        self.requested = True
        trainer = self._trainer
        self.signal_step = trainer.global_step if trainer is not None else None
        self.signal_where = _describe_frames(frame)

    # ------------------------------------------------------------- agreement points
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step
        if self._rng_states_to_restore is not None:
            _set_rng_states(self._rng_states_to_restore, trainer.strategy.root_device)
            self._rng_states_to_restore = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._step_at_batch_start:
            return  # a micro-batch of gradient accumulation: not a point to save at
        self._maybe_requeue(trainer)

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING:
            self._maybe_requeue(trainer)

    def on_test_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._maybe_requeue(trainer)

    def on_predict_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._maybe_requeue(trainer)

    def _maybe_requeue(self, trainer: pl.Trainer) -> None:
        # Every rank asks at the same batch, so every rank decides the same (signal_handlers.SignalFlags).
        if not flags(trainer).agreed(HANDLER):
            return
        self._save_and_requeue(trainer)

    # -------------------------------------------------------- save, requeue, exit
    def _save_and_requeue(self, trainer: pl.Trainer) -> None:
        rank_zero_info(
            f"Handling the SLURM auto-requeue signal at step {trainer.global_step} (on rank 0 it arrived at step "
            f"{self.signal_step}{', in ' + self.signal_where if self.signal_where else ''})"
        )
        for logger in trainer.loggers:  # as Lightning: make sure every metric is written
            logger.finalize("finished")
        self._rng_states_to_save = _gather(_collect_rng_states(trainer.strategy.root_device))
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        try:
            trainer.save_checkpoint(path, weights_only=False)  # collective; the strategy broadcasts rank 0's path
        finally:
            self._rng_states_to_save = None
        _wait_for_pending_save(trainer.strategy)
        self.saved_step, self.saved_path = trainer.global_step, str(path)

        previous_sigterm = self._absorb_sigterm()
        trainer.strategy.barrier("ragged_fsdp-requeue")  # every rank absorbs SIGTERM before it can come
        self.requeue_attempts += 1
        requeued = _requeue_job() if trainer.is_global_zero else False
        requeued = bool(trainer.strategy.broadcast(requeued))
        if not requeued:
            self._restore_sigterm(previous_sigterm)
            self.requested = False  # a later signal tries again; the checkpoint stays
            rank_zero_warn(f"SLURM requeue failed; training goes on (the hpc checkpoint {path} is saved)")
            return
        self.requeued = True
        # Slurm ends the allocation with SIGTERM right after the requeue; take it while our
        # handler is installed, so the process leaves with status 0 instead of being killed later.
        deadline = time.monotonic() + self.sigterm_wait_s
        while not self.sigterm_after_requeue and time.monotonic() < deadline:
            time.sleep(SIGTERM_POLL_S)  # a plain flag: a lock taken in the handler could be this thread's own
        raise RequeueExit(f"SLURM job requeued after saving {path} at step {trainer.global_step}")

    def _absorb_sigterm(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return None
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm_after_requeue)
        return previous

    def _restore_sigterm(self, previous: Any) -> None:
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)

    def _on_sigterm_after_requeue(self, signum: int, frame: Optional[FrameType]) -> None:
        # The checkpoint is complete and the job requeued: nothing is left to do but exit, and no
        # collective may run inside a signal handler. Lightning's teardown restores the old handler.
        self.sigterm_after_requeue = True

    # ------------------------------------------------------------- checkpoint state
    def state_dict(self) -> dict[str, Any]:
        if self._rng_states_to_save is None:
            return {}
        return {"rng_states": self._rng_states_to_save}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = state_dict.get("rng_states")
        if not states:
            return
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if len(states) != world:
            rank_zero_warn(
                f"The hpc checkpoint holds RNG states of {len(states)} ranks but this run has {world}; "
                "the RNG states are not restored (the run goes on, but random ops differ from the original)"
            )
            return
        rank = dist.get_rank() if world > 1 else 0
        self._rng_states_to_restore = states[rank]


def attach(trainer: pl.Trainer, cluster_environment: Any) -> Optional[SLURMRequeue]:
    """Defer this Trainer's SLURM auto-requeue (idempotent); ``None`` when it is not on.

    Called by the strategy's ``setup``; Lightning registers the signal handlers right after it
    (``_SignalConnector.register_signal_handlers``), composing the bound method found on the
    connector, so the deferred handler takes the place of the saving one for this Trainer only.
    """
    if not (isinstance(cluster_environment, SLURMEnvironment) and cluster_environment.auto_requeue):
        return None
    return install(
        trainer, HANDLER, SLURMRequeue, lambda callback: callback.requested,
        "SLURM auto-requeue keeps Lightning's handler, which saves inside the signal handler and may deadlock",
    )


# ------------------------------------------------------------------------- helpers
def _describe_frames(frame: Optional[FrameType], depth: int = 4) -> Optional[str]:
    """Where the signal interrupted this rank: the innermost Python frames, ``file:line function < ...``."""
    parts = []
    while frame is not None and len(parts) < depth:
        parts.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(parts) if parts else None


def _requeue_job() -> bool:
    """Lightning's requeue command (``_SignalConnector._slurm_sigusr_handler_fn``), on rank 0."""
    array_job_id = os.getenv("SLURM_ARRAY_JOB_ID")
    if array_job_id is not None:
        job_id = f"{array_job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    else:
        job_id = os.environ["SLURM_JOB_ID"]
    assert re.match("[0-9_-]+", job_id)
    cmd = ["scontrol", "requeue", job_id]
    log.info(f"requeing job {job_id}...")
    try:
        try:
            result = subprocess.call(cmd, timeout=SCONTROL_TIMEOUT_S)
        except FileNotFoundError:
            result = subprocess.call(" ".join(cmd), shell=True, timeout=SCONTROL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning(f"`{' '.join(cmd)}` did not finish within {SCONTROL_TIMEOUT_S:g} s")
        return False
    if result == 0:
        log.info(f"Requeued SLURM job: {job_id}")
    else:
        log.warning(f"Requeuing SLURM job {job_id} failed with error code {result}")
    return result == 0


def _wait_for_pending_save(strategy: Any) -> None:
    """An asynchronous checkpoint must be on disk before the job is requeued (and killed)."""
    checkpoints = getattr(strategy, "ragged_checkpoints", None)
    if checkpoints is not None:
        checkpoints.writer.wait()


def _gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _collect_rng_states(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states, in types ``torch.load(weights_only=True)`` reads."""
    version, state, gauss = random.getstate()
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(state), gauss]}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        states["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _set_rng_states(states: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    if "numpy" in states:
        import numpy as np

        name, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)
