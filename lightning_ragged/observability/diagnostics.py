"""Named errors for the two ways a sharded job dies confusingly: a stuck collective and an OOM at unshard.

**Stuck collective** (the FAQ "stuck at AllGather"). The backend gives up after the
process group's timeout (the strategy's ``timeout``) with a bare "Timed out waiting
2000ms" or "Connection closed by peer". The probe catches it and raises
:class:`CollectiveTimeoutError` naming the FSDP group, the collective, the training step,
the collective's number on its process group, and the ranks that did not arrive. To
find those, every rank that gives up writes ``arrived/<group>/<number>/<rank>`` into
the default ``torch.distributed`` store and waits a grace period
(``ARRIVAL_GRACE_S``, at most half the timeout) for the others to do the same: a rank
that never reached the collective (stalled in data loading, a different code path, a
dead process) never writes it. Nothing is written while training runs normally.

**A lost peer** (a rank died, was killed, or its node was lost): gloo reports "Connection
closed by peer" or "Connection reset by peer" within a fraction of a second, long before any
timeout. That is not a timeout and is not reported as one: :class:`PeerLostError` says whose
connection closed and when. Every survivor writes ``lost/<group>/<rank>`` into the store
and waits the same grace period for the others; the members that never answer are the
lost ranks. When the store itself no longer answers, its host is gone: rank 0 (or, under
torchrun, the agent on rank 0's node), and the error says so.

**Out of memory while unsharding** (allocating a group's full buffer for the
all-gather or its gradient buffer): :class:`UnshardOutOfMemoryError` names the group,
the buffer size, what is already unsharded, and the knobs that shrink it.
"""

from __future__ import annotations

import json
import os
import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_ragged.observability.probes import DBufferInfo, EngineProbe

ARRIVAL_GRACE_S = 5.0
"""Longest wait for the other ranks' arrival records after a timeout."""

_PEER_LOST_PATTERNS = re.compile(
    r"connection closed by peer|connection reset|pair closure|broken pipe|connection refused|socket closed|"
    r"remote process exited|ncclRemoteError",
    re.IGNORECASE,
)
"""Backend errors of a peer that is gone (its sockets closed): gloo's read/write errors, NCCL's remote error."""
_TIMEOUT_PATTERNS = re.compile(r"timed out|timeout|watchdog caught collective", re.IGNORECASE)
_PEER_ADDRESS = re.compile(r"\[([0-9a-fA-F:.]+)\]:(\d+)")
_OOM_PATTERNS = re.compile(r"out of memory|can't allocate memory|cannot allocate memory", re.IGNORECASE)
_MILLISECONDS = re.compile(r"waiting (\d+)ms")


class CollectiveTimeoutError(RuntimeError):
    """A collective of the engine did not finish within the process group's timeout."""

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
    """A collective of the engine failed because a peer's connection closed: the peer is gone, not slow.

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


class UnshardOutOfMemoryError(RuntimeError):
    """Allocating a group's full (unsharded) buffer ran out of memory."""

    def __init__(self, message: str, *, group: str, buffer_bytes: int) -> None:
        super().__init__(message)
        self.group = group
        self.buffer_bytes = buffer_bytes


def is_peer_lost(error: BaseException) -> bool:
    """The backend says a peer's connection closed or was reset (the peer is gone)."""
    return isinstance(error, RuntimeError) and bool(_PEER_LOST_PATTERNS.search(str(error)))


def is_timeout(error: BaseException) -> bool:
    """The backend gave up waiting (and no peer's connection closed)."""
    return (
        isinstance(error, RuntimeError)
        and bool(_TIMEOUT_PATTERNS.search(str(error)))
        and not is_peer_lost(error)
    )


def is_out_of_memory(error: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", ())
    return (oom_type and isinstance(error, oom_type)) or (
        isinstance(error, RuntimeError) and bool(_OOM_PATTERNS.search(str(error)))
    )


def translate(error: BaseException, probe: "EngineProbe", info: "DBufferInfo", collective: str) -> BaseException:
    """The named error for ``error`` raised in ``collective`` of ``info``'s group, or ``error`` itself."""
    if isinstance(error, (CollectiveTimeoutError, UnshardOutOfMemoryError)):
        return error
    if is_out_of_memory(error) and collective in ("all_gather", "gradient buffer"):
        return _out_of_memory(error, probe, info, collective)
    if is_peer_lost(error) and collective != "gradient buffer":
        return _peer_lost(error, probe, info, collective)
    if is_timeout(error) and collective != "gradient buffer":
        return _timeout(error, probe, info, collective)
    return error


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:,.1f} {unit}" if unit != "B" else f"{int(nbytes):,} B"
        nbytes /= 1024
    return f"{nbytes} B"


def _out_of_memory(error: BaseException, probe: "EngineProbe", info: "DBufferInfo", what: str) -> BaseException:
    dbuffer = info.dbuffer
    kind = "full parameter buffer (all-gather target)" if what == "all_gather" else "full gradient buffer"
    layout = dbuffer.layout
    message = (
        f"out of memory while unsharding FSDP group {info.label!r}: its {kind} needs "
        f"{_human(info.unsharded_bytes)} ({layout.world_size} ranks x segment {layout.segment_size:,} elements "
        f"x {dbuffer.param_dtype}); {_human(probe.unsharded_bytes)} of full parameters and "
        f"{_human(probe.grad_bytes)} of full gradients were already allocated, at step {probe.step}. "
        "To shrink it: lower `dbuffer_size` (fully_shard / RaggedFSDPStrategy; a group is split into DBuffers "
        "of at most that many bytes) or shard at a finer `group_modules`; keep `reshard_after_forward=True` "
        "(frees each group after its forward); use a bf16 `param_dtype` (mixed precision); or enable "
        "activation checkpointing to leave more room. "
        f"Original error: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    )
    return UnshardOutOfMemoryError(message, group=info.label, buffer_bytes=info.unsharded_bytes)


def _timeout(error: BaseException, probe: "EngineProbe", info: "DBufferInfo", collective: str) -> BaseException:
    dbuffer = info.dbuffer
    process_group = dbuffer.process_group
    members = _global_ranks(process_group)
    sequence = probe.pending_sequence(dbuffer, "all_gather" if collective == "all_gather" else collective)
    timeout = probe.collective_timeout
    if timeout is None:
        match = _MILLISECONDS.search(str(error))
        timeout = int(match.group(1)) / 1000 if match else None
    arrived, store_error = _arrival_census(probe.group_key(dbuffer), sequence, members, timeout)
    if arrived is None:
        missing_text = "unknown (no torch.distributed store to compare notes)"
        if store_error is not None:
            missing_text = f"unknown: {_store_gone_text(members, store_error)}"
        missing: list[int] = []
        arrived_list: list[int] = [dist.get_rank()]  # at least this rank was waiting
    else:
        arrived_list = sorted(arrived)
        missing = [rank for rank in members if rank not in arrived]
        missing_text = f"ranks {missing} did not arrive" if missing else "every rank arrived (a backend or network fault)"
    within = f"within {timeout:g} s" if timeout is not None else "within the process group's timeout"
    message = (
        f"collective {collective} of FSDP group {info.label!r} ({_human(info.unsharded_bytes)}) did not finish "
        f"{within} at step {probe.step} (collective #{sequence} on process group of ranks {_short(members)}): "
        f"{missing_text}; ranks {arrived_list} were waiting in it. "
        "A rank that did not arrive is stalled elsewhere (data loading, a different code path or number of "
        "batches, a Python exception, a dead process): look at its logs and stack (py-spy dump). "
        f"Backend error: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    )
    return CollectiveTimeoutError(
        message,
        group=info.label,
        collective=collective,
        step=probe.step,
        sequence=sequence,
        missing_ranks=missing,
        arrived_ranks=arrived_list,
    )


def _global_ranks(process_group: dist.ProcessGroup | None) -> list[int]:
    if process_group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(process_group)


def _short(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}..{ranks[-1]}"
    return str(ranks)


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _grace(timeout: float | None) -> float:
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


def _arrival_census(
    group_key: str, sequence: int, members: list[int], timeout: float | None
) -> tuple[set[int] | None, str | None]:
    """Record that this rank reached collective ``sequence``; the members that did the same in the grace period.

    ``(None, None)`` without a store; ``(None, error)`` when the store stopped answering.
    """
    store = _store()
    if store is None:
        return None, None
    prefix = f"ragged_fsdp/arrived/{group_key}/{sequence}/"
    me = dist.get_rank()
    grace = _grace(timeout)
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
        return None, _first_line(error)


def _lost_census(
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
    store = _store()
    if store is None:
        return None, None
    prefix = f"ragged_fsdp/lost/{group_key}/"
    me = dist.get_rank()
    grace = _grace(timeout)
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
        return answered, _first_line(error)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _store_host() -> tuple[str, bool]:
    """What hosts the default store (for messages) and whether that host is rank 0 (or rank 0's torchrun agent)."""
    store = _store()
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


def _store_gone_text(members: list[int], store_error: str) -> str:
    host, rank_zero = _store_host()
    if rank_zero and 0 in members:
        return (
            f"{host}, is gone: the store no longer answers ({store_error}), so which other ranks are gone "
            "cannot be learned (no store to compare notes)"
        )
    return f"{host} no longer answers ({store_error}); which ranks are gone cannot be learned"


def _clock(seconds: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds * 1000) % 1000:03d} UTC"


def _connection_event(text: str) -> str:
    lowered = text.lower()
    for needle, event in (
        ("connection reset", "connection reset by peer"),
        ("connection closed", "connection closed by peer"),
        ("broken pipe", "broken pipe"),
        ("connection refused", "connection refused"),
        ("pair closure", "pair closure"),
        ("socket closed", "socket closed"),
        ("remote process exited", "remote process exited"),
        ("ncclremoteerror", "NCCL remote error"),
    ):
        if needle in lowered:
            return event
    return "connection closed"


def _peer_lost(error: BaseException, probe: "EngineProbe", info: "DBufferInfo", collective: str) -> BaseException:
    failed_at = time.time()
    seconds_in_call = getattr(probe, "seconds_in_call", None)
    dbuffer = info.dbuffer
    members = _global_ranks(dbuffer.process_group)
    sequence = probe.pending_sequence(dbuffer, "all_gather" if collective == "all_gather" else collective)
    timeout = probe.collective_timeout
    if timeout is None:
        match = _MILLISECONDS.search(str(error))
        timeout = int(match.group(1)) / 1000 if match else None
    backend = _first_line(error)
    event = _connection_event(str(error))
    me = dist.get_rank()
    record = {"time": failed_at, "collective": collective, "sequence": sequence, "step": probe.step, "event": event}
    answered, store_error = _lost_census(probe.group_key(dbuffer), members, record, timeout)
    grace = _grace(timeout)
    store_lost = store_error is not None and (answered is None or len(answered) <= 1)
    closed_at = failed_at
    if store_lost:
        host, rank_zero = _store_host()
        lost = [0] if rank_zero and 0 in members and me != 0 else []
        arrived = [me]
        census = _store_gone_text(members, store_error or "")
    elif answered is None:
        lost, arrived = [], [me]
        census = "which rank is gone is unknown (no torch.distributed store to compare notes)"
    else:
        arrived = sorted(answered)
        lost = [rank for rank in members if rank not in answered]
        times = [r.get("time") for r in answered.values() if isinstance(r.get("time"), (int, float))]
        closed_at = min(times, default=failed_at)
        waited = f"within {grace:g} s" if store_error is None else "before the store closed"
        if lost:
            census = (
                f"{_ranks_text(lost)} did not answer {waited} after the connection closed: gone (its "
                "process exited, crashed or was killed, or its node was lost; look at its logs and the scheduler's "
                f"node events); ranks {arrived} are alive and saw the connection close"
            )
        else:
            census = f"every rank ({arrived}) answered afterwards: a network fault between live ranks, not a dead one"
        if store_error is not None:
            census += f" (the store closed afterwards: {store_error}; its host left after answering)"
    if len(lost) == 1:
        whose = f"rank {lost[0]}'s connection closed"
    elif lost:
        whose = f"ranks {lost}: connections closed"
    else:
        peer = _PEER_ADDRESS.search(backend)
        whose = f"a peer's connection closed ({peer.group(0)})" if peer else "a peer's connection closed"
    within = f"{seconds_in_call:.2f} s into the call" if seconds_in_call is not None else "during the call"
    limit = f"the process group's timeout is {timeout:g} s" if timeout is not None else "well before any timeout"
    message = (
        f"collective {collective} of FSDP group {info.label!r} ({_human(info.unsharded_bytes)}) failed at step "
        f"{probe.step} (collective #{sequence} on process group of ranks {_short(members)}): peer lost, {whose} "
        f"({event}) at {_clock(closed_at)}, {within}; {limit}, so this is not a timeout. {census[0].upper()}"
        f"{census[1:]}. Under torchrun with --nnodes=MIN:MAX and --max-restarts the agents restart the survivors "
        "at the new world size, resuming from the newest checkpoint (docs/operations.md, 'Elastic resize'). "
        f"Backend error: {backend}"
    )
    return PeerLostError(
        message,
        group=info.label,
        collective=collective,
        step=probe.step,
        sequence=sequence,
        lost_ranks=lost,
        arrived_ranks=arrived,
        store_lost=store_lost,
        failed_at=closed_at,
        seconds_in_call=seconds_in_call,
    )


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
