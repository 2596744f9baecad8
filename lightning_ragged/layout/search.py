"""The two planning algorithms: the segment size search and the orders it tries.

**Algorithms.** ``"greedy"``: the given order, binary search on S between the
lower bound and a size that surely fits. ``"optimal"``: the same binary search
for several orders (given, step-descending, numel-descending, coarse tensors
first with fine ones (step = a) filling the gaps, and two "least padding next"
orders built while packing); then, because feasibility is not
monotone in S, every candidate below the best answer is re-checked in
increasing order: a window of ``_WINDOW`` sizes just below it and the first
multiples of the lcms from Fact 3 (:mod:`lightning_ragged.layout.packing`).
For small groups (at most ``_EXHAUSTIVE_STATES`` sub-multisets of identical
tensors) each candidate is decided over all orders at once by a DP over
subsets, so there ``"optimal"`` misses the true optimum only if it lies outside
the candidates.
"""

from __future__ import annotations

import bisect
import math
from typing import Callable, Optional, Sequence

from lightning_ragged.layout.packing import earliest_aligned, earliest_offset, pack_in_order, segment_lower_bound
from lightning_ragged.layout.spec import Placement, TensorSpec, align_up, cut_step

Strategy = Callable[[int, int], Optional[Placement]]
"""``(segment_size, capacity) -> placement`` or None when it does not fit."""

_WINDOW = 64
"""Segment sizes below the best binary-search answer that ``"optimal"`` re-checks one by one
(feasibility is not monotone in S, so binary search can overshoot the true minimum)."""

_LCM_MULTIPLES = 4
"""Multiples of each granularity lcm that ``"optimal"`` tries (see :func:`_candidate_segments`)."""

_EXHAUSTIVE_STATES = 256
"""Largest multiset-subset state space for which ``"optimal"`` tries every order (8 distinct tensors)."""


def plan_greedy(tensors: list[TensorSpec], world_size: int, alignment: int) -> tuple[int, Placement]:
    """The given order, binary search on S."""
    low, high = _search_range(tensors, world_size, alignment)
    return _binary_search(_fixed_order(tensors, alignment), low, high, alignment, world_size)


def plan_optimal(tensors: list[TensorSpec], world_size: int, alignment: int) -> tuple[int, Placement]:
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
    large_first = sorted({(s.numel, cut_step(s.granularity, alignment)) for s in tensors if s.granularity > 1})[::-1]
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
    one_segment = sum(align_up(spec.numel, alignment) for spec in tensors)
    room = -(-(total + sum(cut_step(spec.granularity, alignment) - 1 for spec in tensors)) // world_size)
    return low, max(low, min(one_segment, align_up(room, blocks)))


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
        first = align_up(low, lcm)
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
        sorted(tensors, key=lambda s: (-cut_step(s.granularity, alignment), -s.numel)),
        sorted(tensors, key=lambda s: (-s.numel, -cut_step(s.granularity, alignment))),
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
        (s for s in tensors if alignment % s.granularity), key=lambda s: (-cut_step(s.granularity, alignment), -s.numel)
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
            while (gap := start - align_up(cursor, alignment)) > 0 and (
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
            cursor = align_up(cursor, alignment)
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
        return cut_step(kind[1], alignment)

    key = (lambda kind: (-step(kind), -kind[0])) if coarse_first else (lambda kind: (-kind[0], -step(kind)))
    kinds = sorted(_kinds(tensors).items(), key=lambda item: key(item[0]))

    def place(segment: int, capacity: int) -> Optional[Placement]:
        active = [
            (numel, granularity, list(reversed(group)), cut_step(granularity, alignment))
            for (numel, granularity), group in kinds
        ]
        remaining = sum(spec.numel for spec in tensors)
        cursor, placement = 0, []
        while active:
            choice, choice_start = None, None
            aligned = align_up(cursor, alignment)
            for candidate in active:
                start = earliest_aligned(aligned, candidate[0], candidate[3], segment)
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
    steps = [cut_step(granularity, alignment) for (_, granularity), _ in kinds]
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
                start = earliest_aligned(align_up(previous, alignment), numel, steps[kind], segment)
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
