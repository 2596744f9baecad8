"""A checkpoint save's collectives that do not finish in time, as ``CollectiveTimeoutError`` naming the checkpoint.

A save is collective: a barrier before the shards are written, DCP's planning
(``reduce_scatter`` of the save plans) and finish (``gather_object`` of every rank's write
results), a barrier after. A frozen or stalled peer leaves the others waiting there until
the process group's timeout, and the backend then raises a bare "Timed out waiting
3000ms". :func:`translating` turns that into :class:`CheckpointTimeoutError`, a
:class:`~lightning_ragged.engine.collective_errors.CollectiveTimeoutError` that names the checkpoint's
path, the collective (ours; inside DCP, its step and the ``torch.distributed`` call) and
the ranks that did not arrive -- found as the engine finds them (``collective_errors.arrival_census``:
every rank that gives up records its arrival in the store and waits a grace period for
the others; a rank that never reached the collective never does). A peer whose process ended
closes its connections instead: that becomes :class:`CheckpointPeerLostError`, the engine's
``PeerLostError`` naming the checkpoint, with the members that did not answer afterwards
(``collective_errors.lost_census``).

Timeouts: a synchronous save runs on the default process group, created with the
strategy's ``timeout``. An asynchronous save runs on its own gloo group (its collectives
run in a background thread); that group is created with the same timeout
(:func:`group_timeout` of the default group), not torch's 30-minute default.
"""

from __future__ import annotations

import contextlib
import re
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from lightning_ragged.engine import collective_errors
from lightning_ragged.engine.collective_errors import CollectiveTimeoutError, PeerLostError


class CheckpointTimeoutError(CollectiveTimeoutError):
    """A collective of a checkpoint save did not finish within the process group's timeout.

    ``path``: the checkpoint; ``collective``: which one; ``missing_ranks``: the ranks that
    did not arrive; ``arrived_ranks``: those that were waiting in it; ``sequence``: the
    save's number in this process; ``step``: the training step saved (-1: unknown).
    """

    def __init__(self, message: str, *, path: Path, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.path = path


class CheckpointPeerLostError(PeerLostError):
    """A collective of a checkpoint save failed because a peer's connection closed (the peer is gone).

    ``path``: the checkpoint; ``lost_ranks`` (also ``missing_ranks``): the members that did not answer afterwards.
    """

    def __init__(self, message: str, *, path: Path, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.path = path


_MILLISECONDS = re.compile(r"waiting (\d+)ms")


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The timeout ``group`` (default: the default process group) was created with; None if unknown."""
    if not dist.is_initialized():
        return None
    group = group if group is not None else dist.group.WORLD
    for device in list(getattr(group, "_device_types", None) or ()) + [torch.device("cpu")]:
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def _causes(error: BaseException) -> list[BaseException]:
    """``error`` and, for DCP's ``CheckpointException``, the exception of every rank it wraps."""
    causes = [error]
    for wrapped in (getattr(error, "failures", None) or {}).values():
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, BaseException):
            causes.append(inner)
    return causes


def is_timeout(error: BaseException) -> bool:
    return any(collective_errors.is_timeout(cause) for cause in _causes(error))


def is_peer_lost(error: BaseException) -> bool:
    return any(collective_errors.is_peer_lost(cause) for cause in _causes(error))


def describe_collective(label: str, error: BaseException) -> str:
    """``label``, plus DCP's step and the torch.distributed call the error came out of, when its traceback shows them."""
    dcp_step = call = None
    for cause in _causes(error):
        for frame, _ in traceback.walk_tb(cause.__traceback__):
            filename = frame.f_code.co_filename.replace("\\", "/")
            if filename.endswith("distributed/checkpoint/utils.py") and isinstance(frame.f_locals.get("step"), str):
                dcp_step = frame.f_locals["step"]
            if call is None and filename.endswith("distributed/distributed_c10d.py"):
                call = frame.f_code.co_name
    details = [f"DCP step {dcp_step!r}"] if dcp_step else []
    if call:
        details.append(f"torch.distributed.{call}")
    return f"{label} ({', '.join(details)})" if details else label


def translate(
    error: BaseException,
    *,
    path: Path,
    label: str,
    sequence: int,
    step: int | None = None,
    group: dist.ProcessGroup | None = None,
    note: str | None = None,
) -> BaseException:
    """The :class:`CheckpointTimeoutError` (or, a peer's connection closed, :class:`CheckpointPeerLostError`) for
    ``error`` raised in the collective ``label`` of a save to ``path``, or ``error``."""
    if isinstance(error, CollectiveTimeoutError) or not dist.is_initialized():
        return error
    if is_peer_lost(error):
        return _peer_lost(error, path=path, label=label, sequence=sequence, step=step, group=group, note=note)
    if not is_timeout(error):
        return error
    members = collective_errors.global_ranks(group)
    timeout = group_timeout(group)
    seconds = timeout.total_seconds() if timeout is not None else None
    if seconds is None:
        match = _MILLISECONDS.search(str(error))
        seconds = int(match.group(1)) / 1000 if match else None
    key = "checkpoint/" + re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
    arrived, store_error = collective_errors.arrival_census(key, sequence, members, seconds)
    if arrived is None:
        missing: list[int] = []
        arrived_list: list[int] = []
        missing_text = "which ranks did not arrive is unknown (" + (
            f"the store no longer answers: {store_error})" if store_error else "no torch.distributed store to compare notes)"
        )
    else:
        arrived_list = sorted(arrived)
        missing = [rank for rank in members if rank not in arrived]
        missing_text = f"ranks {missing} did not arrive" if missing else "every rank arrived (a backend or network fault)"
    collective = describe_collective(label, error)
    within = f"within {seconds:g} s" if seconds is not None else "within the process group's timeout"
    at_step = f" at step {step}" if step is not None else ""
    message = (
        f"checkpoint save to {path}: collective {collective} did not finish {within}{at_step} (save #{sequence} "
        f"of this process, process group of ranks {collective_errors.short_ranks(members)}): {missing_text}; ranks "
        f"{arrived_list} were waiting in it. "
        + (note or f"The save was not published: {path} still holds the previous checkpoint, if there was one. ")
        + "A rank that did not arrive is stalled elsewhere (a long step or data loading, a different code path, "
        "a stopped or dead process): look at its logs and stack (py-spy dump). "
        f"Backend error: {collective_errors.first_line(error).strip()}"
    )
    return CheckpointTimeoutError(
        message,
        path=path,
        group="checkpoint",
        collective=collective,
        step=step if step is not None else -1,
        sequence=sequence,
        missing_ranks=missing,
        arrived_ranks=arrived_list,
    )


def _peer_lost(error: BaseException, *, path: Path, label: str, sequence: int, step: int | None,
               group: dist.ProcessGroup | None, note: str | None) -> BaseException:
    """A peer's connection closed in a save's collective: the members still there say so in the store (the
    engine's census), the others are named as gone."""
    members = collective_errors.global_ranks(group)
    timeout = group_timeout(group)
    seconds = timeout.total_seconds() if timeout is not None else None
    collective = describe_collective(label, error)
    failed_at = time.time()
    record = {"time": failed_at, "collective": collective, "sequence": sequence, "step": step}
    answered, store_error = collective_errors.lost_census(f"checkpoint/{path.name}/{sequence}", members, record, seconds)
    store_lost = store_error is not None and (answered is None or len(answered) <= 1)
    me = dist.get_rank()
    if store_lost or answered is None:
        lost, arrived = [], [me]
        census = (collective_errors.store_gone_text(members, store_error or "") if store_lost
                  else "which rank is gone is unknown (no torch.distributed store to compare notes)")
    else:
        arrived = sorted(answered)
        lost = [rank for rank in members if rank not in answered]
        census = (f"ranks {lost} did not answer after the connection closed: gone (look at their logs and the "
                  f"scheduler's node events); ranks {arrived} are alive" if lost
                  else f"every rank ({arrived}) answered afterwards: a network fault between live ranks")
    message = (
        f"checkpoint save to {path}: collective {collective} failed{f' at step {step}' if step is not None else ''} "
        f"(save #{sequence} of this process, process group of ranks {collective_errors.short_ranks(members)}): peer "
        f"lost, {census}. "
        + (note or f"The save was not published: {path} still holds the previous checkpoint, if there was one. ")
        + f"Backend error: {collective_errors.first_line(error).strip()}"
    )
    return CheckpointPeerLostError(
        message, path=path, group="checkpoint", collective=collective, step=step if step is not None else -1,
        sequence=sequence, lost_ranks=lost, arrived_ranks=arrived, store_lost=store_lost, failed_at=failed_at,
        seconds_in_call=None,
    )


@contextlib.contextmanager
def translating(path: Path, label: str, *, sequence: int, step: int | None = None, **kwargs: Any) -> Iterator[None]:
    """Around a collective of a save: a timeout in it raised as :class:`CheckpointTimeoutError`."""
    try:
        yield
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        named = translate(error, path=path, label=label, sequence=sequence, step=step, **kwargs)
        if named is error:
            raise
        raise named from error
