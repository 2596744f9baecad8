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

**Out of memory while unsharding** (allocating a group's full buffer for the
all-gather or its gradient buffer): :class:`UnshardOutOfMemoryError` names the group,
the buffer size, what is already unsharded, and the knobs that shrink it.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_ragged.probes import BucketInfo, EngineProbe

ARRIVAL_GRACE_S = 5.0
"""Longest wait for the other ranks' arrival records after a timeout."""

_TIMEOUT_PATTERNS = re.compile(
    r"timed out|timeout|connection closed by peer|connection reset|pair closure|broken pipe|"
    r"watchdog caught collective",
    re.IGNORECASE,
)
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


class UnshardOutOfMemoryError(RuntimeError):
    """Allocating a group's full (unsharded) buffer ran out of memory."""

    def __init__(self, message: str, *, group: str, buffer_bytes: int) -> None:
        super().__init__(message)
        self.group = group
        self.buffer_bytes = buffer_bytes


def is_timeout(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and bool(_TIMEOUT_PATTERNS.search(str(error)))


def is_out_of_memory(error: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", ())
    return (oom_type and isinstance(error, oom_type)) or (
        isinstance(error, RuntimeError) and bool(_OOM_PATTERNS.search(str(error)))
    )


def translate(error: BaseException, probe: "EngineProbe", info: "BucketInfo", collective: str) -> BaseException:
    """The named error for ``error`` raised in ``collective`` of ``info``'s group, or ``error`` itself."""
    if isinstance(error, (CollectiveTimeoutError, UnshardOutOfMemoryError)):
        return error
    if is_out_of_memory(error) and collective in ("all_gather", "gradient buffer"):
        return _out_of_memory(error, probe, info, collective)
    if is_timeout(error) and collective != "gradient buffer":
        return _timeout(error, probe, info, collective)
    return error


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:,.1f} {unit}" if unit != "B" else f"{int(nbytes):,} B"
        nbytes /= 1024
    return f"{nbytes} B"


def _out_of_memory(error: BaseException, probe: "EngineProbe", info: "BucketInfo", what: str) -> BaseException:
    bucket = info.bucket
    kind = "full parameter buffer (all-gather target)" if what == "all_gather" else "full gradient buffer"
    layout = bucket.layout
    message = (
        f"out of memory while unsharding FSDP group {info.label!r}: its {kind} needs "
        f"{_human(info.unsharded_bytes)} ({layout.world_size} ranks x segment {layout.segment_size:,} elements "
        f"x {bucket.param_dtype}); {_human(probe.unsharded_bytes)} of full parameters and "
        f"{_human(probe.grad_bytes)} of full gradients were already allocated, at step {probe.step}. "
        "To shrink it: lower `dbuffer_size` (fully_shard / RaggedFSDPStrategy; a group is split into DBuffers "
        "of at most that many bytes) or shard at a finer `group_modules`; keep `reshard_after_forward=True` "
        "(frees each group after its forward); use a bf16 `param_dtype` (mixed precision); or enable "
        "activation checkpointing to leave more room. "
        f"Original error: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    )
    return UnshardOutOfMemoryError(message, group=info.label, buffer_bytes=info.unsharded_bytes)


def _timeout(error: BaseException, probe: "EngineProbe", info: "BucketInfo", collective: str) -> BaseException:
    bucket = info.bucket
    process_group = bucket.shard_group
    members = _global_ranks(process_group)
    sequence = probe.pending_sequence(bucket, "all_gather" if collective == "all_gather" else collective)
    timeout = probe.collective_timeout
    if timeout is None:
        match = _MILLISECONDS.search(str(error))
        timeout = int(match.group(1)) / 1000 if match else None
    arrived = _arrival_census(probe.group_key(bucket), sequence, members, timeout)
    if arrived is None:
        missing_text = "unknown (no torch.distributed store to compare notes)"
        missing: list[int] = []
        arrived_list: list[int] = []
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


def _arrival_census(group_key: str, sequence: int, members: list[int], timeout: float | None) -> set[int] | None:
    """Record that this rank reached collective ``sequence``; the members that did the same in the grace period."""
    store = _store()
    if store is None:
        return None
    prefix = f"ragged_fsdp/arrived/{group_key}/{sequence}/"
    me = dist.get_rank()
    try:
        store.set(f"{prefix}{me}", str(time.time()))
        grace = ARRIVAL_GRACE_S if timeout is None else min(ARRIVAL_GRACE_S, max(0.5, timeout / 2))
        deadline = time.monotonic() + grace
        arrived = {me}
        while True:
            for rank in members:
                if rank not in arrived and store.check([f"{prefix}{rank}"]):
                    arrived.add(rank)
            if len(arrived) == len(members) or time.monotonic() >= deadline:
                return arrived
            time.sleep(0.05)
    except (RuntimeError, ValueError):  # the store itself is gone (the job is tearing down)
        return None
