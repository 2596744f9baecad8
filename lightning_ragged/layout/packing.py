"""Packing tensors into equal segments: earliest offsets, one order's packing, and the lower bound on S.

The facts below justify both the exact packing of one order (:func:`pack_in_order`)
and :func:`segment_lower_bound`; the problem and the meaning of ``step`` are in
:mod:`lightning_ragged.layout.spec`.

**Fact 1 (earliest offsets are optimal for a fixed order).** For a tensor t and
segment size S let ``f(p)`` be the smallest valid offset of t that is ``>= p``.
Then f is non-decreasing: for ``p <= p'`` the offset ``f(p')`` is valid and
``>= p``, so ``f(p) <= f(p')``. The proof uses only that validity of an offset
depends on t, S and a alone (not on the other tensors), so it holds unchanged
when valid offsets must also be multiples of a: f is then the first element ``>= p``
of a smaller fixed set. Hence, for a fixed order of the tensors, placing
each at the earliest valid offset at or after the previous end minimises the end
of every prefix (induction: a smaller previous end never gives a later start).
So one linear pass (:func:`pack_in_order`) decides *exactly* whether an order fits
in ``world_size`` segments of size S; it is the paper's "fewest ranks for a
prefix" DP solved in closed form.

**Fact 2 (S >= every block).** If a rank boundary cuts tensor t, the piece
before the first cut lies inside one segment and is a positive multiple of
``step_t``, so ``step_t <= S``; if nothing cuts t, then t lies inside one segment
from an aligned offset, so ``align_up(numel_t, a) <= S`` (S is a multiple of a).
Either way ``S >= min(step_t, align_up(numel_t, a)) >= g_t``.

**Fact 3 (two cuts force S % step == 0).** Two cuts S apart in one tensor are both
multiples of step from its start. A tensor of at least 2S elements always gets two
cuts (or one cut exactly S in), so feasible segment sizes are sparse: multiples
of the lcm of a and the big tensors' granularities.

**Fact 4 (room in aligned units).** Tensor t starts at a multiple of a, the next
tensor starts at a multiple of a at or after t's end, and the buffer end
``world_size*S`` is a multiple of a; so t alone owns ``ceil(numel_t / a)`` whole
a-element units, the last tensor included, and
``world_size * S / a >= sum_t ceil(numel_t / a)`` (at a = 1: ``world_size*S >= total``).
Facts 2, 3 and 4 give :func:`segment_lower_bound`.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from lightning_ragged.layout.spec import Placement, TensorSpec, align_up, cut_step


def segment_lower_bound(specs: Sequence[TensorSpec], world_size: int, alignment: int) -> int:
    """Smallest segment size that meets three necessary conditions, so no valid layout has a smaller one.

    All in multiples of ``alignment`` (a). Room: ``world_size * S >= a * sum(ceil(numel / a))``
    (Fact 4; ``>= total`` at a = 1). Blocks: ``S >= min(lcm(a, g), align_up(numel, a))``
    for every tensor (Fact 2; ``S >= g`` at a = 1). Two cuts: ``S % lcm(a, g) == 0`` for
    every tensor of at least ``2*S`` elements (Fact 3). Those tensors are a prefix of the
    tensors by decreasing size that shrinks as S grows: prefix k is forced exactly for S in
    ``(c_{k+1}, c_k]`` with ``c = numel // 2``; the bound is the smallest S found over those ranges.
    """
    tensors = [spec for spec in specs if spec.numel]
    units = sum(-(-spec.numel // alignment) for spec in tensors)
    blocks = max((min(cut_step(s.granularity, alignment), align_up(s.numel, alignment)) for s in tensors), default=1)
    room = align_up(max(alignment * -(-units // world_size), blocks, 1), alignment)
    coarse = sorted((s for s in tensors if s.granularity > 1), key=lambda s: -s.numel)
    limits = [spec.numel // 2 for spec in coarse] + [0]
    best, lcm = align_up(max(room, limits[0] + 1), alignment), alignment
    for spec, limit, next_limit in zip(coarse, limits, limits[1:]):
        lcm = math.lcm(lcm, spec.granularity)
        size = align_up(max(room, next_limit + 1), lcm)
        if size <= limit:
            best = min(best, size)
    return best


def earliest_offset(
    cursor: int, numel: int, granularity: int, segment: int, alignment: int = 1
) -> Optional[int]:
    """Smallest valid offset ``>= cursor`` for a tensor, or None when no offset is valid for this segment size.

    Valid offsets are multiples of ``alignment`` (``segment`` must be one too), so
    the search starts at the cursor rounded up to it and cuts must be multiples of
    ``step = lcm(alignment, granularity)`` (see :mod:`lightning_ragged.layout.spec`).
    If the tensor ends by the next boundary b, the (aligned) cursor itself. Otherwise b is
    cut, so the start must be congruent to b modulo step: the first such start
    ``cursor + (b - cursor) % step``, aligned since b and the cursor are; any later
    start in the same segment only pushes the end further, so if that start also
    cuts boundary ``b + S`` with ``S % step != 0`` the whole segment is hopeless and
    the search moves to b (aligned). From a boundary the situation repeats in every
    later segment, so a failure there is final.
    """
    return earliest_aligned(align_up(cursor, alignment), numel, cut_step(granularity, alignment), segment)


def earliest_aligned(cursor: int, numel: int, step: int, segment: int) -> Optional[int]:
    """:func:`earliest_offset` from an aligned ``cursor`` with the cut step ``lcm(alignment, granularity)``."""
    while True:
        boundary = (cursor // segment + 1) * segment
        if cursor + numel <= boundary:
            return cursor
        start = cursor + (boundary - cursor) % step
        if start < boundary and (start + numel <= boundary + segment or segment % step == 0):
            return start
        if cursor % segment == 0:
            return None
        cursor = boundary


def pack_in_order(
    order: Sequence[TensorSpec], segment: int, capacity: int, alignment: int = 1
) -> Optional[Placement]:
    """Place ``order`` at earliest aligned offsets (Fact 1); the placement, or None if it cannot end by ``capacity``."""
    remaining = sum(spec.numel for spec in order)
    cursor, placement = 0, []
    for spec in order:
        start = earliest_offset(cursor, spec.numel, spec.granularity, segment, alignment)
        remaining -= spec.numel
        if start is None or start + spec.numel + remaining > capacity:
            return None
        placement.append((spec, start))
        cursor = start + spec.numel
    return placement
