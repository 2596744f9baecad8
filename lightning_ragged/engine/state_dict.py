"""State dicts of a sharded model: where each key's shard lives, and full (original-shape) tensors in and out.

:func:`sharded_params` is the one map from a state-dict key to its sharded parameter
(the engine's own full state dicts and the checkpoint's sharded ones both read it);
slicing a full tensor to this rank's range is ``RaggedShard.local_part``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from lightning_ragged.engine.api import get_state
from lightning_ragged.engine.dbuffer import DBuffer


class ShardedParam(NamedTuple):
    """Where one state-dict key's shard lives: its DBuffer and its name there."""

    dbuffer: DBuffer
    name: str

    @property
    def param(self) -> nn.Parameter:
        """The sharded (1-D, ``.ragged_shard``) parameter."""
        return self.dbuffer.sharded_params[self.name]


def sharded_params(module: nn.Module) -> dict[str, ShardedParam]:
    """State-dict key (relative to ``module``) -> its shard, tied keys included; ``{}`` for a plain module.

    Built from the engine's (module, attribute) slots, so it holds whether the modules
    currently point at their shards (at rest) or at their full parameters (inside a step).
    ``module`` is the sharded model or any submodule of it.
    """
    if module.__dict__.get("_ragged_fsdp_state") is None:
        return {}
    prefixes: dict[int, list[str]] = {}
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(submodule), []).append(prefix)
    result = {}
    for group in get_state(module).all_groups:
        for owner, attr, dbuffer, name in group.slots:
            for prefix in prefixes.get(id(owner), []):
                result[f"{prefix}.{attr}" if prefix else attr] = ShardedParam(dbuffer, name)
    return result


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full, original-shape tensors for every state-dict key of ``module`` (the sharded model or any
    submodule of it, keys relative to it), on every rank. Collective: every rank calls it."""
    keys = sharded_params(module)
    needed = {id(entry.dbuffer) for entry in keys.values()}
    gathered = {id(b): b.gather_full() for b in get_state(module).dbuffers() if id(b) in needed}
    result = {}
    for key, value in module.state_dict().items():
        if key in keys:
            value = gathered[id(keys[key].dbuffer)][keys[key].name]
        result[key] = value
    return result


def load_full_state_dict(module: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy this rank's pieces of full tensors (keys as in ``full_state_dict`` of the same module) into the shards."""
    get_state(module)  # a module fully_shard never touched is an error here, as in full_state_dict
    per_dbuffer: dict[int, tuple[DBuffer, dict[str, torch.Tensor]]] = {}
    for key, (dbuffer, name) in sharded_params(module).items():
        per_dbuffer.setdefault(id(dbuffer), (dbuffer, {}))[1][name] = state_dict[key]
    for dbuffer, tensors in per_dbuffer.values():
        dbuffer.load_full(tensors)
