"""The matrices Muon orthogonalizes inside one parameter, and where their pieces lie.

A parameter is laid out as ``count`` equal matrices end to end in its flat (row-major) elements:

* a 2-D weight ``[a, b]`` is one matrix;
* a fused expert stack ``[E, a, b]`` (every MoE in ``transformers``: Qwen3-MoE, Mixtral,
  GPT-OSS, DeepSeek-V3) is ``E`` matrices ``[a, b]``, one per expert; ``shard_granularity="muon"``
  keeps every expert whole on a rank (``"row"`` cuts at rows of one expert);
* with the opt-in ``qkv_heads``, a 2-D weight whose name matches is ``count`` head matrices
  ``[a / count, b]`` (a fused ``[3·H·d, in]`` QKV: ``count = 3·H``; a ``[H·d, in]`` projection:
  ``H``; a fused GQA ``[(H + 2·K)·d, in]``: ``H + 2·K``), as torchtitan's DistMuon and Dion offer.
  ``shard_granularity="block"`` with ``block_rows=d`` (or ``"muon"``) keeps heads whole.

Each matrix is orthogonalized on its own, exactly as ``torch.optim.Muon`` would on a separate
parameter of that shape (its own Newton–Schulz and its own ``adjust_lr`` on ``[a, b]``).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence, Union

import torch

from lightning_ragged.layout.spec import is_positive_int

HeadSpec = Union[Mapping[str, int], Callable[[str, torch.Size], Optional[int]], None]
"""``qkv_heads``: ``{name fragment: head matrices}``, or ``(name, global_shape) -> head matrices | None``."""

Ranges = tuple[tuple[int, int], ...]


def head_count(name: str, shape: Sequence[int], qkv_heads: HeadSpec) -> int | None:
    """How many head matrices ``qkv_heads`` splits the parameter into (None: not split)."""
    if qkv_heads is None:
        return None
    if callable(qkv_heads):
        count = qkv_heads(name, torch.Size(shape))
    else:
        counts = {value for fragment, value in qkv_heads.items() if fragment in name}
        if len(counts) > 1:
            raise ValueError(
                f"qkv_heads gives parameter {name!r} several head counts {sorted(counts)}; "
                "make the name fragments match each parameter once"
            )
        count = counts.pop() if counts else None
    if count is None:
        return None
    if not is_positive_int(count):
        raise ValueError(f"qkv_heads gives parameter {name!r} the head count {count!r}; it must be a positive int")
    if len(shape) != 2 or shape[0] % count:
        raise ValueError(
            f"qkv_heads splits parameter {name!r} of global shape {tuple(shape)} into {count} heads, but only a "
            f"2-D weight whose rows divide by the head count can be split; pass the number of d-row head blocks "
            f"(3 * num_heads for a fused [3*H*d, in] QKV) or leave {name!r} out of qkv_heads"
        )
    return count


def matrix_layout(name: str, shape: Sequence[int], qkv_heads: HeadSpec = None) -> tuple[int, tuple[int, int]]:
    """``(count, (a, b))``: the parameter is ``count`` matrices ``[a, b]`` end to end (2-D or 3-D only)."""
    heads = head_count(name, shape, qkv_heads)  # refuses to split a 3-D parameter into heads
    if len(shape) == 3:
        return int(shape[0]), (int(shape[1]), int(shape[2]))
    heads = heads or 1
    return heads, (int(shape[0]) // heads, int(shape[1]))


def matrix_pieces(rank_ranges: Ranges, offset: int, numel: int) -> Ranges:
    """Each rank's piece of the matrix at flat ``[offset, offset + numel)``, relative to the matrix."""
    pieces = []
    for start, end in rank_ranges:
        lo, hi = max(start, offset), min(end, offset + numel)
        pieces.append((lo - offset, hi - offset) if lo < hi else (0, 0))
    return tuple(pieces)
