"""Errors of a collective that never finished, and the store census that names who is missing.

The backend gives up on a collective with a bare "Timed out waiting 2000ms" or "Connection
closed by peer". :class:`CollectiveTimeoutError` (a timeout) and :class:`PeerLostError` (a
peer is gone) say which ranks did not arrive. To learn that, every rank that gives up writes
a record into the default ``torch.distributed`` store and waits a grace period
(``ARRIVAL_GRACE_S``, at most half the timeout) for the other members to do the same: a
rank that never reached the collective never writes it. Nothing is written while training
runs normally. Here, in the engine, so that the engine's and the checkpoint's collectives
(and the health monitor) share one census.
"""

from __future__ import annotations

import json
import os
import re
import time
from datetime import timedelta

import torch.distributed as dist

ARRIVAL_GRACE_S = 5.0
"""Longest wait for the other ranks' arrival records after a timeout."""

PEER_LOST_PATTERNS = re.compile(
    r"connection closed by peer|connection reset|pair closure|broken pipe|connection refused|socket closed|"
    r"remote process exited|ncclRemoteError",
    re.IGNORECASE,
)
"""Backend errors of a peer that is gone (its sockets closed): gloo's read/write errors, NCCL's remote error."""
TIMEOUT_PATTERNS = re.compile(r"timed out|timeout|watchdog caught collective", re.IGNORECASE)
"""Backend errors of a collective that gave up waiting."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not finish within the process group's timeout."""

    def __init__(
        self,
        message: str,
        *,
        group: str,
        collective: str,
        step: int,
        sequence: int,
        missing_ranks: list[int],
        arrived_ranks: list[int],
    ) -> None:
        super().__init__(message)
        self.group = group
        self.collective = collective
        self.step = step
        self.sequence = sequence
        self.missing_ranks = missing_ranks
        self.arrived_ranks = arrived_ranks


class PeerLostError(CollectiveTimeoutError):
    """A collective failed because a peer's connection closed: the peer is gone, not slow.

    A subclass of :class:`CollectiveTimeoutError` so that handlers written for it still catch
    it; the message never says "did not finish within". ``lost_ranks`` (also
    ``missing_ranks``): the members that did not answer after the connection closed;
    ``arrived_ranks``: the survivors that did; ``store_lost``: the store did not answer
    either (its host, rank 0 or the agent on rank 0's node, is gone); ``failed_at``: this
    rank's wall-clock time (``time.time()``) when the backend reported it;
    ``seconds_in_call``: how long this rank had been in the call then.
    """

    def __init__(
        self,
        message: str,
        *,
        group: str,
        collective: str,
        step: int,
        sequence: int,
        lost_ranks: list[int],
        arrived_ranks: list[int],
        store_lost: bool,
        failed_at: float,
        seconds_in_call: float | None,
    ) -> None:
        super().__init__(
            message,
            group=group,
            collective=collective,
            step=step,
            sequence=sequence,
            missing_ranks=lost_ranks,
            arrived_ranks=arrived_ranks,
        )
        self.lost_ranks = lost_ranks
        self.store_lost = store_lost
        self.failed_at = failed_at
        self.seconds_in_call = seconds_in_call


def is_peer_lost(error: BaseException) -> bool:
    """The backend says a peer's connection closed or was reset (the peer is gone)."""
    return isinstance(error, RuntimeError) and bool(PEER_LOST_PATTERNS.search(str(error)))


def is_timeout(error: BaseException) -> bool:
    """The backend gave up waiting (and no peer's connection closed)."""
    return (
        isinstance(error, RuntimeError)
        and bool(TIMEOUT_PATTERNS.search(str(error)))
        and not is_peer_lost(error)
    )


def global_ranks(process_group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``process_group`` (the default group when ``None``)."""
    if process_group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(process_group)


def short_ranks(ranks: list[int]) -> str:
    """``ranks`` for a message: ``0..7`` for a contiguous run, the list otherwise."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}..{ranks[-1]}"
    return str(ranks)


def default_store() -> dist.Store | None:
    """The default ``torch.distributed`` store, or ``None`` when there is none."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def grace_seconds(timeout: float | None) -> float:
    """How long a census waits for the other members: ``ARRIVAL_GRACE_S``, at most half the timeout."""
    return ARRIVAL_GRACE_S if timeout is None else min(ARRIVAL_GRACE_S, max(0.5, timeout / 2))


class _BoundedStore:
    """The default store with its timeout lowered to ``seconds`` while a census runs (restored after)."""

    def __init__(self, store: dist.Store, seconds: float) -> None:
        self.store = store
        self.seconds = seconds
        self.previous = None

    def __enter__(self) -> dist.Store:
        try:
            self.previous = self.store.timeout
            self.store.set_timeout(timedelta(seconds=max(1.0, self.seconds)))
        except (RuntimeError, AttributeError):
            self.previous = None
        return self.store

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            try:
                self.store.set_timeout(self.previous)
            except RuntimeError:
                pass


def arrival_census(
    group_key: str, sequence: int, members: list[int], timeout: float | None
) -> tuple[set[int] | None, str | None]:
    """Record that this rank reached collective ``sequence``; the members that did the same in the grace period.

    ``(None, None)`` without a store; ``(None, error)`` when the store stopped answering.
    """
    store = default_store()
    if store is None:
        return None, None
    prefix = f"ragged_fsdp/arrived/{group_key}/{sequence}/"
    me = dist.get_rank()
    grace = grace_seconds(timeout)
    try:
        with _BoundedStore(store, grace + 5) as bounded:
            bounded.set(f"{prefix}{me}", str(time.time()))
            deadline = time.monotonic() + grace
            arrived = {me}
            while True:
                for rank in members:
                    if rank not in arrived and bounded.check([f"{prefix}{rank}"]):
                        arrived.add(rank)
                if len(arrived) == len(members) or time.monotonic() >= deadline:
                    return arrived, None
                time.sleep(0.05)
    except (RuntimeError, ValueError) as error:  # the store itself is gone (its host died, or the job is tearing down)
        return None, first_line(error)


def lost_census(
    group_key: str, members: list[int], record: dict, timeout: float | None
) -> tuple[dict[int, dict] | None, str | None]:
    """After a peer's connection closed: which members are still there to say so.

    Every survivor writes ``lost/<group>/<rank>`` (its record: when it saw the connection
    close, in which collective) and waits the grace period for the other members' records.
    Keyed by group, not by collective number: survivors may fail in different collectives.
    Rank 0, which usually hosts the store, then waits (at most one more grace period) until
    the survivors it heard from have finished reading, so that its own exit does not make
    them think it is gone. ``(records by rank, None)``; ``(None, None)`` without a store;
    ``(records, error)`` when the store stopped answering midway (``records`` holds only
    this rank's own when nothing else was read: the store's host is gone).
    """
    store = default_store()
    if store is None:
        return None, None
    prefix = f"ragged_fsdp/lost/{group_key}/"
    me = dist.get_rank()
    grace = grace_seconds(timeout)
    answered = {me: record}
    try:
        with _BoundedStore(store, grace + 5) as bounded:
            bounded.set(f"{prefix}{me}", json.dumps(record))
            deadline = time.monotonic() + grace
            while len(answered) < len(members) and time.monotonic() < deadline:
                time.sleep(0.05)
                for rank in members:
                    key = f"{prefix}{rank}"
                    if rank not in answered and bounded.check([key]):
                        try:
                            answered[rank] = json.loads(bounded.get(key))
                        except ValueError:
                            answered[rank] = {}
            bounded.set(f"{prefix}read/{me}", "1")
            if me == 0:
                others = [f"{prefix}read/{rank}" for rank in answered if rank != me]
                deadline = time.monotonic() + grace
                while others and not bounded.check(others) and time.monotonic() < deadline:
                    time.sleep(0.05)
            return answered, None
    except (RuntimeError, ValueError) as error:
        return answered, first_line(error)


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type's name when it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def store_host() -> tuple[str, bool]:
    """What hosts the default store (for messages) and whether that host is rank 0 (or rank 0's torchrun agent)."""
    store = default_store()
    seen = 0
    while store is not None and seen < 8 and hasattr(store, "underlying_store"):  # PrefixStore(s)
        store = store.underlying_store
        seen += 1
    if isinstance(store, dist.TCPStore):
        where = f"TCPStore {store.host}:{store.port}"
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            return f"the torchrun agent on rank 0's node, which hosts the rendezvous store ({where})", True
        return f"rank 0, which hosts the rendezvous store ({where})", True
    if store is None:
        return "the torch.distributed store", False
    return f"the torch.distributed store ({type(store).__name__})", False


def store_gone_text(members: list[int], store_error: str) -> str:
    """The census part of a message when the store stopped answering."""
    host, rank_zero = store_host()
    if rank_zero and 0 in members:
        return (
            f"{host}, is gone: the store no longer answers ({store_error}), so which other ranks are gone "
            "cannot be learned (no store to compare notes)"
        )
    return f"{host} no longer answers ({store_error}); which ranks are gone cannot be learned"
