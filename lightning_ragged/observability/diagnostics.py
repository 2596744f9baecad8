"""Named errors for the ways a sharded job dies confusingly: a stuck collective, a lost peer, an OOM at unshard.

The engine's observer (``probes.py``) hands a failed call here with a :class:`Failure`
(which DBuffer, which step, which collective number); :func:`translate` returns the named
error the engine raises instead. The errors and the store census that names the missing
ranks are the engine's (``engine/collective_errors.py``).

**Stuck collective** (the FAQ "stuck at AllGather"). The backend gives up after the
process group's timeout (the strategy's ``timeout``) with a bare "Timed out waiting
2000ms". That becomes :class:`CollectiveTimeoutError` naming the FSDP group, the
collective, the training step, the collective's number on its process group, and the
ranks that did not arrive. To find those, every rank that gives up writes
``arrived/<group>/<number>/<rank>`` into the default ``torch.distributed`` store and
waits a grace period (``ARRIVAL_GRACE_S``, at most half the timeout) for the others to do
the same: a rank that never reached the collective (stalled in data loading, a different
code path, a dead process) never writes it. Nothing is written while training runs normally.

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

import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_ragged.engine.collective_errors import (
    CollectiveTimeoutError,
    PeerLostError,
    arrival_census,
    first_line,
    global_ranks,
    grace_seconds,
    is_peer_lost,
    is_timeout,
    lost_census,
    short_ranks,
    store_gone_text,
    store_host,
)
from lightning_ragged.engine.dbuffer import DBuffer
from lightning_ragged.layout.memory import format_bytes

_PEER_ADDRESS = re.compile(r"\[([0-9a-fA-F:.]+)\]:(\d+)")
_OOM_PATTERNS = re.compile(r"out of memory|can't allocate memory|cannot allocate memory", re.IGNORECASE)
_MILLISECONDS = re.compile(r"waiting (\d+)ms")


class UnshardOutOfMemoryError(RuntimeError):
    """Allocating a group's full (unsharded) buffer ran out of memory."""

    def __init__(self, message: str, *, group: str, buffer_bytes: int) -> None:
        super().__init__(message)
        self.group = group
        self.buffer_bytes = buffer_bytes


def is_out_of_memory(error: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", ())
    return (oom_type and isinstance(error, oom_type)) or (
        isinstance(error, RuntimeError) and bool(_OOM_PATTERNS.search(str(error)))
    )


@dataclass(frozen=True)
class Failure:
    """Where a DBuffer's call failed, as the observer that saw it knows it (``probes.py``)."""

    dbuffer: DBuffer
    label: str
    """The group's name (``name#index`` when the group has several DBuffers)."""
    buffer_bytes: int
    """Bytes of this DBuffer's full buffer."""
    step: int
    sequence: int
    """The collective's number on its process group (the same on every member)."""
    group_key: str
    """A name of the process group that is the same on every member (for the store census)."""
    collective_timeout: float | None
    """Seconds, when known; otherwise read from the backend's error."""
    seconds_in_call: float | None
    unsharded_bytes: int
    """Full parameter buffers already allocated (all DBuffers)."""
    grad_bytes: int
    """Full gradient buffers already allocated (all DBuffers)."""


def translate(error: BaseException, failure: Failure, collective: str) -> BaseException:
    """The named error for ``error`` raised in ``collective`` of ``failure``'s group, or ``error`` itself."""
    if isinstance(error, (CollectiveTimeoutError, UnshardOutOfMemoryError)):
        return error
    if is_out_of_memory(error) and collective in ("all_gather", "gradient buffer"):
        return _out_of_memory(error, failure, collective)
    if is_peer_lost(error) and collective != "gradient buffer":
        return _peer_lost(error, failure, collective)
    if is_timeout(error) and collective != "gradient buffer":
        return _timeout(error, failure, collective)
    return error


def _out_of_memory(error: BaseException, failure: Failure, what: str) -> BaseException:
    dbuffer = failure.dbuffer
    kind = "full parameter buffer (all-gather target)" if what == "all_gather" else "full gradient buffer"
    layout = dbuffer.layout
    message = (
        f"out of memory while unsharding FSDP group {failure.label!r}: its {kind} needs "
        f"{format_bytes(failure.buffer_bytes)} ({layout.world_size} ranks x segment {layout.segment_size:,} elements "
        f"x {dbuffer.param_dtype}); {format_bytes(failure.unsharded_bytes)} of full parameters and "
        f"{format_bytes(failure.grad_bytes)} of full gradients were already allocated, at step {failure.step}. "
        "To shrink it: lower `dbuffer_size` (fully_shard / RaggedFSDPStrategy; a group is split into DBuffers "
        "of at most that many bytes) or shard at a finer `group_modules`; keep `reshard_after_forward=True` "
        "(frees each group after its forward); use a bf16 `param_dtype` (mixed precision); or enable "
        "activation checkpointing to leave more room. "
        f"Original error: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    )
    return UnshardOutOfMemoryError(message, group=failure.label, buffer_bytes=failure.buffer_bytes)


def _timeout(error: BaseException, failure: Failure, collective: str) -> BaseException:
    dbuffer = failure.dbuffer
    process_group = dbuffer.process_group
    members = global_ranks(process_group)
    sequence = failure.sequence
    timeout = failure.collective_timeout
    if timeout is None:
        match = _MILLISECONDS.search(str(error))
        timeout = int(match.group(1)) / 1000 if match else None
    arrived, store_error = arrival_census(failure.group_key, sequence, members, timeout)
    if arrived is None:
        missing_text = "unknown (no torch.distributed store to compare notes)"
        if store_error is not None:
            missing_text = f"unknown: {store_gone_text(members, store_error)}"
        missing: list[int] = []
        arrived_list: list[int] = [dist.get_rank()]  # at least this rank was waiting
    else:
        arrived_list = sorted(arrived)
        missing = [rank for rank in members if rank not in arrived]
        missing_text = f"ranks {missing} did not arrive" if missing else "every rank arrived (a backend or network fault)"
    within = f"within {timeout:g} s" if timeout is not None else "within the process group's timeout"
    message = (
        f"collective {collective} of FSDP group {failure.label!r} ({format_bytes(failure.buffer_bytes)}) did not finish "
        f"{within} at step {failure.step} (collective #{sequence} on process group of ranks {short_ranks(members)}): "
        f"{missing_text}; ranks {arrived_list} were waiting in it. "
        "A rank that did not arrive is stalled elsewhere (data loading, a different code path or number of "
        "batches, a Python exception, a dead process): look at its logs and stack (py-spy dump). "
        f"Backend error: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    )
    return CollectiveTimeoutError(
        message,
        group=failure.label,
        collective=collective,
        step=failure.step,
        sequence=sequence,
        missing_ranks=missing,
        arrived_ranks=arrived_list,
    )


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


def _peer_lost(error: BaseException, failure: Failure, collective: str) -> BaseException:
    failed_at = time.time()
    seconds_in_call = failure.seconds_in_call
    dbuffer = failure.dbuffer
    members = global_ranks(dbuffer.process_group)
    sequence = failure.sequence
    timeout = failure.collective_timeout
    if timeout is None:
        match = _MILLISECONDS.search(str(error))
        timeout = int(match.group(1)) / 1000 if match else None
    backend = first_line(error)
    event = _connection_event(str(error))
    me = dist.get_rank()
    record = {"time": failed_at, "collective": collective, "sequence": sequence, "step": failure.step, "event": event}
    answered, store_error = lost_census(failure.group_key, members, record, timeout)
    grace = grace_seconds(timeout)
    store_lost = store_error is not None and (answered is None or len(answered) <= 1)
    closed_at = failed_at
    if store_lost:
        host, rank_zero = store_host()
        lost = [0] if rank_zero and 0 in members and me != 0 else []
        arrived = [me]
        census = store_gone_text(members, store_error or "")
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
        f"collective {collective} of FSDP group {failure.label!r} ({format_bytes(failure.buffer_bytes)}) failed at step "
        f"{failure.step} (collective #{sequence} on process group of ranks {short_ranks(members)}): peer lost, {whose} "
        f"({event}) at {_clock(closed_at)}, {within}; {limit}, so this is not a timeout. {census[0].upper()}"
        f"{census[1:]}. Under torchrun with --nnodes=MIN:MAX and --max-restarts the agents restart the survivors "
        "at the new world size, resuming from the newest checkpoint (docs/operations.md, 'Elastic resize'). "
        f"Backend error: {backend}"
    )
    return PeerLostError(
        message,
        group=failure.label,
        collective=collective,
        step=failure.step,
        sequence=sequence,
        lost_ranks=lost,
        arrived_ranks=arrived,
        store_lost=store_lost,
        failed_at=closed_at,
        seconds_in_call=seconds_in_call,
    )


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
