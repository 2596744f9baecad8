"""Which rank does what in a checkpoint operation, with or without a process group (then: one rank)."""

from __future__ import annotations

import warnings

import torch.distributed as dist


def is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    """A barrier on the default process group (none without one)."""
    if dist.is_initialized():
        dist.barrier()


def rank_zero_value(value: object) -> object:
    """Rank 0's ``value`` on every rank (a checkpoint path: every rank writes where rank 0 does)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_failures(failure: BaseException | None) -> dict[int, str]:
    """Every rank's failure as ``{rank: "Type: message"}`` (empty: none failed), in one collective.

    Takes a barrier's place where one rank may fail alone (rank 0 publishing): the others learn it
    at once instead of waiting in the barrier until the process-group timeout.
    """
    text = None if failure is None else f"{type(failure).__name__}: {failure}"
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {} if text is None else {0: text}
    texts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(texts, text)
    return {rank: text for rank, text in enumerate(texts) if text is not None}


def rank_zero_warn(message: str) -> None:
    """Warn once per job (rank 0), pointing at the caller's caller."""
    if is_rank_zero():
        warnings.warn(message, stacklevel=3)
