"""The planning problem's data: TensorSpec (a tensor to place) and Layout (where every tensor went).

The buffer has ``world_size`` equal segments of ``segment_size`` (S) elements;
rank k owns ``[k*S, (k+1)*S)``. A layout puts every tensor at an offset so that
intervals are disjoint, padding lies only *between* tensors, every rank boundary
``b = k*S`` strictly inside a tensor is a multiple of the tensor's granularity
away from its start, and both S and every tensor's offset are multiples of the
alignment unit ``a`` (in elements; a = 16 bytes / element size keeps every
parameter view 16-byte aligned). The planner minimises S (equivalently the
padding ``world_size*S - total``, which includes the padding alignment adds
between tensors). The problem is NP-hard (Partition reduces to it), so
``"optimal"`` is the veScale-FSDP heuristic (arXiv 2602.22437, section 5), made
exact for small groups.

**Alignment changes the granularity, nothing else.** Every boundary b is a
multiple of a (S is), so with an aligned offset l the cut ``b - l`` is a
multiple of a; it must also be one of g. Hence, with offsets restricted to
multiples of a, "cut at a multiple of g" is the same as "cut at a multiple of
``step = lcm(a, g)``", and ``S % g == 0`` the same as ``S % step == 0``. The
facts in :mod:`lightning_ragged.layout.packing` hold with step in place of g (at
a = 1, step = g).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from lightning_ragged.layout.errors import DBufferAlignmentError, RaggedShardBoundaryViolation

Placement = list[tuple["TensorSpec", int]]
"""Tensors with their offsets, in buffer order."""


def is_positive_int(value: object) -> bool:
    """An int >= 1 that is not a bool (``True`` is an int to Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a group: its name, element count and granularity (elements per uncuttable block).

    A cut may fall only at a multiple of ``granularity`` from the tensor's start; the
    last block may be shorter (e.g. 200 rows in blocks of 128 rows).
    """

    name: str
    numel: int
    granularity: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.numel, int) or isinstance(self.numel, bool) or self.numel < 0:
            raise ValueError(f"tensor {self.name!r}: numel={self.numel!r} is invalid; pass a non-negative int")
        if not is_positive_int(self.granularity):
            raise ValueError(
                f"tensor {self.name!r}: granularity={self.granularity!r} is invalid; "
                "pass a positive int (1 = may be cut at any element)"
            )
        if self.numel and self.granularity > self.numel:
            raise ValueError(
                f"tensor {self.name!r}: granularity={self.granularity} exceeds numel={self.numel}; "
                f"use granularity={self.numel} to keep the whole tensor on one rank"
            )


@dataclass(frozen=True)
class Layout:
    """Where every tensor of one group lives in the flat buffer of ``world_size`` equal segments."""

    world_size: int
    segment_size: int
    alignment: int
    order: tuple[str, ...]
    specs: Mapping[str, TensorSpec]
    offsets: Mapping[str, int]
    algorithm: str
    plan_seconds: float

    @property
    def buffer_numel(self) -> int:
        return self.world_size * self.segment_size

    @property
    def total_numel(self) -> int:
        return sum(spec.numel for spec in self.specs.values())

    @property
    def padding(self) -> int:
        return self.buffer_numel - self.total_numel

    @property
    def padding_ratio(self) -> float:
        total = self.total_numel
        return self.padding / total if total else 0.0

    def ranges(self, name: str) -> tuple[tuple[int, int], ...]:
        """Rank k's ``[start, end)`` in tensor ``name``'s own flat index space, for every rank.

        Ranks before the tensor get ``(0, 0)``, ranks after it ``(numel, numel)``.
        """
        numel, offset, size = self.specs[name].numel, self.offsets[name], self.segment_size
        return tuple(
            (min(max(k * size - offset, 0), numel), min(max((k + 1) * size - offset, 0), numel))
            for k in range(self.world_size)
        )

    def local_pieces(self, rank: int) -> list[tuple[str, int, int, int]]:
        """``(name, tensor_start, tensor_end, offset_in_segment)`` of every tensor overlapping ``rank``'s segment.

        Pieces come in buffer order; zero-element tensors overlap nothing.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside the layout's world of {self.world_size} ranks")
        low, high = rank * self.segment_size, (rank + 1) * self.segment_size
        pieces = []
        for name in self.order:
            start, end = self.offsets[name], self.offsets[name] + self.specs[name].numel
            if start < high and end > low:
                pieces.append((name, max(start, low) - start, min(end, high) - start, max(start, low) - low))
        return pieces

    def validate(self) -> None:
        """Check every constraint of the planning problem, independently of how the layout was made.

        Raises DBufferAlignmentError for a bad segment size, a tensor whose offset is
        not a multiple of the alignment, overlapping tensors or a tensor outside the
        buffer, and RaggedShardBoundaryViolation when a rank boundary would cut one of
        a tensor's blocks.
        """
        self._validate_geometry()
        for name in self.order:
            self._validate_cuts(self.specs[name], self.offsets[name])

    def _validate_geometry(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise DBufferAlignmentError(f"world_size={self.world_size!r}; it must be a positive int")
        if not isinstance(self.alignment, int) or self.alignment < 1:
            raise DBufferAlignmentError(f"alignment={self.alignment!r}; it must be a positive int")
        if self.segment_size < 1 or self.segment_size % self.alignment:
            raise DBufferAlignmentError(
                f"segment_size={self.segment_size} is not a positive multiple of alignment={self.alignment}; "
                f"use e.g. {max(align_up(self.segment_size, self.alignment), self.alignment)}"
            )
        if sorted(self.order) != sorted(self.specs) or set(self.offsets) != set(self.specs):
            raise DBufferAlignmentError(
                f"order {sorted(self.order)}, specs {sorted(self.specs)} and offsets {sorted(self.offsets)} "
                "must name the same tensors exactly once"
            )
        previous_end, previous = 0, None
        for name in self.order:
            offset, numel = self.offsets[name], self.specs[name].numel
            if offset < 0 or offset + numel > self.buffer_numel:
                raise DBufferAlignmentError(
                    f"tensor {name!r} occupies [{offset}, {offset + numel}), outside the buffer "
                    f"[0, {self.buffer_numel}) of {self.world_size} segments of {self.segment_size}; "
                    "use a larger segment_size or smaller offsets"
                )
            if offset % self.alignment:
                raise DBufferAlignmentError(
                    f"tensor {name!r} starts at offset {offset}, which is not a multiple of "
                    f"alignment={self.alignment} (its view would be misaligned); move it to a multiple of "
                    f"{self.alignment}, e.g. {align_up(offset, self.alignment)} (padding before it), or use "
                    "a smaller alignment"
                )
            if numel == 0:
                continue
            if offset < previous_end:
                raise DBufferAlignmentError(
                    f"tensor {name!r} starts at {offset}, before tensor {previous!r} ends at {previous_end} "
                    "(tensors overlap, or order is not by increasing offset); move it to at least "
                    f"{previous_end}"
                )
            previous_end, previous = offset + numel, name

    def _validate_cuts(self, spec: TensorSpec, offset: int) -> None:
        size, granularity = self.segment_size, spec.granularity
        first = (offset // size + 1) * size - offset  # first boundary after the start, relative to it
        if first >= spec.numel:
            return
        if first % granularity:
            cut = first
        elif first + size < spec.numel and size % granularity:
            cut = first + size
        else:
            return
        raise RaggedShardBoundaryViolation(
            f"tensor {spec.name!r} (numel {spec.numel}, granularity {granularity}, at buffer offset {offset}) "
            f"would be cut at offset {cut} inside it, where rank {(offset + cut) // size}'s segment starts "
            f"(buffer offset {offset + cut}); {cut} is not a multiple of {granularity}, so a block would be "
            f"split. Fix: move the tensor so rank boundaries land on multiples of {granularity} inside it, "
            f"use granularity {math.gcd(cut, granularity)} (which divides {cut}), or use a segment size that "
            f"is a multiple of {granularity}"
        )


def align_up(value: int, unit: int) -> int:
    """``value`` rounded up to a multiple of ``unit``."""
    return -(-value // unit) * unit


def cut_step(granularity: int, alignment: int) -> int:
    """The unit of a cut from an aligned offset: ``lcm(alignment, granularity)`` (module docstring)."""
    return granularity if alignment == 1 else math.lcm(alignment, granularity)
