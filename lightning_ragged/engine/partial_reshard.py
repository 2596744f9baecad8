"""``reshard_after_forward=int``: after forward a DBuffer keeps 1/size of its full buffer for the backward.

Member j of each group of ``size`` consecutive ranks keeps the j-th contiguous chunk of the full
buffer (one flat copy), so the backward's all-gather inside that smaller group writes the whole
buffer back in place. The chunk is made on the compute stream and read by the all-gather stream;
the gather's pending collective holds it until compute waited for it (``streams.py``, rule 3).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class PartialReshard:
    """One DBuffer's smaller gather group (``size`` consecutive ranks of its shard group) and how a part is kept."""

    def __init__(self, world_size: int, group: dist.ProcessGroup, size: int) -> None:
        if world_size % size:
            raise ValueError(f"reshard_after_forward={size} must divide the shard group's {world_size} ranks")
        self.group = group
        self.size = size

    def keep(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's 1/size of the flat ``full`` buffer, as a tensor of its own."""
        chunk = full.numel() // self.size
        index = dist.get_rank(self.group)
        return full[index * chunk : (index + 1) * chunk].clone()


_GROUPS: dict[tuple[tuple[int, ...], int, int], tuple[Any, dist.ProcessGroup]] = {}
"""(ranks, size, id of the default group) -> (that default group, held so its id names no other, the subgroup):
a re-initialized default group (``destroy_process_group`` then ``init_process_group``, a notebook's second run)
gets new subgroups, not the destroyed ones ("Group ... is not registered")."""


def partial_group(process_group: dist.ProcessGroup | None, size: bool | int | None) -> dist.ProcessGroup | None:
    """For ``reshard_after_forward=size``: this rank's group of ``size`` consecutive shard ranks.

    ``new_group`` is collective over the world, so every rank learns every shard group's
    ranks and creates all the subgroups in the same order (cached per layout and default group).
    """
    world = dist.get_world_size(process_group)
    if size is None or isinstance(size, bool) or size in (1, world):
        return None
    mine = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    default = dist.distributed_c10d._get_default_group()
    for ranks in sorted(set(everyone)):
        for start in range(0, len(ranks), size):
            chunk = ranks[start : start + size]
            if (chunk, size, id(default)) not in _GROUPS:
                _GROUPS[(chunk, size, id(default))] = (default, dist.new_group(list(chunk)))
    position = mine.index(dist.get_rank())
    return _GROUPS[(mine[position - position % size : position - position % size + size], size, id(default))][1]
