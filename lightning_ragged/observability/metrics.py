"""Per-step metrics of the sharded engine, for plain ``fully_shard`` loops and for Lightning.

Plain loop::

    metrics = EngineMetrics(model)           # after fully_shard(model)
    for batch in data:
        loss(model, batch).backward(); optimizer.step(); optimizer.zero_grad()
        metrics.end_step()                    # closes the step (a few additions)
        if step % 50 == 0:
            print(metrics.compute())          # averages over the steps since the last compute()

Lightning: :class:`RaggedFSDPMetrics` (added by ``RaggedFSDPStrategy`` unless
``metrics=False``) logs :meth:`EngineMetrics.compute` through ``trainer.loggers`` every
``log_every_n_steps`` and, with ``monitor_port``, serves them (``monitor.py``).

Keys (prefix ``ragged_fsdp/``; "per step" values are means over the logging window):

=================================  ==================================================================
``step_seconds``                   wall-clock time of one optimizer step
``all_gathers``                    all-gathers per step (count)
``all_gather_bytes``               bytes all-gathered per step per rank (unsharded buffer sizes)
``all_gather_seconds``             all-gather time in flight (issue to completion) per step
``reduces``                        gradient reductions per step (count)
``reduce_bytes``                   bytes reduced per step per rank (flat gradient buffer sizes)
``reduce_seconds``                 reduction time in flight per step
``comm_blocked_seconds``           time the training thread waited in (or issued) collectives
``comm_hidden_ratio``              ``1 - blocked / in flight``: share of communication behind compute
``engine_copy_bytes``              bytes the engine copied outside collectives (mixed-precision casts)
``copy_bytes``                     bytes of every copy-like op in a sampled step (``count_copies_every_n_steps``)
``dbuffer_sharded_bytes``          this rank's parameter segments (persistent)
``dbuffer_sharded_grad_bytes``     this rank's gradient segments (persistent once allocated)
``dbuffer_unsharded_peak_bytes``   peak bytes of full parameter buffers alive at once in the window
``dbuffer_grad_peak_bytes``        peak bytes of full gradient buffers alive at once in the window
``process_memory_bytes``           RSS now (CPU) or ``torch.cuda.memory_allocated`` (CUDA)
``process_peak_memory_bytes``      peak RSS since start (CPU) or ``torch.cuda.max_memory_allocated`` (CUDA)
``padding_ratio``                  planner padding / parameters, all groups
``segment_size_max``               the largest per-rank segment (elements) of any group
``root_param_fraction``            share of the parameters in the root group (kept unsharded from forward to backward)
``groups/<group>/padding_ratio``   per group (``<group>#<i>`` when a group has several DBuffers)
``groups/<group>/segment_size``    per group, elements
=================================  ==================================================================
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any, Iterable, Optional

import torch
from torch import nn

from lightning_ragged.observability.copy_counter import CopyCounter
from lightning_ragged.engine.api import RaggedFSDPState
from lightning_ragged.observability.probes import EngineProbe, probe, sharded_states

PREFIX = "ragged_fsdp/"

_COUNTERS = (
    "all_gathers",
    "all_gather_bytes",
    "all_gather_seconds",
    "reduces",
    "reduce_bytes",
    "reduce_seconds",
    "comm_blocked_seconds",
    "engine_copy_bytes",
)


def process_memory(device: torch.device | None = None) -> tuple[int, int]:
    """(bytes now, peak bytes): CUDA allocator on a CUDA device, else this process's RSS."""
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak *= 1 if sys.platform == "darwin" else 1024  # kilobytes on Linux, bytes on macOS
    try:
        with open("/proc/self/statm", "rb") as statm:
            now = int(statm.read().split()[1]) * resource.getpagesize()
    except OSError:
        now = peak
    return now, max(now, peak)  # the kernel's high-water mark is updated lazily


class EngineMetrics:
    """Per-step engine metrics of one or more modules sharded by ``fully_shard``."""

    def __init__(self, *modules: nn.Module | RaggedFSDPState) -> None:
        states: list[RaggedFSDPState] = []
        for module in modules:
            found = [module] if isinstance(module, RaggedFSDPState) else list(sharded_states(module))
            if not found:
                raise ValueError(
                    f"{type(module).__name__} holds no module sharded by lightning_ragged.fully_shard; "
                    "call fully_shard first"
                )
            states += [state for state in found if all(state is not other for other in states)]
        self.probes: list[EngineProbe] = [probe(state) for state in states]
        self.device = next(iter(self.probes[0].dbuffers)).dbuffer.device if self.probes[0].dbuffers else None
        self.steps_total = 0
        self._last_totals = self._totals()
        self._window = dict.fromkeys(_COUNTERS, 0.0)
        self._window_steps = 0
        self._window_seconds = 0.0
        self._step_started = time.perf_counter()
        self._copy_bytes: list[int] = []
        self.last_step_time: float | None = None
        """``time.time()`` when the last step ended (for health checks)."""

    # ---------------------------------------------------------- per step
    def _totals(self) -> tuple[float, ...]:
        a = g = s = r = rb = rs = blocked = copies = 0.0
        for p in self.probes:
            stats = p.state.stats
            a += stats.all_gathers
            g += stats.all_gather_bytes
            s += stats.all_gather_seconds
            r += stats.reduces
            rb += stats.reduce_bytes
            rs += stats.reduce_seconds
            blocked += p.blocked_all_gather_seconds + p.blocked_reduce_seconds
            copies += p.engine_copy_bytes
        return a, g, s, r, rb, rs, blocked, copies

    def end_step(self, copy_bytes: int | None = None) -> None:
        """Close one optimizer step: add its counters to the window (cheap: a few additions)."""
        now = time.perf_counter()
        totals = self._totals()
        window = self._window
        for key, new, old in zip(_COUNTERS, totals, self._last_totals):
            window[key] += new - old
        self._last_totals = totals
        self._window_steps += 1
        self._window_seconds += now - self._step_started
        self._step_started = now
        self.steps_total += 1
        self.last_step_time = time.time()
        if copy_bytes is not None:
            self._copy_bytes.append(copy_bytes)

    def set_step(self, step: int) -> None:
        """The training step that diagnostics name (the Lightning callback sets the global step)."""
        for p in self.probes:
            p.step = step

    def restart_step_clock(self) -> None:
        """Start timing the next step now (e.g. after validation or at the start of an epoch)."""
        self._step_started = time.perf_counter()

    # ---------------------------------------------------------- reporting
    def compute(self, per_group: bool = True, reset: bool = True) -> dict[str, float]:
        """Means per step over the window since the last ``compute(reset=True)``, plus gauges."""
        steps = max(self._window_steps, 1)
        window = self._window
        metrics = {key: value / steps for key, value in window.items()}
        metrics["step_seconds"] = self._window_seconds / steps
        in_flight = window["all_gather_seconds"] + window["reduce_seconds"]
        blocked = window["comm_blocked_seconds"]
        metrics["comm_hidden_ratio"] = min(max(1.0 - blocked / in_flight, 0.0), 1.0) if in_flight > 0 else 0.0
        if self._copy_bytes:
            metrics["copy_bytes"] = sum(self._copy_bytes) / len(self._copy_bytes)
        metrics.update(self.memory())
        metrics.update(self.layout_metrics(per_group))
        if reset:
            self._window = dict.fromkeys(_COUNTERS, 0.0)
            self._window_steps = 0
            self._window_seconds = 0.0
            self._copy_bytes = []
            for p in self.probes:
                p.reset_peaks()
        return {PREFIX + key: float(value) for key, value in metrics.items()}

    def memory(self) -> dict[str, float]:
        sharded = sharded_grad = 0
        for p in self.probes:
            for info in p.dbuffers:
                dbuffer = info.dbuffer
                sharded += dbuffer.sharded.numel() * dbuffer.sharded.element_size()
                if dbuffer.sharded_grad is not None:
                    sharded_grad += dbuffer.sharded_grad.numel() * dbuffer.sharded_grad.element_size()
        now, peak = process_memory(self.device)
        return {
            "dbuffer_sharded_bytes": sharded,
            "dbuffer_sharded_grad_bytes": sharded_grad,
            "dbuffer_unsharded_peak_bytes": sum(p.unsharded_peak_bytes for p in self.probes),
            "dbuffer_grad_peak_bytes": sum(p.grad_peak_bytes for p in self.probes),
            "process_memory_bytes": now,
            "process_peak_memory_bytes": peak,
        }

    def layout_metrics(self, per_group: bool = True) -> dict[str, float]:
        padding = numel = 0
        segment_max = 0
        metrics: dict[str, float] = {}
        for p in self.probes:
            for info in p.dbuffers:
                layout = info.dbuffer.layout
                padding += layout.padding
                numel += layout.total_numel
                segment_max = max(segment_max, layout.segment_size)
                if per_group:
                    metrics[f"groups/{info.label}/padding_ratio"] = layout.padding_ratio
                    metrics[f"groups/{info.label}/segment_size"] = layout.segment_size
        metrics["padding_ratio"] = padding / numel if numel else 0.0
        metrics["segment_size_max"] = segment_max
        metrics["root_param_fraction"] = max((p.state.root_fraction for p in self.probes), default=0.0)
        return metrics

    def groups(self) -> Iterable[tuple[str, Any]]:
        """(label, layout) of every DBuffer."""
        for p in self.probes:
            for info in p.dbuffers:
                yield info.label, info.dbuffer.layout

    def totals(self) -> dict[str, float]:
        """Cumulative counters since the module was sharded (for Prometheus counters)."""
        return dict(zip(_COUNTERS, self._totals()))

    def close(self) -> None:
        """Remove the probes (the engine runs exactly as before)."""
        for p in self.probes:
            p.remove()


def _rank_zero(trainer: Any) -> bool:
    return getattr(trainer, "global_rank", 0) == 0


try:  # Lightning is optional for plain fully_shard users
    from lightning.pytorch.callbacks import Callback as _Callback
except ImportError:  # pragma: no cover - lightning is a dependency, but keep the plain API importable
    _Callback = object  # type: ignore[assignment,misc]


class RaggedFSDPMetrics(_Callback):  # type: ignore[misc,valid-type]
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
    ) -> None:
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
        self.metrics: Optional[EngineMetrics] = None
        self.monitor: Any = None
        self.last_logged: dict[str, float] = {}
        self._last_global_step = -1
        self._copy_counter: Optional[CopyCounter] = None

    # ------------------------------------------------------------ lifecycle
    def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
        model = getattr(trainer.strategy, "model", None) or pl_module
        try:
            self.metrics = EngineMetrics(model)
        except ValueError:
            from lightning.pytorch.utilities.rank_zero import rank_zero_warn

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
        self.metrics.set_step(trainer.global_step)
        self._last_global_step = trainer.global_step
        if self.monitor_port is not None:
            from lightning_ragged.observability.monitor import Monitor

            self.monitor = Monitor(
                self.metrics,
                port=self.monitor_port,
                address=self.monitor_address,
                health_timeout=self.health_timeout,
                heartbeat_interval=self.heartbeat_interval,
                serve=_rank_zero(trainer),
                global_step=trainer.global_step,
            )
            self.monitor.start()

    def on_train_epoch_start(self, trainer: Any, pl_module: nn.Module) -> None:
        if self.metrics is not None:
            self.metrics.restart_step_clock()

    def on_validation_end(self, trainer: Any, pl_module: nn.Module) -> None:
        if self.metrics is not None and trainer.training:
            self.metrics.restart_step_clock()  # validation time is not step time

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
        if every and step % every == 0:
            self._publish(trainer, step)

    def _publish(self, trainer: Any, step: int) -> None:
        assert self.metrics is not None
        values = self.metrics.compute(per_group=self.per_group)
        self.last_logged = values
        if self.monitor is not None:
            self.monitor.update(values)
        if self.log_metrics and _rank_zero(trainer):
            for logger in trainer.loggers:
                logger.log_metrics(values, step=step)

    def on_fit_end(self, trainer: Any, pl_module: nn.Module) -> None:
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
    the diagnostics (and the endpoint, if ``monitor_port`` is given); with everything off
    it adds nothing. ``kwargs`` go to the callback (``monitor_port``, ``monitor_address``...).
    """
    for callback in trainer.callbacks:
        if isinstance(callback, RaggedFSDPMetrics):
            return callback
    if not metrics and not diagnostics and kwargs.get("monitor_port") is None:
        return None
    callback = RaggedFSDPMetrics(log_metrics=metrics, diagnostics=diagnostics, **kwargs)
    trainer.callbacks.append(callback)
    return callback
