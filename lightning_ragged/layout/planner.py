"""Structure-aware planning: lay out one FSDP group's tensors in a flat buffer.

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
facts below hold with step in place of g (at a = 1, step = g).

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

**Algorithms.** ``"greedy"``: the given order, binary search on S between the
lower bound and a size that surely fits. ``"optimal"``: the same binary search
for several orders (given, step-descending, numel-descending, coarse tensors
first with fine ones (step = a) filling the gaps, and two "least padding next"
orders built while packing); then, because feasibility is not
monotone in S, every candidate below the best answer is re-checked in
increasing order: a window of ``_WINDOW`` sizes just below it and the first
multiples of the lcms from Fact 3. For small groups (at most
``_EXHAUSTIVE_STATES`` sub-multisets of identical tensors) each candidate is
decided over all orders at once by a DP over subsets, so there ``"optimal"``
misses the true optimum only if it lies outside the candidates.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from lightning_ragged.layout.errors import DBufferAlignmentError, RaggedShardBoundaryViolation

ALGORITHMS = ("greedy", "optimal")

Placement = list[tuple["TensorSpec", int]]
"""Tensors with their offsets, in buffer order."""

Strategy = Callable[[int, int], Optional[Placement]]
"""``(segment_size, capacity) -> placement`` or None when it does not fit."""

_WINDOW = 64
"""Segment sizes below the best binary-search answer that ``"optimal"`` re-checks one by one
(feasibility is not monotone in S, so binary search can overshoot the true minimum)."""

_LCM_MULTIPLES = 4
"""Multiples of each granularity lcm that ``"optimal"`` tries (see :func:`_candidate_segments`)."""

_EXHAUSTIVE_STATES = 256
"""Largest multiset-subset state space for which ``"optimal"`` tries every order (8 distinct tensors)."""


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
        if not isinstance(self.numel, int) or self.numel < 0:
            raise ValueError(f"tensor {self.name!r}: numel={self.numel!r} is invalid; pass a non-negative int")
        if not isinstance(self.granularity, int) or self.granularity < 1:
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
                f"use e.g. {max(_align_up(self.segment_size, self.alignment), self.alignment)}"
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
                    f"{self.alignment}, e.g. {_align_up(offset, self.alignment)} (padding before it), or use "
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


def plan(specs: Sequence[TensorSpec], world_size: int, algorithm: str = "optimal", alignment: int = 1) -> Layout:
    """Plan a valid layout of ``specs`` over ``world_size`` ranks with the smallest segment size found.

    ``"greedy"`` keeps the given order; ``"optimal"`` also tries other orders and
    segment sizes, and is never worse than ``"greedy"``.

    ``alignment`` (in elements, default 1 = no constraint) is a multiple that both
    the segment size and *every tensor's offset* in the flat buffer must be: with
    ``alignment = 16 bytes // element_size`` (4 for fp32, 8 for bf16) every rank's
    segment and every parameter view starts 16-byte aligned (given an aligned
    buffer). The gaps alignment leaves between tensors are ordinary padding,
    counted in :attr:`Layout.padding`; a tensor's numel need not be a multiple of it.
    """
    specs = list(specs)
    _check_plan_arguments(specs, world_size, algorithm, alignment)
    began = time.perf_counter()
    tensors = [spec for spec in specs if spec.numel > 0]
    if algorithm == "greedy":
        segment, placement = _plan_greedy(tensors, world_size, alignment)
    else:
        segment, placement = _plan_optimal(tensors, world_size, alignment)
    seconds = time.perf_counter() - began
    empty = [(spec, 0) for spec in specs if spec.numel == 0]
    layout = _make_layout(specs, world_size, segment, alignment, empty + placement, algorithm, seconds)
    layout.validate()
    return layout


def manual_layout(
    specs: Sequence[TensorSpec],
    world_size: int,
    segment_size: int,
    offsets: Mapping[str, int],
    alignment: int = 1,
) -> Layout:
    """Build and validate a hand-made layout (raises the same errors as :meth:`Layout.validate`)."""
    _check_unique_names(specs)
    missing, extra = {s.name for s in specs} - set(offsets), set(offsets) - {s.name for s in specs}
    if missing or extra:
        raise ValueError(
            f"offsets must name exactly the tensors in specs; missing {sorted(missing)}, unknown {sorted(extra)}"
        )
    ordered = sorted(specs, key=lambda s: (offsets[s.name], offsets[s.name] + s.numel))
    placement = [(spec, offsets[spec.name]) for spec in ordered]
    layout = _make_layout(specs, world_size, segment_size, alignment, placement, "manual", 0.0)
    layout.validate()
    return layout


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
    blocks = max((min(_step(s.granularity, alignment), _align_up(s.numel, alignment)) for s in tensors), default=1)
    room = _align_up(max(alignment * -(-units // world_size), blocks, 1), alignment)
    coarse = sorted((s for s in tensors if s.granularity > 1), key=lambda s: -s.numel)
    limits = [spec.numel // 2 for spec in coarse] + [0]
    best, lcm = _align_up(max(room, limits[0] + 1), alignment), alignment
    for spec, limit, next_limit in zip(coarse, limits, limits[1:]):
        lcm = math.lcm(lcm, spec.granularity)
        size = _align_up(max(room, next_limit + 1), lcm)
        if size <= limit:
            best = min(best, size)
    return best


def earliest_offset(
    cursor: int, numel: int, granularity: int, segment: int, alignment: int = 1
) -> Optional[int]:
    """Smallest valid offset ``>= cursor`` for a tensor, or None when no offset is valid for this segment size.

    Valid offsets are multiples of ``alignment`` (``segment`` must be one too), so
    the search starts at the cursor rounded up to it and cuts must be multiples of
    ``step = lcm(alignment, granularity)`` (see the module docstring). If the
    tensor ends by the next boundary b, the (aligned) cursor itself. Otherwise b is
    cut, so the start must be congruent to b modulo step: the first such start
    ``cursor + (b - cursor) % step``, aligned since b and the cursor are; any later
    start in the same segment only pushes the end further, so if that start also
    cuts boundary ``b + S`` with ``S % step != 0`` the whole segment is hopeless and
    the search moves to b (aligned). From a boundary the situation repeats in every
    later segment, so a failure there is final.
    """
    return _earliest(_align_up(cursor, alignment), numel, _step(granularity, alignment), segment)


def _earliest(cursor: int, numel: int, step: int, segment: int) -> Optional[int]:
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


def _plan_greedy(tensors: list[TensorSpec], world_size: int, alignment: int) -> tuple[int, Placement]:
    """The given order, binary search on S."""
    low, high = _search_range(tensors, world_size, alignment)
    return _binary_search(_fixed_order(tensors, alignment), low, high, alignment, world_size)


def _plan_optimal(tensors: list[TensorSpec], world_size: int, alignment: int) -> tuple[int, Placement]:
    """Binary search per order, then re-check the candidate segment sizes below the best answer.

    The given order is one of the searched orders, so the result is never worse
    than greedy. The re-check tries, in increasing S, a window just below the
    best answer and multiples of granularity lcms (a tensor spanning two
    boundaries forces ``S % g == 0``, making feasible sizes sparse); for small
    groups each candidate is decided over all orders at once.
    """
    low, high = _search_range(tensors, world_size, alignment)
    strategies = _search_strategies(tensors, alignment)
    best = min(
        (_binary_search(strategy, low, high, alignment, world_size) for strategy in strategies),
        key=lambda result: result[0],
    )
    checks = [_all_orders(tensors, alignment)] if _multiset_states(tensors) <= _EXHAUSTIVE_STATES else strategies
    large_first = sorted({(s.numel, _step(s.granularity, alignment)) for s in tensors if s.granularity > 1})[::-1]
    for segment in _candidate_segments(tensors, low, best[0], alignment):
        if not _cuts_possible(large_first, segment):
            continue
        for strategy in checks:
            placement = strategy(segment, world_size * segment)
            if placement is not None:
                return segment, placement
    return best


def _search_range(tensors: Sequence[TensorSpec], world_size: int, alignment: int) -> tuple[int, int]:
    """The lower bound, and a segment size every strategy surely fits.

    Two sizes surely fit: the whole group in the first segment (every tensor at
    the aligned cursor: ``sum(align_up(numel, a))``), and any multiple of a and
    every granularity with room for ``step - 1`` padding per tensor (with
    ``S % step == 0`` an earliest offset is never more than ``step - 1`` past the
    cursor: at most ``a - 1`` to align it, then at most ``step - a`` to a start
    congruent to the boundary modulo step, or to the boundary itself).
    """
    low = segment_lower_bound(tensors, world_size, alignment)
    total = sum(spec.numel for spec in tensors)
    blocks = math.lcm(alignment, *(spec.granularity for spec in tensors))
    one_segment = sum(_align_up(spec.numel, alignment) for spec in tensors)
    room = -(-(total + sum(_step(spec.granularity, alignment) - 1 for spec in tensors)) // world_size)
    return low, max(low, min(one_segment, _align_up(room, blocks)))


def _binary_search(
    strategy: Strategy, low: int, high: int, alignment: int, world_size: int
) -> tuple[int, Placement]:
    """Smallest S found by bisection over multiples of ``alignment`` in [low, high]; ``high`` must fit.

    Feasibility is not monotone in S, so the answer fits but need not be the minimum.
    """
    best = (high, strategy(high, world_size * high))
    assert best[1] is not None, "the upper bound must always fit"
    low_unit, high_unit = low // alignment, high // alignment
    while low_unit < high_unit:
        middle = (low_unit + high_unit) // 2 * alignment
        placement = strategy(middle, world_size * middle)
        if placement is None:
            low_unit = middle // alignment + 1
        else:
            high_unit, best = middle // alignment, (middle, placement)
    return best


def _candidate_segments(tensors: Sequence[TensorSpec], low: int, best: int, alignment: int) -> list[int]:
    """Segment sizes below ``best`` worth an exact check, ascending.

    A window of ``_WINDOW`` alignment steps below ``best`` (feasibility is not
    monotone), plus the first multiples of ``lcm(alignment, g_1..g_k)`` for every
    prefix of the tensors by decreasing size: the tensors larger than S, which
    typically span two boundaries and force S to a multiple of their granularity.
    """
    candidates = set(range(max(low, best - _WINDOW * alignment), best, alignment))
    lcm = alignment
    for spec in sorted(tensors, key=lambda s: -s.numel):
        lcm = math.lcm(lcm, spec.granularity)
        first = _align_up(low, lcm)
        if first >= best:
            break
        candidates.update(size for size in range(first, first + _LCM_MULTIPLES * lcm, lcm) if size < best)
    return sorted(candidates)


def _cuts_possible(large_first: Sequence[tuple[int, int]], segment: int) -> bool:
    """Quick necessary check: can every ``(numel, step)`` longer than a segment be cut validly?

    ``step = lcm(alignment, granularity)`` (cuts from an aligned offset are
    multiples of it). Unless ``S % step == 0``, such a tensor must be cut exactly
    once, at a multiple of step that leaves at most S on either side, and it must
    be shorter than 2S.
    """
    for numel, step in large_first:
        if numel <= segment:
            return True
        if segment % step and (numel >= 2 * segment or segment // step * step < numel - segment):
            return False
    return True


def _search_strategies(tensors: list[TensorSpec], alignment: int) -> list[Strategy]:
    """Distinct fixed orders (given, step- and numel-descending), gap filling, least padding next.

    ``step = lcm(alignment, granularity)`` is the granularity that matters from aligned offsets.
    """
    orders = [
        tensors,
        sorted(tensors, key=lambda s: (-_step(s.granularity, alignment), -s.numel)),
        sorted(tensors, key=lambda s: (-s.numel, -_step(s.granularity, alignment))),
    ]
    strategies, seen = [], set()
    for order in orders:
        signature = tuple((s.numel, s.granularity) for s in order)
        if signature not in seen:
            seen.add(signature)
            strategies.append(_fixed_order(order, alignment))
    if any(alignment % s.granularity == 0 for s in tensors) and any(alignment % s.granularity for s in tensors):
        strategies.append(_coarse_first_with_fillers(tensors, alignment))
    strategies.append(_least_padding_next(tensors, alignment, coarse_first=True))
    strategies.append(_least_padding_next(tensors, alignment, coarse_first=False))
    return strategies


def _fixed_order(order: Sequence[TensorSpec], alignment: int) -> Strategy:
    return lambda segment, capacity: pack_in_order(order, segment, capacity, alignment)


def _coarse_first_with_fillers(tensors: Sequence[TensorSpec], alignment: int) -> Strategy:
    """Coarse tensors by decreasing step; fillers (granularity dividing the alignment) fill the gaps they leave.

    A filler's valid offsets are all aligned offsets (any cut from one is a
    multiple of the alignment, so of its granularity); at alignment 1 the fillers
    are the element-granular tensors. When a coarse tensor's earliest offset lies
    past the aligned cursor, the gap would be padding. A filler placed in the gap
    changes nothing after it (an earliest offset is the same from any cursor up
    to it, Fact 1), so the largest fillers that fit go there; leftovers go at the
    end, where they pack tightly (up to alignment padding).
    """
    coarse = sorted(
        (s for s in tensors if alignment % s.granularity), key=lambda s: (-_step(s.granularity, alignment), -s.numel)
    )
    fillers = sorted((s for s in tensors if alignment % s.granularity == 0), key=lambda s: s.numel)

    def place(segment: int, capacity: int) -> Optional[Placement]:
        pool, sizes = list(fillers), [s.numel for s in fillers]
        remaining = sum(spec.numel for spec in tensors)
        cursor, placement = 0, []
        for spec in coarse:
            start = earliest_offset(cursor, spec.numel, spec.granularity, segment, alignment)
            if start is None:
                return None
            while (gap := start - _align_up(cursor, alignment)) > 0 and (
                index := bisect.bisect_right(sizes, gap) - 1
            ) >= 0:
                sizes.pop(index)
                filler = pool.pop(index)
                placement.append((filler, start - gap))
                cursor = start - gap + filler.numel
                remaining -= filler.numel
            placement.append((spec, start))
            cursor = start + spec.numel
            remaining -= spec.numel
            if cursor + remaining > capacity:
                return None
        for filler in pool:
            cursor = _align_up(cursor, alignment)
            placement.append((filler, cursor))
            cursor += filler.numel
        return placement if cursor <= capacity else None

    return place


def _least_padding_next(tensors: Sequence[TensorSpec], alignment: int, coarse_first: bool) -> Strategy:
    """Build the order while packing: next comes the tensor that needs the least padding here.

    Ties go to the coarser tensor (``coarse_first``) or to the larger one: the
    hardest to place later. Identical tensors are one candidate, so a step costs
    the number of distinct (numel, granularity) kinds.
    """

    def step(kind: tuple[int, int]) -> int:
        return _step(kind[1], alignment)

    key = (lambda kind: (-step(kind), -kind[0])) if coarse_first else (lambda kind: (-kind[0], -step(kind)))
    kinds = sorted(_kinds(tensors).items(), key=lambda item: key(item[0]))

    def place(segment: int, capacity: int) -> Optional[Placement]:
        active = [
            (numel, granularity, list(reversed(group)), _step(granularity, alignment))
            for (numel, granularity), group in kinds
        ]
        remaining = sum(spec.numel for spec in tensors)
        cursor, placement = 0, []
        while active:
            choice, choice_start = None, None
            aligned = _align_up(cursor, alignment)
            for candidate in active:
                start = _earliest(aligned, candidate[0], candidate[3], segment)
                if start is not None and (choice_start is None or start < choice_start):
                    choice, choice_start = candidate, start
                    if start == aligned:
                        break  # no avoidable padding: nothing later in preference order can do better
            if choice is None:
                return None
            spec = choice[2].pop()
            if not choice[2]:
                active.remove(choice)
            remaining -= spec.numel
            cursor = choice_start + spec.numel
            if cursor + remaining > capacity:
                return None
            placement.append((spec, choice_start))
        return placement

    return place


def _multiset_states(tensors: Sequence[TensorSpec]) -> int:
    """Number of sub-multisets of the tensors, identical (numel, granularity) counted as one kind."""
    return math.prod(len(group) + 1 for group in _kinds(tensors).values())


def _kinds(tensors: Sequence[TensorSpec]) -> dict[tuple[int, int], list[TensorSpec]]:
    kinds: dict[tuple[int, int], list[TensorSpec]] = {}
    for spec in tensors:
        kinds.setdefault((spec.numel, spec.granularity), []).append(spec)
    return kinds


def _all_orders(tensors: Sequence[TensorSpec], alignment: int) -> Strategy:
    """Exact check over every order at once: a DP over sub-multisets (the paper's DP, all orders).

    By Fact 1 the smallest end of a set M placed in any order, with t last, is
    t's earliest offset after the smallest end of ``M - {t}``, plus ``numel_t``;
    so ``end[M] = min_t place(t, end[M - t])`` (offsets aligned: Fact 1 holds for them).
    States are count vectors over the kinds of identical tensors, indexed in mixed
    radix so predecessors come first.
    """
    kinds = list(_kinds(tensors).items())
    steps = [_step(granularity, alignment) for (_, granularity), _ in kinds]
    strides = [math.prod(len(group) + 1 for _, group in kinds[:i]) for i in range(len(kinds))]
    states = [
        tuple((index // stride) % (len(group) + 1) for stride, (_, group) in zip(strides, kinds))
        for index in range(_multiset_states(tensors))
    ]
    total = sum(spec.numel for spec in tensors)
    remaining = [total - sum(count * numel for count, ((numel, _), _) in zip(state, kinds)) for state in states]

    def place(segment: int, capacity: int) -> Optional[Placement]:
        end: list[Optional[int]] = [0] + [None] * (len(states) - 1)
        last: list[int] = [-1] * len(states)
        for index in range(1, len(states)):
            for kind, ((numel, _), _) in enumerate(kinds):
                previous = end[index - strides[kind]] if states[index][kind] else None
                if previous is None:
                    continue
                start = _earliest(_align_up(previous, alignment), numel, steps[kind], segment)
                if start is None or start + numel + remaining[index] > capacity:
                    continue
                if end[index] is None or start + numel < end[index]:
                    end[index], last[index] = start + numel, kind
        if end[-1] is None:
            return None
        sequence, index = [], len(states) - 1
        while index:
            sequence.append(last[index])
            index -= strides[last[index]]
        order = [kinds[kind][1][occurrence] for kind, occurrence in _number_occurrences(reversed(sequence))]
        return pack_in_order(order, segment, capacity, alignment)

    return place


def _number_occurrences(kinds: Sequence[int]) -> list[tuple[int, int]]:
    """Pair every kind in a sequence with how many times it appeared before."""
    seen: dict[int, int] = {}
    numbered = []
    for kind in kinds:
        numbered.append((kind, seen.get(kind, 0)))
        seen[kind] = seen.get(kind, 0) + 1
    return numbered


def _make_layout(
    specs: Sequence[TensorSpec],
    world_size: int,
    segment: int,
    alignment: int,
    placement: Placement,
    algorithm: str,
    seconds: float,
) -> Layout:
    return Layout(
        world_size=world_size,
        segment_size=segment,
        alignment=alignment,
        order=tuple(spec.name for spec, _ in placement),
        specs={spec.name: spec for spec in specs},
        offsets={spec.name: offset for spec, offset in placement},
        algorithm=algorithm,
        plan_seconds=seconds,
    )


def _check_plan_arguments(specs: Sequence[TensorSpec], world_size: int, algorithm: str, alignment: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is invalid; pass the number of ranks, a positive int")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is unknown; use one of {ALGORITHMS}")
    if not isinstance(alignment, int) or alignment < 1:
        raise DBufferAlignmentError(f"alignment={alignment!r}; pass a positive int (elements), e.g. 1 or 16")
    for spec in specs:
        if not isinstance(spec, TensorSpec):
            raise ValueError(f"specs must be TensorSpec instances, got {spec!r}; wrap it as TensorSpec(name, numel)")
    _check_unique_names(specs)


def _check_unique_names(specs: Sequence[TensorSpec]) -> None:
    duplicates = sorted(name for name, count in Counter(spec.name for spec in specs).items() if count > 1)
    if duplicates:
        raise ValueError(f"tensor names must be unique in a group; {duplicates} appear more than once; rename them")


def _align_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _step(granularity: int, alignment: int) -> int:
    """The unit of a cut from an aligned offset: ``lcm(alignment, granularity)`` (module docstring)."""
    return granularity if alignment == 1 else math.lcm(alignment, granularity)
