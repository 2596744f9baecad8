"""Structure-aware planner: validity on random groups, optimality against brute force, errors, known cases.

The oracles here (``check_layout``, ``brute_force_fits``, ``exact_segment_size``)
are written from the problem statement only and share no code with the planner.
The problem statement includes the alignment unit a: S and every tensor's offset
are multiples of a.
"""

from __future__ import annotations

import math
import random
from functools import lru_cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_ragged.layout import search
from lightning_ragged.layout.errors import DBufferAlignmentError, RaggedShardBoundaryViolation
from lightning_ragged.layout.packing import earliest_offset, segment_lower_bound
from lightning_ragged.layout.planner import manual_layout, plan
from lightning_ragged.layout.spec import TensorSpec

ALGORITHMS = ("greedy", "optimal")


# ----------------------------------------------------------------------------------------------
# Independent oracles
# ----------------------------------------------------------------------------------------------


def design_lower_bound(specs, world_size, alignment):
    """DESIGN.md's bound: ceil(total / world_size) rounded up to the alignment unit (and positive)."""
    per_rank = max(-(-sum(s.numel for s in specs) // world_size), 1)
    return -(-per_rank // alignment) * alignment


def cuts_are_whole(numel, granularity, offset, segment):
    """Every rank boundary strictly inside [offset, offset + numel) is a multiple of the granularity from its start."""
    first = (offset // segment + 1) * segment
    return all((b - offset) % granularity == 0 for b in range(first, offset + numel, segment))


def check_layout(layout, specs, world_size, alignment):
    """Check a layout against the problem statement, without Layout.validate."""
    size = layout.segment_size
    assert size > 0 and size % alignment == 0
    misaligned = {s.name: layout.offsets[s.name] for s in specs if layout.offsets[s.name] % alignment}
    assert not misaligned, f"offsets not multiples of alignment={alignment}: {misaligned}"
    assert layout.world_size == world_size and layout.alignment == alignment
    assert layout.buffer_numel == world_size * size
    assert sorted(layout.order) == sorted(s.name for s in specs)
    assert layout.total_numel == sum(s.numel for s in specs)
    assert size >= design_lower_bound(specs, world_size, alignment)
    by_name = {s.name: s for s in specs}
    offsets = [layout.offsets[name] for name in layout.order]
    assert offsets == sorted(offsets), "order must be by increasing offset"

    intervals = sorted((layout.offsets[s.name], layout.offsets[s.name] + s.numel, s) for s in specs if s.numel)
    previous_end = 0
    for start, end, spec in intervals:
        assert start >= previous_end, f"{spec.name} overlaps the tensor before it"
        assert end <= layout.buffer_numel, f"{spec.name} ends outside the buffer"
        assert cuts_are_whole(spec.numel, spec.granularity, start, size), f"{spec.name} is cut inside a block"
        previous_end = end

    all_ranges = {name: layout.ranges(name) for name in by_name}
    for name, spec in by_name.items():
        ranges = all_ranges[name]
        assert len(ranges) == world_size
        assert ranges[0][0] == 0 and ranges[-1][1] == spec.numel
        for (start, end), (next_start, _) in zip(ranges, ranges[1:]):
            assert start <= end == next_start  # contiguous, in rank order, together exactly [0, numel)
        offset = layout.offsets[name]
        for rank, (start, end) in enumerate(ranges):
            overlap = max(0, min(offset + spec.numel, (rank + 1) * size) - max(offset, rank * size))
            assert end - start == overlap
            if 0 < start < spec.numel:
                assert start % spec.granularity == 0

    for rank in sorted({0, world_size - 1, world_size // 2}):
        pieces = layout.local_pieces(rank)
        expected = [name for name in layout.order if all_ranges[name][rank][0] < all_ranges[name][rank][1]]
        assert [piece[0] for piece in pieces] == expected
        for name, start, end, segment_offset in pieces:
            assert (start, end) == all_ranges[name][rank]
            assert segment_offset == layout.offsets[name] + start - rank * size
            assert 0 <= segment_offset and segment_offset + end - start <= size


def brute_force_fits(specs, world_size, segment, alignment=1):
    """Is there any valid layout with this segment size? DFS over the next tensor and every offset for it.

    Offsets are the multiples of ``alignment`` bounded only by the room the
    remaining tensors need; failures are memoised per (placed set, cursor).
    """
    items = [(s.numel, s.granularity) for s in specs if s.numel]
    capacity, everything = world_size * segment, (1 << len(items)) - 1

    @lru_cache(maxsize=None)
    def fits_from(placed, cursor):
        if placed == everything:
            return True
        remaining = sum(items[i][0] for i in range(len(items)) if not placed >> i & 1)
        tried = set()
        for i, (numel, granularity) in enumerate(items):
            if placed >> i & 1 or (numel, granularity) in tried:
                continue
            tried.add((numel, granularity))
            for offset in range(-(-cursor // alignment) * alignment, capacity - remaining + 1, alignment):
                if cuts_are_whole(numel, granularity, offset, segment) and fits_from(placed | 1 << i, offset + numel):
                    return True
        return False

    return fits_from(0, 0)


def exact_segment_size(specs, world_size, alignment):
    """The true optimum: try segment sizes upward from DESIGN.md's lower bound."""
    segment = design_lower_bound(specs, world_size, alignment)
    while not brute_force_fits(specs, world_size, segment, alignment):
        segment += alignment
    return segment


def random_small_group(rng, max_tensors=5, max_granularity=8, max_rows=4):
    count = rng.randint(1, max_tensors)
    return [
        TensorSpec(f"t{i}", (g := rng.randint(1, max_granularity)) * rng.randint(0, max_rows), g) for i in range(count)
    ]


@st.composite
def groups(draw, max_tensors, max_granularity, max_rows):
    """Groups of tensors of ``rows`` blocks (the last one possibly short), some empty, many sharing a spec."""
    triples = draw(
        st.lists(
            st.tuples(st.integers(1, max_granularity), st.integers(0, max_rows), st.integers(0, max_granularity - 1)),
            min_size=1,
            max_size=max_tensors,
        )
    )
    specs = []
    for i, (g, rows, trim) in enumerate(triples):
        numel = max(g * rows - trim, 0)
        specs.append(TensorSpec(f"t{i}", numel, min(g, numel) if numel else g))
    return specs


@st.composite
def model_like_groups(draw):
    """Up to 30 weight matrices with realistic row lengths, row/block granularity and some 1-D tensors."""
    count = draw(st.integers(1, 30))
    specs = []
    for i in range(count):
        row = draw(st.sampled_from([1, 64, 512, 2880, 4096, 7168]))
        rows = draw(st.sampled_from([1, 8, 64, 512, 1024, 2048]))
        block = draw(st.sampled_from([1, 16, 128]))
        specs.append(TensorSpec(f"w{i}", row * rows, math.gcd(block, rows) * row))
    return specs


# ----------------------------------------------------------------------------------------------
# Random instances
# ----------------------------------------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(
    specs=groups(max_tensors=8, max_granularity=12, max_rows=6),
    world_size=st.integers(1, 9),
    alignment=st.sampled_from([1, 1, 2, 3, 4, 8]),
)
def test_random_layouts_are_valid(specs, world_size, alignment):
    layouts = {algorithm: plan(specs, world_size, algorithm, alignment) for algorithm in ALGORITHMS}
    for layout in layouts.values():
        check_layout(layout, specs, world_size, alignment)
        assert layout.segment_size >= segment_lower_bound(specs, world_size, alignment)
    assert layouts["optimal"].segment_size <= layouts["greedy"].segment_size


@settings(max_examples=16, deadline=None)
@given(
    specs=model_like_groups(),
    world_size=st.sampled_from([64, 1024, 10_000]),
    alignment=st.sampled_from([1, 4, 8, 16]),
)
def test_model_like_groups_are_valid_at_scale(specs, world_size, alignment):
    greedy = plan(specs, world_size, "greedy", alignment)
    optimal = plan(specs, world_size, "optimal", alignment)
    check_layout(optimal, specs, world_size, alignment)
    assert greedy.order == tuple(s.name for s in specs if s.numel == 0) + tuple(s.name for s in specs if s.numel)
    assert optimal.segment_size <= greedy.segment_size


@settings(max_examples=150, deadline=None)
@given(
    specs=groups(max_tensors=4, max_granularity=7, max_rows=3),
    world_size=st.integers(1, 4),
    alignment=st.sampled_from([1, 1, 2, 3, 4, 8]),
)
def test_lower_bound_and_optimal_bracket_the_exact_optimum(specs, world_size, alignment):
    exact = exact_segment_size(specs, world_size, alignment)
    assert segment_lower_bound(specs, world_size, alignment) <= exact  # the planner's bound is a true bound
    assert exact <= plan(specs, world_size, "optimal", alignment).segment_size


@settings(max_examples=150, deadline=None)
@given(
    specs=groups(max_tensors=5, max_granularity=12, max_rows=4),
    world_size=st.integers(1, 5),
    alignment=st.sampled_from([2, 4, 8]),
)
def test_aligned_layouts_against_the_exact_optimum(specs, world_size, alignment):
    """At alignment 2, 4, 8: valid (aligned offsets and S), bound <= exact <= optimal <= greedy."""
    exact = exact_segment_size(specs, world_size, alignment)
    layouts = {algorithm: plan(specs, world_size, algorithm, alignment) for algorithm in ALGORITHMS}
    for layout in layouts.values():
        check_layout(layout, specs, world_size, alignment)
    assert segment_lower_bound(specs, world_size, alignment) <= exact <= layouts["optimal"].segment_size
    assert layouts["optimal"].segment_size <= layouts["greedy"].segment_size


@settings(max_examples=400, deadline=None)
@given(
    cursor=st.integers(0, 60),
    numel=st.integers(1, 40),
    granularity=st.integers(1, 12),
    segment=st.integers(1, 20),
    alignment=st.sampled_from([1, 1, 2, 3, 4, 8]),
)
def test_earliest_offset_is_the_first_valid_offset(cursor, numel, granularity, segment, alignment):
    numel, segment = numel * granularity, segment * alignment
    # the situation repeats every segment, so a valid offset exists iff one exists within a few segments
    valid = [
        start
        for start in range(cursor, cursor + numel + 3 * segment + alignment)
        if start % alignment == 0 and cuts_are_whole(numel, granularity, start, segment)
    ]
    found = earliest_offset(cursor, numel, granularity, segment, alignment)
    assert found == (valid[0] if valid else None)
    if alignment == 1:
        assert earliest_offset(cursor, numel, granularity, segment) == found


# ----------------------------------------------------------------------------------------------
# Against the brute-force optimum
# ----------------------------------------------------------------------------------------------

SAMPLES = 300
MAX_MISS_RATE = 0.02  # measured: 0 misses at every alignment; the exhaustive DP covers these small groups
MAX_HEURISTIC_MISS_RATE = 0.10  # measured: ~5% (16/300 mixed, 14/300 at alignment 1) with orders and strategies only
MAX_EXCESS = 0.15  # a miss costs at most 15% of the optimal segment size (measured 11.8% at alignment 1) ...
MAX_ALIGNED_EXCESS = 0.30  # ... and, with aligned offsets, whole alignment units: up to 25% of these tiny S
# Misses of the orders-only heuristic on the fixed sample of SAMPLES groups at one alignment (seed 2), measured:
# alignment 1: 14 (worst 11.8%), 2: 15 (worst 20.0%), 4: 9 (worst 16.7%), 8: 2 (worst 25.0%: S 40 for 32,
# one unit of 8). With the exhaustive DP "optimal" misses 0 at each.


def miss_statistics(samples, seed, alignments=(1, 1, 2, 3)):
    """Misses of "optimal" and "greedy" against the exact optimum, and the worst relative excess per alignment."""
    rng = random.Random(seed)
    misses, greedy_misses, worst = 0, 0, {}
    for _ in range(samples):
        specs = random_small_group(rng, max_tensors=6, max_granularity=12, max_rows=5)
        world_size, alignment = rng.randint(1, 4), rng.choice(alignments)
        exact = exact_segment_size(specs, world_size, alignment)
        optimal = plan(specs, world_size, "optimal", alignment)
        greedy = plan(specs, world_size, "greedy", alignment).segment_size
        assert exact <= optimal.segment_size <= greedy
        assert segment_lower_bound(specs, world_size, alignment) <= exact
        assert all(offset % alignment == 0 for offset in optimal.offsets.values())
        misses += optimal.segment_size != exact
        greedy_misses += greedy != exact
        worst[alignment] = max(worst.get(alignment, 0.0), (optimal.segment_size - exact) / exact)
    return misses, greedy_misses, worst


def _check_against_brute_force(label: str, max_miss_rate: float, alignments=(1, 1, 2, 3)) -> int:
    """``miss_statistics`` on the fixed sample, printed under ``label`` and held to the targets; the misses."""
    misses, greedy_misses, worst = miss_statistics(SAMPLES, seed=2, alignments=alignments)
    print(f"\n{label}: {misses} misses, worst excess {max(worst.values()):.1%}; greedy misses {greedy_misses}")
    assert misses <= max_miss_rate * SAMPLES
    for alignment, excess in worst.items():
        assert excess <= (MAX_EXCESS if alignment == 1 else MAX_ALIGNED_EXCESS), (alignment, excess)
    return misses


def test_optimal_matches_brute_force_on_small_groups():
    _check_against_brute_force(f"optimal vs exact on {SAMPLES} groups of <= 6 tensors", MAX_MISS_RATE)


def test_heuristic_orders_alone_are_near_optimal(monkeypatch):
    """The path large groups take (no exhaustive search) still finds the optimum on most small groups."""
    monkeypatch.setattr(search, "_EXHAUSTIVE_STATES", 0)
    _check_against_brute_force(f"orders-only heuristic vs exact on {SAMPLES} groups", MAX_HEURISTIC_MISS_RATE)


@pytest.mark.parametrize("alignment", [1, 2, 4, 8])
def test_optimal_matches_brute_force_at_each_alignment(alignment):
    """Offsets aligned too: "optimal" is as exact at alignment 2, 4 and 8 as at 1 (exhaustive DP: 0 misses)."""
    label = f"alignment {alignment}: optimal vs exact on {SAMPLES} groups of <= 6 tensors"
    assert _check_against_brute_force(label, MAX_MISS_RATE, (alignment,)) == 0


@pytest.mark.parametrize("alignment", [1, 2, 4, 8])
def test_heuristic_orders_alone_are_near_optimal_at_each_alignment(alignment, monkeypatch):
    monkeypatch.setattr(search, "_EXHAUSTIVE_STATES", 0)
    label = f"alignment {alignment}: orders-only heuristic vs exact on {SAMPLES} groups"
    _check_against_brute_force(label, MAX_HEURISTIC_MISS_RATE, (alignment,))


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------


def test_granularity_must_fit_in_tensor():
    assert TensorSpec("w", 10, 3).granularity == 3  # blocks of 3, the last one short
    with pytest.raises(ValueError, match=r"'w'.*granularity=11 exceeds numel=10.*granularity=10"):
        TensorSpec("w", 10, 11)
    with pytest.raises(ValueError, match="granularity=0"):
        TensorSpec("w", 10, 0)
    with pytest.raises(ValueError, match="numel=-1"):
        TensorSpec("w", -1)


@pytest.mark.parametrize("world_size", [0, -3])
def test_world_size_must_be_positive(world_size):
    with pytest.raises(ValueError, match=f"world_size={world_size}.*positive"):
        plan([TensorSpec("w", 4)], world_size)


def test_unknown_algorithm():
    with pytest.raises(ValueError, match="algorithm='best'.*greedy.*optimal"):
        plan([TensorSpec("w", 4)], 2, algorithm="best")


def test_alignment_must_be_positive():
    with pytest.raises(DBufferAlignmentError, match="DBuffer alignment error: alignment=0"):
        plan([TensorSpec("w", 4)], 2, alignment=0)


def test_duplicate_names():
    with pytest.raises(ValueError, match=r"\['w'\].*more than once"):
        plan([TensorSpec("w", 4), TensorSpec("w", 8)], 2)


def test_hand_made_layout_that_cuts_a_row():
    matrix = TensorSpec("proj.weight", 7 * 13, 13)  # 7 rows of 13
    with pytest.raises(RaggedShardBoundaryViolation, match=r"^RaggedShard boundary violation:") as error:
        manual_layout([matrix], world_size=2, segment_size=50, offsets={"proj.weight": 0})
    message = str(error.value)
    assert "'proj.weight'" in message and "offset 50" in message
    assert "granularity" in message and "multiple of 13" in message


def test_hand_made_layout_whose_second_boundary_cuts_a_row():
    matrix = TensorSpec("w", 8 * 13, 26)  # 8 rows of 13, blocks of 2 rows
    manual_layout([matrix], world_size=4, segment_size=26, offsets={"w": 0})  # every cut at a block edge
    with pytest.raises(RaggedShardBoundaryViolation, match="offset 65"):
        manual_layout([matrix], world_size=4, segment_size=39, offsets={"w": 13})  # cuts at 26 (ok), 65 (not)


@pytest.mark.parametrize("make", [
    lambda: plan([TensorSpec("a", 4, 1)], True),
    lambda: plan([TensorSpec("a", 4, 1)], 2, alignment=True),
    lambda: TensorSpec("a", True, 1),
    lambda: TensorSpec("a", 4, True),
])
def test_a_bool_is_not_a_count(make):
    """True is an int to Python: plan(world_size=True) returned a layout for world size True."""
    with pytest.raises(ValueError, match="=True"):
        make()


def test_hand_made_layout_geometry_errors():
    a, b = TensorSpec("a", 6), TensorSpec("b", 6)
    with pytest.raises(DBufferAlignmentError, match="overlap"):
        manual_layout([a, b], 2, 6, {"a": 0, "b": 3})
    with pytest.raises(DBufferAlignmentError, match="outside the buffer"):
        manual_layout([a, b], 2, 6, {"a": 0, "b": 7})
    with pytest.raises(DBufferAlignmentError, match="multiple of alignment=4"):
        manual_layout([a, b], 2, 6, {"a": 0, "b": 6}, alignment=4)
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        manual_layout([a, b], 2, 6, {"a": 0})


def test_hand_made_layout_with_a_misaligned_offset():
    a, b = TensorSpec("a", 6), TensorSpec("mlp.bias", 6)
    manual_layout([a, b], 2, 8, {"a": 0, "mlp.bias": 8}, alignment=4)  # aligned: fine
    with pytest.raises(DBufferAlignmentError, match=r"^DBuffer alignment error: ") as error:
        manual_layout([a, b], 2, 8, {"a": 0, "mlp.bias": 6}, alignment=4)
    message = str(error.value)
    assert "'mlp.bias'" in message and "offset 6" in message and "alignment=4" in message
    assert "move it to a multiple of 4, e.g. 8" in message
    manual_layout([a, b], 2, 8, {"a": 0, "mlp.bias": 6})  # alignment 1 (the default) allows any offset
    with pytest.raises(DBufferAlignmentError, match=r"'empty' starts at offset 3"):  # empty tensors too
        manual_layout([a, TensorSpec("empty", 0)], 1, 8, {"a": 0, "empty": 3}, alignment=4)


# ----------------------------------------------------------------------------------------------
# Known cases
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_three_row_granular_7x13_matrices_on_two_ranks(algorithm):
    specs = [TensorSpec(f"w{i}", 7 * 13, 13) for i in range(3)]
    layout = plan(specs, 2, algorithm)
    # 273 elements need S >= 137; the boundary falls inside the middle matrix, a whole number of rows in:
    # 91 + 4 rows = 143 is the first such S.
    assert layout.segment_size == 143 and layout.padding == 13
    assert layout.ranges("w1") == ((0, 52), (52, 91))
    assert layout.local_pieces(1) == [("w1", 52, 91, 0), ("w2", 0, 91, 39)]
    check_layout(layout, specs, 2, 1)


def test_element_granular_tensors_pack_without_padding():
    specs = [TensorSpec(f"v{i}", numel) for i, numel in enumerate([5, 17, 3, 40, 1])]
    layout = plan(specs, 6)
    assert layout.segment_size == 11 and layout.padding == 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_matrix_granular_tensor_is_never_split(algorithm):
    specs = [TensorSpec("bias", 10), TensorSpec("matrix", 91, 91), TensorSpec("norm", 30)]
    layout = plan(specs, 4, algorithm)
    holders = [rank for rank, (start, end) in enumerate(layout.ranges("matrix")) if end > start]
    assert len(holders) == 1 and layout.ranges("matrix")[holders[0]] == (0, 91)
    assert layout.segment_size >= 91


@pytest.mark.parametrize("alignment", [4, 8, 16, 64, 96])
def test_alignment_is_respected(alignment):
    specs = [TensorSpec("a", 1000, 10), TensorSpec("b", 333), TensorSpec("c", 4096, 64)]
    for algorithm in ALGORITHMS:
        layout = plan(specs, 7, algorithm, alignment)
        assert layout.segment_size % alignment == 0
        assert all(offset % alignment == 0 for offset in layout.offsets.values())
        check_layout(layout, specs, 7, alignment)


def test_alignment_padding_between_tensors_is_counted():
    # bf16 views 16-byte aligned: alignment 8. 3 vectors of 5 elements need 8-element slots (the last one too:
    # the buffer end is a multiple of 8), so 2 ranks need S = 16 and 17 elements of padding.
    specs = [TensorSpec(f"v{i}", 5) for i in range(3)]
    layout = plan(specs, 2, alignment=8)
    assert sorted(layout.offsets.values()) == [0, 8, 16] and layout.segment_size == 16
    assert layout.padding == 2 * 16 - 15 and layout.padding_ratio == pytest.approx(17 / 15)
    assert segment_lower_bound(specs, 2, 8) == 16  # 3 slots of 8 over 2 ranks, not ceil(15 / 2) = 8
    assert plan(specs, 2).segment_size == 8  # unaligned: 15 elements fit in 2 x 8


def test_optimal_reorders_where_the_given_order_wastes_space():
    # matrices of 8 cannot be cut; alternating them with 3-element vectors wastes the segment ends
    specs = [TensorSpec("m0", 8, 8), TensorSpec("v0", 3), TensorSpec("m1", 8, 8), TensorSpec("v1", 3)]
    assert plan(specs, 3, "greedy").segment_size == 10
    optimal = plan(specs, 3, "optimal")
    assert optimal.segment_size == 8 and optimal.padding == 2
    assert optimal.algorithm == "optimal" and optimal.plan_seconds >= 0


def test_tensor_spanning_many_segments_forces_a_multiple_of_its_granularity():
    # 10 rows of 96 over 8 ranks: 120 elements per rank would cut rows, so S is a multiple of 96 (or 192 ...)
    layout = plan([TensorSpec("w", 960, 96)], 8)
    assert layout.segment_size % 96 == 0 and layout.segment_size == 192
    assert segment_lower_bound([TensorSpec("w", 960, 96)], 8, 1) == 192


def test_empty_tensors_take_no_space():
    specs = [TensorSpec("empty", 0, 4), TensorSpec("w", 12, 4), TensorSpec("none", 0)]
    layout = plan(specs, 3)
    assert layout.segment_size == 4 and layout.padding == 0
    assert layout.ranges("empty") == ((0, 0),) * 3
    assert all(piece[0] == "w" for rank in range(3) for piece in layout.local_pieces(rank))
    assert plan([TensorSpec("e", 0)], 2, alignment=8).segment_size == 8
    assert plan([], 2).padding_ratio == 0.0


def test_single_rank_holds_everything():
    specs = [TensorSpec("a", 91, 91), TensorSpec("b", 5)]
    layout = plan(specs, 1)
    assert layout.segment_size == 96 and layout.local_pieces(0) == [("a", 0, 91, 0), ("b", 0, 5, 91)]
    # alignment 4: b starts at 92, not 91; the 1 + 3 elements of alignment gaps are padding
    layout = plan(specs, 1, alignment=4)
    assert layout.segment_size == 100 and layout.local_pieces(0) == [("a", 0, 91, 0), ("b", 0, 5, 92)]
    assert layout.padding == 4


def test_layout_properties():
    layout = manual_layout([TensorSpec("a", 6, 2), TensorSpec("b", 4)], 2, 6, {"b": 0, "a": 4})
    assert layout.order == ("b", "a") and layout.algorithm == "manual"
    assert (layout.buffer_numel, layout.total_numel, layout.padding) == (12, 10, 2)
    assert layout.padding_ratio == pytest.approx(0.2)
    assert layout.ranges("a") == ((0, 2), (2, 6)) and layout.ranges("b") == ((0, 4), (4, 4))
    assert layout.local_pieces(0) == [("b", 0, 4, 0), ("a", 0, 2, 4)]
    assert layout.local_pieces(1) == [("a", 2, 6, 0)]
    with pytest.raises(RaggedShardBoundaryViolation, match="'a'.*offset 2"):  # 2 elements into a 3-element block
        manual_layout([TensorSpec("a", 6, 3), TensorSpec("b", 4)], 2, 6, {"b": 0, "a": 4})
