"""The Lightning callback of the engine metrics: logging, diagnostics and the opt-in endpoint.

:class:`RaggedFSDPMetrics` (added by ``RaggedFSDPStrategy`` unless ``metrics=False``) logs
:meth:`~lightning_ragged.observability.metrics.EngineMetrics.compute` through
``trainer.loggers`` every ``log_every_n_steps`` and, with ``monitor_port``, serves them
(:class:`~lightning_ragged.observability.monitor.Monitor`). The values are this rank's;
rank 0 logs its own (no collective on the logging step).

With ``tuning`` it also logs ``ragged_fsdp/recommended_dbuffer_size`` (and
``recommended_max_inflight_all_gathers``) from :func:`~lightning_ragged.observability.tuning.recommend`
on rank 0's numbers, says so on rank 0 when it changes, and writes it to
``<default_root_dir>/ragged_fsdp_tuning.json`` at fit end for ``dbuffer_size="recommended"``.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_ragged.engine.api import DEFAULT_DBUFFER_SIZE
from lightning_ragged.lightning.metrics_knobs import METRICS_CHECKS, check_metrics_knobs
from lightning_ragged.observability.copy_counter import CopyCounter
from lightning_ragged.observability.metrics import EngineMetrics
from lightning_ragged.observability.monitor import Monitor
from lightning_ragged.observability.tuning import (
    Recommendation,
    group_sizes,
    memory_peak_and_limit,
    recommend,
    tuning_input,
    write_recommendation,
)


def checkpoint_saved(trainer: Any) -> None:
    """The strategy finished (or failed) a checkpoint save: a hang after it reads as a stall again."""
    for callback in getattr(trainer, "callbacks", []):
        if isinstance(callback, RaggedFSDPMetrics) and callback.monitor is not None:
            callback.monitor.saving_checkpoint(False)


def _logging_step(trainer: Any) -> int:
    """The step Lightning logs this batch's ``self.log`` values at (its batches that stepped before this one,
    ``global_step - 1`` with one optimizer), so the window's values line up with the loss of the same step."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    return getattr(loop, "_batches_that_stepped", trainer.global_step - 1)


def _rank_zero(trainer: Any) -> bool:
    return getattr(trainer, "global_rank", 0) == 0


class RaggedFSDPMetrics(Callback):
    """Logs the engine metrics through ``trainer.loggers`` and (opt-in) serves health and Prometheus metrics.

    Args:
        log_every_n_steps: defaults to the Trainer's ``log_every_n_steps``.
        per_group: also log padding ratio and segment size of every group.
        count_copies_every_n_steps: run :class:`~lightning_ragged.observability.copy_counter.CopyCounter`
            over one whole training step every n steps (slow on that step; 0: off).
        monitor_port: serve ``GET /health`` and ``GET /metrics`` on rank 0 at this port
            (0: any free port, see ``monitor.port``); ``None``: no endpoint.
        monitor_address: the address to bind (default loopback).
        health_timeout: a rank counts as reporting if it finished a step this recently (seconds).
        heartbeat_interval: how often every rank publishes its step to the store (seconds).
        diagnostics: turn collective timeouts and OOMs at unshard into named errors.
        collective_timeout: seconds named in timeout errors; default: the strategy's ``timeout``.
        log_metrics: log through ``trainer.loggers`` (``False`` keeps only diagnostics and the endpoint).
        tuning: recommend a ``dbuffer_size`` on every logging step and write it at fit end.
        memory_budget_bytes: the per-rank memory limit the recommendation keeps headroom under
            (default: the device's total; on CPU the physical memory over the local processes).
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        *,
        per_group: bool = True,
        count_copies_every_n_steps: int = 0,
        monitor_port: Optional[int] = None,
        monitor_address: str = "127.0.0.1",
        health_timeout: float = 300.0,
        heartbeat_interval: float = 5.0,
        diagnostics: bool = True,
        collective_timeout: Optional[float] = None,
        log_metrics: bool = True,
        tuning: bool = True,
        memory_budget_bytes: Optional[int] = None,
    ) -> None:
        check_metrics_knobs({name: value for name, value in locals().items() if name in METRICS_CHECKS})
        self.log_every_n_steps = log_every_n_steps
        self.per_group = per_group
        self.count_copies_every_n_steps = count_copies_every_n_steps
        self.monitor_port = monitor_port
        self.monitor_address = monitor_address
        self.health_timeout = health_timeout
        self.heartbeat_interval = heartbeat_interval
        self.diagnostics = diagnostics
        self.collective_timeout = collective_timeout
        self.log_metrics = log_metrics
        self.tuning = tuning
        self.memory_budget_bytes = memory_budget_bytes
        self.recommendation: Optional[Recommendation] = None
        self.metrics: Optional[EngineMetrics] = None
        self.monitor: Optional[Monitor] = None
        self.last_logged: dict[str, float] = {}
        self._last_global_step = -1
        self._copy_counter: Optional[CopyCounter] = None

    # ------------------------------------------------------------ lifecycle
    def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
        model = getattr(trainer.strategy, "model", None) or pl_module
        try:
            self.metrics = EngineMetrics(model)
        except ValueError:
            rank_zero_warn("RaggedFSDPMetrics: the model is not sharded by lightning_ragged; no engine metrics.")
            self.metrics = None
            return
        timeout = self.collective_timeout
        if timeout is None:
            strategy_timeout = getattr(trainer.strategy, "_timeout", None)
            timeout = strategy_timeout.total_seconds() if hasattr(strategy_timeout, "total_seconds") else None
        for p in self.metrics.probes:
            p.diagnostics = self.diagnostics
            p.collective_timeout = timeout
        if self.monitor_port is not None:
            self.monitor = Monitor(
                self.metrics,
                port=self.monitor_port,
                address=self.monitor_address,
                health_timeout=self.health_timeout,
                heartbeat_interval=self.heartbeat_interval,
                serve=_rank_zero(trainer),
            )
            self.monitor.start()

    def on_train_start(self, trainer: Any, pl_module: nn.Module) -> None:
        """The step training starts from: Lightning restores a resumed fit's after ``on_fit_start``; read there,
        the first micro-batch of an accumulation window after a resume counted as a step of its own."""
        if self.metrics is not None:
            self.metrics.set_step(trainer.global_step)
            self._last_global_step = trainer.global_step
        if self.monitor is not None:
            self.monitor.global_step = trainer.global_step

    def on_train_epoch_start(self, trainer: Any, pl_module: nn.Module) -> None:
        if self.metrics is not None:
            self.metrics.restart_step_clock()

    # A validation inside fit (sanity check included; the stage is VALIDATING then, not TRAINING): its
    # all-gathers and its time are not a training step's.
    def on_validation_start(self, trainer: Any, pl_module: nn.Module) -> None:
        if self.metrics is not None and trainer.state.fn == TrainerFn.FITTING:
            self.metrics.begin_excluded()

    def on_validation_end(self, trainer: Any, pl_module: nn.Module) -> None:
        if self.metrics is not None and trainer.state.fn == TrainerFn.FITTING:
            self.metrics.end_excluded()

    def on_validation_batch_end(self, trainer: Any, pl_module: nn.Module, *args: Any, **kwargs: Any) -> None:
        if self.monitor is not None:  # a validation longer than health_timeout is no stall
            self.monitor.progressed()

    def on_save_checkpoint(self, trainer: Any, pl_module: nn.Module, checkpoint: dict[str, Any]) -> None:
        if self.monitor is not None:  # every rank dumps, then writes (the strategy's save ends the mark, checkpoint_saved)
            self.monitor.saving_checkpoint(True)

    def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int) -> None:
        if self.metrics is None:
            return
        self.metrics.set_step(trainer.global_step)
        n = self.count_copies_every_n_steps
        if n and self._copy_counter is None and trainer.global_step % n == 0:
            self._copy_counter = CopyCounter()
            self._copy_counter.__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: nn.Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        metrics = self.metrics
        if metrics is None or trainer.global_step == self._last_global_step:
            return  # a non-final micro-batch of gradient accumulation
        self._last_global_step = step = trainer.global_step
        copy_bytes = None
        if self._copy_counter is not None:
            self._copy_counter.__exit__(None, None, None)
            copy_bytes, self._copy_counter = self._copy_counter.total_bytes, None
        metrics.end_step(copy_bytes)
        if self.monitor is not None:
            self.monitor.step_finished(step)
        every = self.log_every_n_steps or trainer.log_every_n_steps
        logged = _logging_step(trainer)
        if every and (logged + 1) % every == 0:
            self._publish(trainer, logged)

    def _publish(self, trainer: Any, step: int) -> None:
        assert self.metrics is not None
        values = self.metrics.compute(per_group=self.per_group)
        if self.tuning:
            values.update(self._recommend(trainer, values))
        self.last_logged = values
        if self.monitor is not None:
            self.monitor.update(values)
        if self.log_metrics and _rank_zero(trainer):
            for logger in trainer.loggers:
                logger.log_metrics(values, step=step)

    def _recommend(self, trainer: Any, values: dict[str, float]) -> dict[str, float]:
        assert self.metrics is not None
        strategy = trainer.strategy
        size = getattr(strategy, "applied_dbuffer_size", None) or getattr(strategy, "dbuffer_size", None)
        size = size if isinstance(size, int) else DEFAULT_DBUFFER_SIZE
        memory = memory_peak_and_limit(
            self.metrics.device, self.memory_budget_bytes, getattr(strategy, "num_processes", 1) or 1
        )
        depth = min(p.state.max_inflight_all_gathers for p in self.metrics.probes)
        found = recommend(tuning_input(values, group_sizes(self.metrics), size, memory, depth))
        last, self.recommendation = self.recommendation, found
        if last is None or (last.dbuffer_size, last.max_inflight_all_gathers) != (
            found.dbuffer_size, found.max_inflight_all_gathers
        ):
            rank_zero_info(
                f"RaggedFSDPMetrics: recommend dbuffer_size={found.dbuffer_size}, "
                f"max_inflight_all_gathers={found.max_inflight_all_gathers} ({found.action}): {found.reason}"
            )
        return {
            "ragged_fsdp/recommended_dbuffer_size": float(found.dbuffer_size),
            "ragged_fsdp/recommended_max_inflight_all_gathers": float(found.max_inflight_all_gathers),
        }

    def on_fit_end(self, trainer: Any, pl_module: nn.Module) -> None:
        if self.tuning and self.metrics is not None:
            if self.recommendation is None and self.metrics.steps_total:
                self._recommend(trainer, self.metrics.compute(per_group=False))
            if self.recommendation is not None and _rank_zero(trainer):
                path = write_recommendation(trainer.default_root_dir, self.recommendation, trainer.global_step)
                rank_zero_info(f"RaggedFSDPMetrics: wrote the recommended dbuffer_size to {path}")
        self._stop()

    def on_exception(self, trainer: Any, pl_module: nn.Module, exception: BaseException) -> None:
        self._stop()

    def teardown(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._copy_counter is not None:
            self._copy_counter.__exit__(None, None, None)
            self._copy_counter = None
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None


def add_metrics_callback(
    trainer: Any, metrics: bool = True, diagnostics: bool = True, **kwargs: Any
) -> Optional[RaggedFSDPMetrics]:
    """Append a :class:`RaggedFSDPMetrics` to ``trainer.callbacks`` unless one is there (idempotent).

    ``RaggedFSDPStrategy.setup`` calls it. ``metrics=False`` turns the logging off but keeps
    the diagnostics (and the endpoint, if ``monitor_port`` is given) and writes no tuning
    file; with everything off it adds nothing. ``kwargs`` go to the callback (``monitor_port``, ``monitor_address``...).
    """
    for callback in trainer.callbacks:
        if isinstance(callback, RaggedFSDPMetrics):
            return callback
    if not metrics and not diagnostics and kwargs.get("monitor_port") is None:
        return None
    kwargs.setdefault("tuning", metrics)  # metrics=False: no recommendation, no tuning file written
    callback = RaggedFSDPMetrics(log_metrics=metrics, diagnostics=diagnostics, **kwargs)
    trainer.callbacks.append(callback)
    return callback
