"""Observers of the DBuffers: what the engine tells them, and when.

A DBuffer calls the observers in its ``observers`` list where its memory or its
collectives change: an all-gather issued or waited for, the full parameter buffer freed,
a reduction issued or waited for, the gradient buffer allocated or freed. Each event
carries the DBuffer, the collective, the seconds the training thread spent inside the
call and the exception that ended it, if any; an observer may answer with a replacement
exception (a named diagnostic), which the engine raises ``from`` the original. With no
observer, a call costs one empty-list check. ``observability/probes.py`` is the observer
that counts time and bytes; the engine knows nothing of what observers do.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol


class EventKind(enum.Enum):
    UNSHARD_ISSUED = "unshard issued"
    """The full buffer was allocated and its all-gather issued (a synchronous unshard then waits)."""
    UNSHARD_WAITED = "unshard waited"
    """An issued all-gather was waited for."""
    RESHARDED = "resharded"
    """The full parameter buffer was freed (reshard, reshard to a kept part, reset)."""
    REDUCE_ISSUED = "reduce issued"
    """The flat gradient's reduction was issued (a synchronous one then waits)."""
    REDUCE_WAITED = "reduce waited"
    """An issued reduction was waited for and its segment written into the sharded gradients."""
    GRAD_BUFFER_ALLOCATED = "gradient buffer allocated"
    GRAD_BUFFER_FREED = "gradient buffer freed"


@dataclass(slots=True)
class DBufferEvent:
    """One event of one DBuffer (not frozen: a frozen dataclass doubles the cost of creating one)."""

    kind: EventKind
    dbuffer: Any
    """The :class:`~lightning_ragged.engine.dbuffer.DBuffer` (not imported here: it imports this module)."""
    collective: str | None
    """``"all_gather"`` or the reduction's ``reduce_mode`` (``"pairwise"``, ``"all_reduce"``, ``"reduce_scatter"``); ``None`` for buffer events."""
    seconds: float
    """Time the calling thread spent inside the call (0 for events that are not calls)."""
    error: BaseException | None


class DBufferObserver(Protocol):
    def on_event(self, event: DBufferEvent) -> BaseException | None:
        """React to ``event``; an exception returned replaces ``event.error`` (raised from it)."""


def notify(
    dbuffer: Any,
    kind: EventKind,
    collective: str | None = None,
    seconds: float = 0.0,
    error: BaseException | None = None,
) -> BaseException | None:
    """Tell every observer of ``dbuffer``; the first replacement exception one returned, if any."""
    event = DBufferEvent(kind, dbuffer, collective, seconds, error)
    replacement = None
    for observer in tuple(dbuffer.observers):
        answer = observer.on_event(event)
        if replacement is None and answer is not None and answer is not error:
            replacement = answer
    return replacement


def observed(dbuffer: Any, kind: EventKind, collective: str | None, call: Callable[..., None], *args: Any) -> None:
    """Run ``call(*args)`` and tell ``dbuffer``'s observers how long it took and how it ended."""
    if not dbuffer.observers:
        call(*args)
        return
    started = time.perf_counter()
    try:
        call(*args)
    except BaseException as error:
        replacement = notify(dbuffer, kind, collective, time.perf_counter() - started, error)
        if replacement is not None:
            raise replacement from error
        raise
    notify(dbuffer, kind, collective, time.perf_counter() - started)
