"""Per-rank memory of a sharded model: the one estimate the plan report and the auto-planner share.

Pure arithmetic on planned segment sizes (no torch): what each rank holds sharded
(parameters, gradients, optimizer states) and the transient peak of the largest group
unsharded. Activations are not included.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Mapping, Sequence, Union

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
OPTIMIZER_STATE_BYTES = {
    # bytes of optimizer state per parameter element
    "adamw": 8.0,  # exp_avg + exp_avg_sq in fp32
    "muon": 4.0,  # momentum buffer in fp32
    "sgd": 4.0,  # momentum buffer
    "adamw8bit": 2.0 + 2 * 4 / 256,  # two 8-bit states + an fp32 scale per 256-element block each
    "none": 0.0,
}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_SIZE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def memory_estimate(
    groups: Sequence[Mapping[str, Any]], shard_world: int, master_bytes: int, param_bytes: int, optimizer: str,
    reduce_bytes: int | None = None,
) -> dict[str, float]:
    """Per-rank bytes: sharded params, grads and optimizer states; the largest full group (params, grads).

    ``groups``: one mapping per group kind with ``count`` (identical groups) and ``dbuffers``
    (one mapping per DBuffer with its ``segment_size`` in elements), as the plan report lists them.
    ``param_bytes``: the all-gathered (compute) element; ``reduce_bytes``: the reduction's element,
    the policy's ``reduce_dtype`` (None: ``param_bytes``, as ``reduce_dtype=None``). The engine holds a
    full gradient buffer in the narrower of the two and, when the reduction is wider, casts it for the
    backend's reduce-scatter (both alive until it finished); ``no_sync`` accumulates in the reduce dtype.
    """
    segment_elements = sum(g["count"] * sum(b["segment_size"] for b in g["dbuffers"]) for g in groups)
    largest = max(sum(b["segment_size"] * shard_world for b in g["dbuffers"]) for g in groups)
    params = segment_elements * master_bytes
    grads = segment_elements * master_bytes
    states = segment_elements * OPTIMIZER_STATE_BYTES[optimizer]
    unsharded = largest * param_bytes
    # One group computing and the next one prefetched, plus one full gradient buffer in backward: in the
    # narrower dtype, and its cast to a wider reduce dtype at the reduction (no_sync's buffer in the reduce
    # dtype alone is never larger).
    reduce_bytes = param_bytes if reduce_bytes is None else reduce_bytes
    held = min(param_bytes, reduce_bytes)
    grad_buffer = held + (reduce_bytes if reduce_bytes > held else 0)
    transient = 2 * unsharded + largest * grad_buffer
    return dict(
        params=params,
        grads=grads,
        optimizer_states=states,
        largest_unsharded_group=unsharded,
        transient_peak=transient,
        total=params + grads + states + transient,
    )


def parse_bytes(value: Union[str, int, float], name: str = "memory_budget_bytes") -> int:
    """Bytes from an int or a size such as ``"80GB"`` (10**9 per GB) or ``"80GiB"`` (2**30); ``ValueError`` if not."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a size; pass bytes (an int) or a string such as '80GB' or '80GiB'")
    if isinstance(value, (int, float)):
        number, unit = Fraction(value), ""
    else:
        match = _SIZE.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a size; pass bytes (an int) or a number with a unit "
                f"({', '.join(u.upper() for u in _UNITS if u)}), e.g. '80GB' (80*10**9) or '80GiB' (80*2**30)"
            )
        number, unit = Fraction(match.group(1)), match.group(2).lower()  # exact: "4.1GB" is 4,100,000,000
    size = number * _UNITS[unit]  # with a unit, whole bytes rounded down ('70.3GiB'); bytes alone must be whole
    if size < 1 or (not unit and size != int(size)):
        raise ValueError(f"{name}={value!r} must be a positive whole number of bytes, e.g. '80GB' or '1.5GiB'")
    return int(size)


def format_bytes(nbytes: float, digits: int = 1) -> str:
    """``nbytes`` in binary units for messages and reports (``1,234 B``, ``12.5 MiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024:
            return f"{int(nbytes):,} B" if unit == "B" else f"{nbytes:,.{digits}f} {unit}"
        nbytes /= 1024
    return f"{nbytes:,.{digits}f} TiB"
