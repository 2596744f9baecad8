"""Optimizer state of 0-D parameters: which entries are per-element and which are scalars.

Both have the global shape ``()``. A sharded save records which is which
(:data:`ZERO_DIM_STATES_KEY`); without the record the optimizer's other parameters tell
(:func:`zero_dim_flat_keys`), and where nothing does, loading refuses rather than guess.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch.distributed.checkpoint._traverse import get_element, set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_ragged.checkpoint.errors import CheckpointMismatchError
from lightning_ragged.checkpoint.reader import CheckpointInfo
from lightning_ragged.layout.ragged_shard import shard_of

ZERO_DIM_STATES_KEY = "zero_dim_param_states"
"""In a torch-format optimizer state: for each 0-D parameter, the names of its state entries
shaped like it (one value per element, as AdamW's ``exp_avg``).

A 0-D parameter's per-element states and its scalar states (``step``) both have the global
shape ``()``, so shapes alone cannot tell them apart; sharded, the former are this rank's
one element or nothing (a 1-D view of 1 or 0 elements), the latter are whole on every rank.
A save of sharded 0-D parameters records which is which here (an entry only for 0-D
parameters: other checkpoints are unchanged); consolidation keeps it, keyed like "state"."""


def zero_dim_flat_keys(
    param_shapes: Mapping[Any, Sequence[int]],
    state_shapes: Mapping[Any, Mapping[str, Sequence[int]]],
    recorded: Mapping[Any, Sequence[str]] | None = None,
) -> tuple[dict[Any, set[str]], dict[Any, set[str]]]:
    """For each 0-D parameter: (its 0-D entries shaped like it, its 0-D entries nothing tells apart).

    ``recorded`` (``ZERO_DIM_STATES_KEY``) decides where it names the parameter. Otherwise the
    optimizer's parameters of one or more dimensions tell: torch.optim optimizers keep the
    same entries for every parameter, so an entry name that holds a value of its parameter's
    shape there is per-element here, and one that holds anything else is a scalar.
    """
    per_element: set[str] = set()
    scalar: set[str] = set()
    for param, entries in state_shapes.items():
        shape = param_shapes.get(param)
        if not shape:  # unknown, or 0-D itself
            continue
        for key, size in entries.items():
            (per_element if tuple(size) == tuple(shape) else scalar).add(key)
    flat: dict[Any, set[str]] = {}
    unknown: dict[Any, set[str]] = {}
    for param, entries in state_shapes.items():
        if param_shapes.get(param) is None or tuple(param_shapes[param]) != ():
            continue
        zero_dim = {key for key, size in entries.items() if tuple(size) == ()}
        if recorded is not None and param in recorded:
            flat[param] = zero_dim & set(recorded[param])
            continue
        flat[param] = {key for key in zero_dim if key in per_element and key not in scalar}
        unknown[param] = {key for key in zero_dim if (key in per_element) == (key in scalar)}
    return flat, {param: keys for param, keys in unknown.items() if keys}


def require_known_zero_dim_layout(unknown: Mapping[Any, set[str]], source: Any) -> None:
    """Refuse (``CheckpointMismatchError``) where some 0-D parameter's entries are ambiguous."""
    if unknown:
        described = ", ".join(f"{param!r}: {sorted(keys)}" for param, keys in sorted(unknown.items(), key=str))
        raise CheckpointMismatchError(
            f"{source} holds optimizer state of 0-D parameters that cannot be told apart from scalar state "
            f"({described}): shape () fits both, no other parameter of the optimizer shows which entries are "
            f"per-element, and the state has no {ZERO_DIM_STATES_KEY!r} record (a sharded save writes one)"
        )


def zero_dim_flat_keys_in_directory(
    info: CheckpointInfo, paths: Mapping[str, tuple], by_name: Mapping[str, torch.Tensor]
) -> dict[str, set[str]]:
    """For the sharded 0-D parameters of the optimizer: their saved entries shaped like them (see ``ZERO_DIM_STATES_KEY``)."""
    param_shapes = {name: tuple(shard_of(param, name).global_shape) for name, param in by_name.items()}
    sharded_zero_dim = {
        name for name, param in by_name.items() if param_shapes[name] == () and getattr(param, "ragged_shard", None) is not None
    }
    if not sharded_zero_dim:
        return {}
    state_shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    record_keys = []
    for flat_key, path in paths.items():
        item = info.metadata.state_dict_metadata[flat_key]
        if len(path) == 4 and path[1] == "state" and isinstance(item, TensorStorageMetadata):
            state_shapes.setdefault(path[2], {})[path[3]] = tuple(item.size)
        elif len(path) == 3 and path[1] == ZERO_DIM_STATES_KEY and path[2] in sharded_zero_dim:
            record_keys.append(flat_key)
    recorded: dict[str, Any] = {}
    if record_keys:
        template: dict[str, Any] = {}
        for flat_key in record_keys:
            set_element(template, paths[flat_key], None)
        info.read_locally(template)  # a few pickled name lists
        recorded = {paths[k][2]: list(get_element(template, paths[k]) or ()) for k in record_keys}
    flat, unknown = zero_dim_flat_keys(param_shapes, state_shapes, recorded)
    require_known_zero_dim_layout({n: keys for n, keys in unknown.items() if n in sharded_zero_dim}, info.path)
    return flat
