"""Probes on the engine's DBuffers: time blocked in collectives, buffer memory, engine copies, diagnostics.

``probe(module)`` subscribes, once per sharded module, an observer to every DBuffer
(``engine/events.py``); the engine tells it of each all-gather and reduction (issued,
waited for) and each full or gradient buffer allocated or freed. Each event costs a few
integer updates; exceptions cost nothing until one is raised. From the events the probe

* adds the time the training thread spent *inside* the calls (issuing a collective or
  waiting for it) to ``blocked_*_seconds``. ``CommStats`` has the in-flight time (issue
  to completion), so the share of communication hidden behind compute is
  ``1 - blocked / in_flight``. On CUDA, where the calls only enqueue, a
  :class:`~lightning_ragged.observability.device_timing.CollectiveTimer` times the same
  quantities on the device with timing events, read lazily (``device_timing.py``);
* tracks the bytes of unsharded parameter and gradient buffers alive right now and their
  peak (``reset_peaks`` starts a new window);
* counts the bytes the engine itself copies outside the collectives (the mixed-precision
  casts before an all-gather and before a reduction, fp8's quantize/dequantize; with fp32 buffers, zero);
* numbers the collectives of each process group and turns a timeout, a dead peer or an
  out-of-memory error into the named errors of ``diagnostics.py``.
"""

from __future__ import annotations

import itertools
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from lightning_ragged.engine.api import RaggedFSDPState, get_state
from lightning_ragged.engine.dbuffer import DBuffer
from lightning_ragged.engine.events import DBufferEvent, EventKind
from lightning_ragged.observability import diagnostics
from lightning_ragged.observability.device_timing import CollectiveTimer, EventFactory, device_event_factory

_instances = itertools.count()


class DBufferInfo:
    """What a probe knows about one DBuffer: its group, its index in the group, its sizes."""

    __slots__ = (
        "dbuffer", "group", "index", "label", "unsharded_bytes", "grad_buffer_bytes", "grad_counted", "cast_bytes",
        "landing_elements", "casts_seen", "quantizations_seen", "counted",
    )

    def __init__(self, dbuffer: DBuffer, group: str, index: int, dbuffers_in_group: int) -> None:
        self.dbuffer = dbuffer
        self.group = group
        self.index = index
        self.label = group if dbuffers_in_group == 1 else f"{group}#{index}"
        element = torch.empty((), dtype=dbuffer.param_dtype).element_size()
        self.unsharded_bytes = 0 if dbuffer.full_is_shard else dbuffer.layout.buffer_numel * element
        """Bytes an unshard allocates: none where the full buffer is the shard itself (world size 1, no cast)."""
        self.counted = dbuffer.is_unsharded
        """Its full buffer is in ``EngineProbe.unsharded_bytes`` (allocated at the issue, an fp8 one at the wait)."""
        self.cast_bytes = dbuffer.layout.segment_size * element if dbuffer.param_dtype != dbuffer.master_dtype else 0
        """Bytes of one cast of the shard to the compute dtype (``keep_cast_shard`` makes fewer casts than gathers)."""
        self.casts_seen = dbuffer.shard_cast.casts
        self.quantizations_seen = 0 if dbuffer.fp8_gather is None else dbuffer.fp8_gather.quantizations
        """An fp8 gather writes its quantized chunk (unless a kept one serves) and dequantizes into the full buffer."""
        self.grad_buffer_bytes = dbuffer.layout.buffer_numel * dbuffer.grad_dtype.itemsize
        """The full gradient buffer while gradients sync (the narrower of compute and reduce dtype)."""
        self.grad_counted = 0
        """Bytes of its gradient buffer in ``EngineProbe.grad_bytes`` (``no_sync`` accumulates in the reduce dtype)."""
        trainable = sum(p.numel() for p in dbuffer.unsharded_params.values() if p.requires_grad)
        self.landing_elements = trainable if dbuffer.reduce_dtype != dbuffer.param_dtype else 0
        """Elements copied into the gradient buffer per reduction (gradients land by a copy, ``dbuffer.py``)."""

    def reduce_copy_bytes(self) -> int:
        """Bytes the engine copied for the reduction being issued: the gradients' landing (once per reduction,
        also after ``no_sync`` micro-batches), the cast to the reduce dtype (``collectives.reduce``: this rank's
        segment for ``pairwise``, else the whole buffer; on a single rank the write into the sharded gradient)."""
        dbuffer = self.dbuffer
        grad, reduce_dtype = dbuffer.unsharded_grad, dbuffer.reduce_dtype
        cast = 0
        if grad.dtype != reduce_dtype:
            numel = dbuffer.layout.segment_size if dbuffer.reduce_mode == "pairwise" else dbuffer.layout.buffer_numel
            cast = numel * reduce_dtype.itemsize
        return self.landing_elements * grad.element_size() + cast


class _Subscription:
    """The observer subscribed to one DBuffer: hands its events to the probe with that buffer's info."""

    __slots__ = ("probe", "info")

    def __init__(self, probe: "EngineProbe", info: DBufferInfo) -> None:
        self.probe = probe
        self.info = info

    def on_event(self, event: DBufferEvent) -> BaseException | None:
        return self.probe.on_event(self.info, event)


class EngineProbe:
    """Cumulative counters of one sharded module, fed by its DBuffers' events."""

    def __init__(self, state: RaggedFSDPState, event_factory: EventFactory | None = None) -> None:
        """``event_factory``: timing events for device-true times (default: CUDA events on a CUDA module)."""
        self.state = state
        self.dbuffers: list[DBufferInfo] = []
        for group in state.all_groups:
            for index, dbuffer in enumerate(group.dbuffers):
                self.dbuffers.append(DBufferInfo(dbuffer, group.name, index, len(group.dbuffers)))
        self.blocked_all_gather_seconds = 0.0
        self.blocked_reduce_seconds = 0.0
        self.engine_copy_bytes = 0
        self.unsharded_bytes = sum(info.unsharded_bytes for info in self.dbuffers if info.counted)
        self.unsharded_peak_bytes = self.unsharded_bytes
        for info in self.dbuffers:
            info.grad_counted = info.dbuffer.unsharded_grad.untyped_storage().nbytes()
        self.grad_bytes = sum(info.grad_counted for info in self.dbuffers)
        self.grad_peak_bytes = self.grad_bytes
        self.step = 0
        """Set by the caller (the Lightning callback sets the global step); named in diagnostics."""
        self.collective_timeout: float | None = None
        """Seconds, when known (the strategy's timeout); otherwise read from the backend's error."""
        self.diagnostics = True
        self._sequence: dict[str, int] = {}
        self._pending_sequence: dict[tuple[int, str], int] = {}
        self._instance = next(_instances)
        device = self.dbuffers[0].dbuffer.device if self.dbuffers else None
        factory = event_factory if event_factory is not None else device_event_factory(device)
        self.timer = CollectiveTimer(factory) if factory is not None else None
        """Device times of the collectives (CUDA, or an injected factory); None: the wall-clock times are them."""
        self._subscriptions = [_Subscription(self, info) for info in self.dbuffers]
        for subscription in self._subscriptions:
            subscription.info.dbuffer.observers.append(subscription)

    # ------------------------------------------------------------ counters
    def reset_peaks(self) -> None:
        """Start a new window for the peak gauges (at the current level)."""
        self.unsharded_peak_bytes = self.unsharded_bytes
        self.grad_peak_bytes = self.grad_bytes

    def group_key(self, dbuffer: DBuffer) -> str:
        """A name of the dbuffer's process group that is the same on every member rank."""
        group = dbuffer.process_group if dbuffer.process_group is not None else dist.group.WORLD
        return f"{getattr(group, 'group_name', 'world')}.{self._instance}"

    def _next_sequence(self, dbuffer: DBuffer, collective: str) -> None:
        key = self.group_key(dbuffer)
        number = self._sequence.get(key, 0) + 1
        self._sequence[key] = number
        self._pending_sequence[(id(dbuffer), collective)] = number

    def pending_sequence(self, dbuffer: DBuffer, collective: str) -> int:
        """The number (on its process group) of the dbuffer's last ``collective`` issued."""
        return self._pending_sequence.get((id(dbuffer), collective), 0)

    def remove(self) -> None:
        """Unsubscribe from the DBuffers (the engine runs exactly as without a probe)."""
        for subscription in self._subscriptions:
            observers = subscription.info.dbuffer.observers
            if subscription in observers:
                observers.remove(subscription)
        self._subscriptions.clear()

    # -------------------------------------------------------------- events
    def on_event(self, info: DBufferInfo, event: DBufferEvent) -> BaseException | None:
        """Count one DBuffer event; for a failed call, the named error to raise instead (or None)."""
        kind, failed = event.kind, event.error is not None
        if self.timer is not None:
            self._time(info, event, failed)
        if kind is EventKind.UNSHARD_ISSUED:
            self._next_sequence(info.dbuffer, "all_gather")
            self.blocked_all_gather_seconds += event.seconds
            if not failed:
                casts, info.casts_seen = info.dbuffer.shard_cast.casts - info.casts_seen, info.dbuffer.shard_cast.casts
                self.engine_copy_bytes += casts * info.cast_bytes
                fp8 = info.dbuffer.fp8_gather
                if fp8 is not None:
                    made, info.quantizations_seen = fp8.quantizations - info.quantizations_seen, fp8.quantizations
                    self.engine_copy_bytes += made * fp8.rank_bytes + info.unsharded_bytes
            self._count_unsharded(info)
        elif kind is EventKind.UNSHARD_WAITED:
            self.blocked_all_gather_seconds += event.seconds
            self._count_unsharded(info)
        elif kind is EventKind.RESHARDED:
            if info.counted:
                info.counted = False
                self.unsharded_bytes -= info.unsharded_bytes
        elif kind is EventKind.REDUCE_ISSUED:
            self._next_sequence(info.dbuffer, event.collective)
            self.blocked_reduce_seconds += event.seconds
            if not failed:
                self.engine_copy_bytes += info.reduce_copy_bytes()
        elif kind is EventKind.REDUCE_WAITED:
            self.blocked_reduce_seconds += event.seconds
        elif kind is EventKind.GRAD_BUFFER_ALLOCATED:
            if not failed:
                info.grad_counted = info.dbuffer.unsharded_grad.untyped_storage().nbytes()
                self.grad_bytes += info.grad_counted
                if self.grad_bytes > self.grad_peak_bytes:
                    self.grad_peak_bytes = self.grad_bytes
        elif kind is EventKind.GRAD_BUFFER_FREED:
            self.grad_bytes -= info.grad_counted
            info.grad_counted = 0
        if not failed or not self.diagnostics:
            return None
        collective = "gradient buffer" if kind is EventKind.GRAD_BUFFER_ALLOCATED else event.collective
        return diagnostics.translate(event.error, self._failure(info, collective, event.seconds), collective)

    def _count_unsharded(self, info: DBufferInfo) -> None:
        """Count a full buffer once it is allocated: at its issue, or (fp8) at its wait; a failed call too,
        when it allocated (the reset's RESHARDED takes it off again)."""
        if not info.counted and info.dbuffer.is_unsharded:
            info.counted = True
            self.unsharded_bytes += info.unsharded_bytes
            if self.unsharded_bytes > self.unsharded_peak_bytes:
                self.unsharded_peak_bytes = self.unsharded_bytes

    def _time(self, info: DBufferInfo, event: DBufferEvent, failed: bool) -> None:
        kind = event.kind
        gather = kind is EventKind.UNSHARD_ISSUED or kind is EventKind.UNSHARD_WAITED
        key = (id(info.dbuffer), gather)
        if failed:
            if event.collective is not None:
                self.timer.failed(key)
        elif kind is EventKind.UNSHARD_ISSUED or kind is EventKind.REDUCE_ISSUED:
            self.timer.issued(key, info.dbuffer.streams.timing_stream(gather))
        elif gather or kind is EventKind.REDUCE_WAITED:
            self.timer.waited(key, gather)
        else:
            self.timer.mark()

    @property
    def blocked_seconds(self) -> float:
        """Time blocked in collectives: the device stream's stall (with a timer) or the training thread's."""
        if self.timer is not None:
            return self.timer.blocked_seconds
        return self.blocked_all_gather_seconds + self.blocked_reduce_seconds

    def _grad_allocation_bytes(self, info: DBufferInfo) -> int:
        """What a gradient buffer allocation asks for: in the reduce dtype under ``no_sync``."""
        group = next(group for group in self.state.all_groups if info.dbuffer in group.dbuffers)
        if self.state.syncs(group):
            return info.grad_buffer_bytes
        return info.dbuffer.layout.buffer_numel * info.dbuffer.reduce_dtype.itemsize

    def _failure(self, info: DBufferInfo, collective: str, seconds: float) -> diagnostics.Failure:
        return diagnostics.Failure(
            dbuffer=info.dbuffer,
            label=info.label,
            buffer_bytes=self._grad_allocation_bytes(info) if collective == "gradient buffer" else info.unsharded_bytes,
            step=self.step,
            sequence=self.pending_sequence(info.dbuffer, collective),
            group_key=self.group_key(info.dbuffer),
            collective_timeout=self.collective_timeout,
            seconds_in_call=seconds,
            unsharded_bytes=self.unsharded_bytes,
            grad_bytes=self.grad_bytes,
        )


def probe(module: nn.Module | RaggedFSDPState, event_factory: EventFactory | None = None) -> EngineProbe:
    """The probe of a module sharded by ``fully_shard``, subscribed on first use (idempotent).

    ``event_factory`` applies to a new probe only (default: CUDA timing events on a CUDA module).
    """
    state = module if isinstance(module, RaggedFSDPState) else get_state(module)
    for dbuffer in state.dbuffers():  # subscribed to every DBuffer: the first one tells
        for observer in dbuffer.observers:
            if isinstance(observer, _Subscription) and observer.probe.state is state:
                return observer.probe
        break
    return EngineProbe(state, event_factory)


def sharded_states(module: nn.Module) -> Iterator[RaggedFSDPState]:
    """Every engine state in ``module``'s tree (the outermost sharded modules)."""
    seen: set[int] = set()
    for submodule in module.modules():
        try:
            state = get_state(submodule)
        except ValueError:  # not sharded
            continue
        if id(state) not in seen:
            seen.add(id(state))
            yield state
