"""Per-step metrics of the sharded engine, for plain ``fully_shard`` loops and for Lightning.

Plain loop::

    metrics = EngineMetrics(model)           # after fully_shard(model)
    for batch in data:
        loss(model, batch).backward(); optimizer.step(); optimizer.zero_grad()
        metrics.end_step()                    # closes the step (a few additions)
        if step % 50 == 0:
            print(metrics.compute())          # averages over the steps since the last compute()

Lightning: :class:`~lightning_ragged.lightning.callbacks.RaggedFSDPMetrics` (added by
``RaggedFSDPStrategy`` unless ``metrics=False``) logs :meth:`EngineMetrics.compute` through
``trainer.loggers`` every ``log_every_n_steps`` and, with ``monitor_port``, serves them (``monitor.py``).

Keys (prefix ``ragged_fsdp/``; "per step" values are means over the logging window):

=================================  ==================================================================
``step_seconds``                   wall-clock time of one optimizer step
``all_gathers``                    all-gathers per step (count)
``all_gather_bytes``               bytes all-gathered per step per rank (unsharded buffer sizes)
``all_gather_seconds``             all-gather time in flight (issue to completion) per step (CUDA: device time)
``reduces``                        gradient reductions per step (count)
``reduce_bytes``                   bytes reduced per step per rank (flat gradient buffer sizes)
``reduce_seconds``                 reduction time in flight per step (CUDA: device time)
``replica_all_reduces``            HSDP: all-reduces of reduced segments over the replicas per step (count)
``replica_all_reduce_bytes``       HSDP: bytes of those per step per rank (segment sizes)
``comm_blocked_seconds``           time the training thread waited in (or issued) collectives (CUDA: the
                                   compute stream's stall on them, ``device_timing.py``)
``comm_hidden_ratio``              ``1 - blocked / in flight``: share of communication behind compute
``engine_copy_bytes``              bytes the engine copied outside collectives (casts, fp8 (de)quantization)
``copy_bytes``                     bytes of every copy-like op in a sampled step (``count_copies_every_n_steps``)
``dbuffer_sharded_bytes``          this rank's parameter segments (persistent)
``dbuffer_sharded_grad_bytes``     this rank's gradient segments (persistent once allocated)
``dbuffer_unsharded_peak_bytes``   peak bytes of full parameter buffers alive at once in the window
``dbuffer_grad_peak_bytes``        peak bytes of full gradient buffers alive at once in the window (not the
                                   reduction's temporaries: pairwise scratch, the fp32 cast of a bf16 buffer)
``process_memory_bytes``           RSS now (CPU) or ``torch.cuda.memory_allocated`` (CUDA)
``process_peak_memory_bytes``      peak RSS since start (CPU) or ``torch.cuda.max_memory_allocated`` (CUDA)
``padding_ratio``                  planner padding / parameters, all groups
``segment_size_max``               the largest per-rank segment (elements) of any group
``root_param_fraction``            share of the parameters in the root group (kept unsharded from forward to backward)
``groups/<group>/padding_ratio``   per group (``<group>#<i>`` when a group has several DBuffers)
``groups/<group>/segment_size``    per group, elements
=================================  ==================================================================

On CUDA the three times come from timing events read lazily at :meth:`EngineMetrics.compute`
(never a synchronize): a collective whose events have not completed on the device yet is
counted in the next window.
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from typing import Any, Iterable

import torch
from torch import nn

from lightning_ragged.engine.api import RaggedFSDPState
from lightning_ragged.observability.device_timing import EventFactory
from lightning_ragged.observability.probes import EngineProbe, probe, sharded_states

PREFIX = "ragged_fsdp/"

_DEVICE_TIMED = ("all_gather_seconds", "reduce_seconds", "comm_blocked_seconds")
_COUNTERS = (
    "all_gathers",
    "all_gather_bytes",
    "all_gather_seconds",
    "reduces",
    "reduce_bytes",
    "reduce_seconds",
    "comm_blocked_seconds",
    "engine_copy_bytes",
    "replica_all_reduces",
    "replica_all_reduce_bytes",
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

    def __init__(self, *modules: nn.Module | RaggedFSDPState, event_factory: EventFactory | None = None) -> None:
        """``event_factory``: timing events for device-true times (default: CUDA events on CUDA modules)."""
        states: list[RaggedFSDPState] = []
        for module in modules:
            found = [module] if isinstance(module, RaggedFSDPState) else list(sharded_states(module))
            if not found:
                raise ValueError(
                    f"{type(module).__name__} holds no module sharded by lightning_ragged.fully_shard; "
                    "call fully_shard first"
                )
            states += [state for state in found if all(state is not other for other in states)]
        self.probes: list[EngineProbe] = [probe(state, event_factory) for state in states]
        self.device = next(iter(self.probes[0].dbuffers)).dbuffer.device if self.probes[0].dbuffers else None
        self.steps_total = 0
        # the monitor's scrape thread reads totals() while the training thread ends steps and computes:
        # one of them at a time reads the device events and moves the window (an RLock: compute reads them too)
        self._lock = threading.RLock()
        self._excluded_since: float | None = None  # perf_counter() at begin_excluded, until end_excluded
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
        a = g = s = r = rb = rs = blocked = copies = ra = rab = 0.0
        for p in self.probes:
            stats = p.state.stats
            a += stats.all_gathers
            g += stats.all_gather_bytes
            r += stats.reduces
            rb += stats.reduce_bytes
            timer = p.timer
            s += stats.all_gather_seconds if timer is None else timer.all_gather_seconds
            rs += stats.reduce_seconds if timer is None else timer.reduce_seconds
            blocked += p.blocked_seconds
            copies += p.engine_copy_bytes
            ra += stats.replica_all_reduces
            rab += stats.replica_all_reduce_bytes
        return a, g, s, r, rb, rs, blocked, copies, ra, rab

    def _fold(self, keys: Iterable[str] = _COUNTERS) -> None:
        """Add the counters' growth since the last fold to the window."""
        totals = self._totals()
        last = list(self._last_totals)
        for index, key in enumerate(_COUNTERS):
            if key in keys:
                self._window[key] += totals[index] - last[index]
                last[index] = totals[index]
        self._last_totals = tuple(last)

    def _collect_device_times(self) -> None:
        """Read the device times that completed (no synchronize) into the window."""
        timers = [p.timer for p in self.probes if p.timer is not None]
        with self._lock:
            for timer in timers:
                timer.collect()
            if timers:
                self._fold(_DEVICE_TIMED)

    def end_step(self, copy_bytes: int | None = None) -> None:
        """Close one optimizer step: add its counters to the window (cheap: a few additions)."""
        now = time.perf_counter()
        with self._lock:
            self._fold()
            self._window_steps += 1
            self._window_seconds += now - self._step_started
            self._step_started = now
            self.steps_total += 1
            self.last_step_time = time.time()
            if copy_bytes is not None:
                self._copy_bytes.append(copy_bytes)

    def begin_excluded(self) -> None:
        """Traffic and time from here to :meth:`end_excluded` (an evaluation inside ``fit``) are not a training
        step's: what the step in progress moved so far goes into the window now; the device timers mark the
        collectives waited for in between, whenever their events complete."""
        with self._lock:
            self._collect_device_times()
            self._fold()
            self._set_excluding(True)
            self._excluded_since = time.perf_counter()

    def end_excluded(self) -> None:
        """Drop the counters' growth since :meth:`begin_excluded`, and its duration from the step in progress
        (a validation between micro-batches keeps their time). Device times of training collectives that
        completed meanwhile stay in the window."""
        with self._lock:
            self._set_excluding(False)
            self._collect_device_times()
            self._last_totals = self._totals()
            if self._excluded_since is not None:
                self._step_started += time.perf_counter() - self._excluded_since
                self._excluded_since = None

    def _set_excluding(self, excluding: bool) -> None:
        for p in self.probes:
            if p.timer is not None:
                p.timer.excluding = excluding

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
        with self._lock:
            return self._compute(per_group, reset)

    def _compute(self, per_group: bool, reset: bool) -> dict[str, float]:
        self._collect_device_times()
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
        """(label, DBuffer) of every DBuffer (``flight_recorder.collective_signatures`` names its collectives)."""
        for p in self.probes:
            for info in p.dbuffers:
                yield info.label, info.dbuffer

    def totals(self) -> dict[str, float]:
        """Cumulative counters since the module was sharded (for Prometheus counters)."""
        with self._lock:
            self._collect_device_times()
            return dict(zip(_COUNTERS, self._totals()))

    def close(self) -> None:
        """Remove the probes (the engine runs exactly as before)."""
        for p in self.probes:
            p.remove()
