"""Whether a state dict fits a (sharded) module: its keys and each tensor's global shape.

One comparison for every load: ``load_full_state_dict`` raises what it finds before a collective
or a copy, and the checkpoint readers raise it as ``CheckpointMismatchError``. A copy into a shard
slices the flattened tensor, so a transposed or larger tensor would load silently and a 0-d one
would broadcast over the parameter (torch's ``load_state_dict`` reports "size mismatch").
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from lightning_ragged.engine.state_dict import sharded_params


def expected_model_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor key the module's state dict holds (what a loaded state dict must have)."""
    sharded = sharded_params(module)
    shapes = {}
    for key, value in module.state_dict().items():
        if key in sharded:
            shapes[key] = tuple(sharded[key].param.ragged_shard.global_shape)
        elif isinstance(value, torch.Tensor):
            shapes[key] = tuple(value.shape)
    return shapes


def shape_problems(
    given: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]], strict: bool, given_name: str
) -> list[str]:
    """What differs between ``given`` shapes (from ``given_name``: "the checkpoint") and the module's: missing and
    unexpected keys (when ``strict``), shape mismatches (always). Empty when they fit."""
    missing = sorted(expected.keys() - given.keys())
    unexpected = sorted(given.keys() - expected.keys())
    shapes = sorted(
        f"{key}: {given_name.removeprefix('the ')} {list(given[key])} vs model {list(expected[key])}"
        for key in expected.keys() & given.keys()
        if tuple(given[key]) != tuple(expected[key])
    )
    problems = []
    if missing and strict:
        problems.append(f"missing keys (in the model, not in {given_name}): {short_list(missing)}")
    if unexpected and strict:
        problems.append(f"unexpected keys (in {given_name}, not in the model): {short_list(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch: {short_list(shapes)}")
    return problems


def short_list(items: Sequence[str], limit: int = 8) -> str:
    """At most ``limit`` items for a message, and how many more there are."""
    shown = ", ".join(items[:limit])
    return shown + (f" ... and {len(items) - limit} more" if len(items) > limit else "")
