"""Structure-aware planning: lay out one FSDP group's tensors in a flat buffer.

:func:`plan` is the entry: it checks the arguments, runs one of :data:`ALGORITHMS`
and validates the result. The problem and its data types are in
:mod:`lightning_ragged.layout.spec`, the facts and the exact packing of one order
(with their proofs) in :mod:`lightning_ragged.layout.packing`, and the algorithms in
:mod:`lightning_ragged.layout.search`.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Mapping, Sequence

from lightning_ragged.layout.errors import DBufferAlignmentError
from lightning_ragged.layout.search import plan_greedy, plan_optimal
from lightning_ragged.layout.spec import Layout, Placement, TensorSpec, is_positive_int

ALGORITHMS = ("greedy", "optimal")


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
        segment, placement = plan_greedy(tensors, world_size, alignment)
    else:
        segment, placement = plan_optimal(tensors, world_size, alignment)
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


def check_alignment(alignment: object) -> None:
    if not is_positive_int(alignment):
        raise DBufferAlignmentError(f"alignment={alignment!r}; pass a positive int (elements), e.g. 1 or 16")


def _check_plan_arguments(specs: Sequence[TensorSpec], world_size: int, algorithm: str, alignment: int) -> None:
    if not is_positive_int(world_size):
        raise ValueError(f"world_size={world_size!r} is invalid; pass the number of ranks, a positive int")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is unknown; use one of {ALGORITHMS}")
    check_alignment(alignment)
    for spec in specs:
        if not isinstance(spec, TensorSpec):
            raise ValueError(f"specs must be TensorSpec instances, got {spec!r}; wrap it as TensorSpec(name, numel)")
    _check_unique_names(specs)


def _check_unique_names(specs: Sequence[TensorSpec]) -> None:
    duplicates = sorted(name for name, count in Counter(spec.name for spec in specs).items() if count > 1)
    if duplicates:
        raise ValueError(f"tensor names must be unique in a group; {duplicates} appear more than once; rename them")
