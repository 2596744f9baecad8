"""Device-true collective times: timing events recorded around each collective, read lazily.

On an accelerator the training thread only enqueues: a collective's "wait" inserts a stream
dependency and returns at once, so wall-clock times of the calls say nothing about the device.
The probe (``probes.py``) hands every DBuffer event of a device module to a
:class:`CollectiveTimer`, which records timing events (``torch.Event``, device-generic):

* ``S`` on the compute stream right after a collective is issued: the point the collective
  may start (its comm stream waited for the compute enqueued before the issue, ``streams.py``);
* ``D`` on the comm stream the collective runs on, right after the issue: its completion
  (the engine's comm streams; none when it runs on no stream of ours);
* ``E`` on the compute stream right after it is waited for: the point its consumer may use it;
* ``W`` the latest compute event recorded before that wait (any DBuffer event: a reshard, a
  reduction issued, another wait; at least ``S``): the compute enqueued before the wait.

In flight is ``D - S`` (``E - S`` without ``D``; issue to completion, as on CPU); compute
stalled on it for ``E - W`` (an upper bound: compute enqueued after the last DBuffer event
and before the wait counts as stall; exact in the engine's forward and backward, where every
wait follows a reshard, a reduction or another wait). Nothing is read in the hot path:
:meth:`CollectiveTimer.collect` (at ``EngineMetrics.compute``) reads only the pairs whose
events have completed (``query()``, never a synchronize) and leaves the rest for later.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Hashable, Protocol

import torch

from lightning_ragged.engine.streams import has_streams


class TimingEvent(Protocol):
    """What :class:`torch.Event` offers (a test can hand in fakes with known times)."""

    def record(self, stream: Any = None) -> None:
        """On ``stream`` (default: the current stream)."""

    def query(self) -> bool: ...

    def elapsed_time(self, end: "TimingEvent") -> float:
        """Milliseconds from this event to ``end``."""


EventFactory = Callable[[], TimingEvent]


def device_event_factory(device: torch.device | None) -> EventFactory | None:
    """Timing events of an accelerator ``device`` (CUDA first), or None on CPU (wall-clock times are device times)."""
    if not has_streams(device):
        return None
    device = torch.device(device)
    return lambda: _DeviceEvent(device)


class _DeviceEvent:
    """A timing ``torch.Event`` recorded by default on ``device``'s current stream: ``torch.Event.record()``
    takes the current device's, which fails for a model on another device (no ``set_device`` in the script)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.event = torch.Event(device=device, enable_timing=True)

    def record(self, stream: Any = None) -> None:
        self.event.record(stream if stream is not None else torch.accelerator.current_stream(self.device))

    def query(self) -> bool:
        return self.event.query()

    def elapsed_time(self, end: "_DeviceEvent") -> float:
        return self.event.elapsed_time(end.event)


class CollectiveTimer:
    """Cumulative device seconds in flight and stalled, per kind of collective."""

    def __init__(self, factory: EventFactory) -> None:
        self.factory = factory
        self.all_gather_seconds = 0.0
        self.reduce_seconds = 0.0
        self.blocked_seconds = 0.0
        self._last: TimingEvent | None = None
        self._issued: dict[Hashable, tuple[TimingEvent, TimingEvent | None]] = {}
        self._waited: deque[tuple[bool, TimingEvent, TimingEvent, TimingEvent, TimingEvent, bool]] = deque()
        self.excluding = False
        """While True, the collectives waited for count nowhere (an evaluation inside ``fit``; EngineMetrics)."""

    def _record(self) -> TimingEvent:
        event = self.factory()
        event.record()
        self._last = event
        return event

    def mark(self) -> None:
        """A DBuffer event that is not a collective: the compute enqueued so far."""
        self._record()

    def issued(self, key: Hashable, stream: Any = None) -> None:
        """A collective was issued (on comm ``stream``, if it runs on one)."""
        done = None
        if stream is not None:
            done = self.factory()
            done.record(stream)
        self._issued[key] = (self._record(), done)

    def failed(self, key: Hashable) -> None:
        """The issue or the wait raised: nothing to time."""
        self._issued.pop(key, None)

    def waited(self, key: Hashable, gather: bool) -> None:
        issued = self._issued.pop(key, None)
        before = self._last
        end = self._record()
        if issued is not None:
            start, done = issued
            before = before if before is not None else start
            self._waited.append((gather, start, before, end, done if done is not None else end, self.excluding))

    @property
    def pending(self) -> int:
        """Waited-for collectives whose events have not completed on the device yet."""
        return len(self._waited)

    def collect(self) -> None:
        """Add the times of every waited-for collective whose events completed (no synchronize)."""
        while self._waited:
            gather, start, before, end, done, excluded = self._waited[0]
            if not (end.query() and start.query() and before.query() and done.query()):
                return  # later ones were recorded after it on the stream
            self._waited.popleft()
            if excluded:
                continue
            in_flight = max(start.elapsed_time(done), 0.0) / 1000
            if gather:
                self.all_gather_seconds += in_flight
            else:
                self.reduce_seconds += in_flight
            self.blocked_seconds += min(max(before.elapsed_time(end), 0.0) / 1000, in_flight)
