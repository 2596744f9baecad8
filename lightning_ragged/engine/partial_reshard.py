"""``reshard_after_forward=int``: after forward a DBuffer keeps 1/size of its full buffer for the backward.

Member j of each group of ``size`` consecutive ranks keeps the j-th contiguous chunk of the full
buffer (one flat copy), so the backward's all-gather inside that smaller group writes the whole
buffer back in place. The chunk is made on the compute stream and read by the all-gather stream;
the gather's pending collective holds it until compute waited for it (``streams.py``, rule 3).
"""

from __future__ import annotations

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
