"""RaggedShard: how one parameter is split across the ranks of its shard group.

Each rank holds one contiguous range of the parameter's flattened elements; the
ranges may be uneven and empty, and their boundaries fall only at multiples of the
parameter's granularity (rows, blocks of rows, the whole matrix). This is the
description every sharded parameter carries (``param.ragged_shard``), so optimizers
and checkpointing can reason about structure without talking to the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from lightning_ragged.layout.errors import RaggedShardBoundaryViolation
from lightning_ragged.layout.granularity import row_numel

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""An N-D rectangle of a tensor: (offsets, sizes)."""


@dataclass(frozen=True)
class RaggedShard:
    """A parameter's global shape, granularity and every rank's flat [start, end) range."""

    name: str
    global_shape: torch.Size
    granularity: int
    rank_ranges: tuple[tuple[int, int], ...]
    rank: int
    process_group: Any = field(default=None, compare=False, repr=False)
    """The shard group the ranges refer to (a ``torch.distributed.ProcessGroup``)."""

    @property
    def world_size(self) -> int:
        return len(self.rank_ranges)

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def local_range(self) -> tuple[int, int]:
        return self.rank_ranges[self.rank]

    @property
    def local_numel(self) -> int:
        start, end = self.local_range
        return end - start

    def local_blocks(self, block_numel: int) -> tuple[int, int]:
        """[first, last) indices of the ``block_numel``-element blocks (counted from the
        parameter's start) that this rank's range touches; (0, 0) when it holds nothing."""
        start, end = self.local_range
        if start == end:
            return 0, 0
        return start // block_numel, math.ceil(end / block_numel)

    def owner(self) -> int | None:
        """The rank that holds the whole parameter, or None when it is split."""
        for rank, (start, end) in enumerate(self.rank_ranges):
            if end - start == self.numel:
                return rank
        return None

    def cut_offsets(self) -> list[int]:
        """Flat offsets inside the parameter where one rank's range ends and another's begins."""
        return sorted({end for start, end in self.rank_ranges if start < end < self.numel})

    def require_blocks(self, block_numel: int, why: str) -> None:
        """Raise unless every cut falls at a multiple of ``block_numel`` from the start.

        Optimizers call this to state the structure they need whole (a quantization
        block, a preconditioner tile); the message names the parameter, the offending
        offset and what to change.
        """
        for offset in self.cut_offsets():
            if offset % block_numel:
                raise RaggedShardBoundaryViolation(
                    f"parameter {self.name!r} (shape {tuple(self.global_shape)}) is cut at flat offset "
                    f"{offset}, inside a block of {block_numel} elements needed by {why}; shard it with a "
                    f"granularity that is a multiple of {block_numel} elements (e.g. shard_granularity="
                    f"'block' with block_rows a multiple of {_rows_hint(self.global_shape, block_numel)}, "
                    f"or 'matrix')"
                )

    def local_boxes(self, rank: int | None = None) -> list[Box]:
        """The rank's flat range as N-D rectangles of the global shape (for DCP chunks)."""
        start, end = self.rank_ranges[self.rank if rank is None else rank]
        return flat_range_to_boxes(tuple(self.global_shape), start, end)

    def local_part(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's flat range of ``full`` (the whole parameter, or a state shaped like it): a 1-D view."""
        start, end = self.local_range
        return full.reshape(-1)[start:end]


def shard_of(param: torch.Tensor, name: str | None = None) -> RaggedShard:
    """``param.ragged_shard``, or a one-rank shard holding the whole of a plain (unsharded) tensor."""
    shard = getattr(param, "ragged_shard", None)
    if shard is not None:
        return shard
    numel = param.numel()
    return RaggedShard(name or "<unnamed>", param.shape, max(numel, 1), ((0, numel),), 0, None)


def _rows_hint(shape: Sequence[int], block_numel: int) -> int:
    return max(1, math.ceil(block_numel / row_numel(shape)))  # rows as shard_granularity="block" counts them


def flat_range_to_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Split the row-major flat range [start, end) of ``shape`` into few N-D boxes.

    A range becomes a partial piece of the first slice, whole slices along dim 0 and a
    partial piece of the last slice, recursively: at most 2·ndim − 1 boxes. A 0-D tensor
    (shape ``()``, one element) has the one box ``((), ())`` (offsets and sizes of no
    dimension): the whole of it, in its own 0-D shape.
    """
    if start >= end:
        return []
    if not 0 <= start < end <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {end}) is outside a tensor of shape {tuple(shape)}")
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (end - start,))]
    inner = math.prod(shape[1:])
    boxes: list[Box] = []

    def prefixed(dim0: int, sub: list[Box]) -> list[Box]:
        return [((dim0, *offs), (1, *sizes)) for offs, sizes in sub]

    first_row, first_col = divmod(start, inner)
    if first_col:
        head_end = min(end, (first_row + 1) * inner)
        boxes += prefixed(first_row, flat_range_to_boxes(shape[1:], first_col, head_end - first_row * inner))
        start = head_end
    full_rows = (end - start) // inner
    if full_rows and start < end:
        boxes.append(((start // inner, *[0] * (len(shape) - 1)), (full_rows, *shape[1:])))
        start += full_rows * inner
    if start < end:
        row = start // inner
        boxes += prefixed(row, flat_range_to_boxes(shape[1:], 0, end - row * inner))
    return boxes
