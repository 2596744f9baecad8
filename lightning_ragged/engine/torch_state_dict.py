"""torch's state-dict protocol on sharded modules and their optimizers: each shard as a ``StateShard``.

FSDP2's state dicts hold DTensors; ours hold :class:`StateShard` s, the global shape over
this rank's part, viewed, not copied (on a shard group of one rank: the tensor itself).
- ``module.state_dict()`` gives one for each sharded parameter: its master shard, also while
  the module holds full parameters (inside a step, or kept by ``reshard_after_backward=False``).
  So torch's ``get_model_state_dict`` + ``dcp.save`` write every rank's part. Plain 1-D shards
  under one key look like replicated copies to DCP: it keeps one rank's, and the checkpoint
  misses the others' parts. ``dcp.load`` into the state dict loads in place from any layout.
- ``load_state_dict`` takes StateShards of this layout or full tensors (sliced to this rank's
  range, which is how torch's ``set_model_state_dict(..., full_state_dict=True)`` arrives),
  into the shards; a group holding full parameters is resharded first (its next forward
  gathers the loaded values), as FSDP2 does.
- A ``torch.optim`` optimizer gets the same for the states of its sharded parameters
  (``get_optimizer_state_dict`` / ``set_optimizer_state_dict``). Its hooks are added at its
  first ``step()``, the first moment a plain optimizer shows itself (torch's
  ``get_optimizer_state_dict`` steps a fresh optimizer), or when lightning_ragged's loaders
  or the strategy see it; states loaded before are turned into this rank's parts then.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_ragged.engine.dbuffer import DBuffer
from lightning_ragged.engine.param_groups import warn_shape_chosen_groups
from lightning_ragged.engine.runtime import get_state
from lightning_ragged.engine.shard_group import ShardGroup
from lightning_ragged.engine.state_shard import FULL_TENSORS, StateShard, layout_of
from lightning_ragged.engine.torch_full_state_dict import route_full_state_dicts
from lightning_ragged.layout.ragged_shard import RaggedShard

Slot = tuple[str, DBuffer, str]
"""(attribute on the owning module, its DBuffer, its name there)."""

_OPTIMIZER_HOOK: list[Any] = []
"""The handle of the one global optimizer step pre-hook, once any model is sharded."""


def install_state_dict_hooks(groups: Iterable[ShardGroup]) -> None:
    """Hook ``state_dict`` / ``load_state_dict`` of every module owning a parameter of ``groups``, and optimizers."""
    owners: dict[int, tuple[nn.Module, list[Slot]]] = {}
    for group in groups:
        for owner, attr, dbuffer, name in group.slots:
            owners.setdefault(id(owner), (owner, []))[1].append((attr, dbuffer, name))
    for owner, slots in owners.values():
        # Closures, not partials: copy.deepcopy takes functions as they are, so it reaches the
        # module's state and its clear refusal instead of copying DBuffers.
        owner.register_state_dict_post_hook(_bound(_state_shards, tuple(slots)))
        owner.register_load_state_dict_pre_hook(_bound(_local_parts, tuple(slots)))
    if not _OPTIMIZER_HOOK:
        _OPTIMIZER_HOOK.append(register_optimizer_step_pre_hook(_before_step))
    route_full_state_dicts()


def _bound(hook: Callable[..., Any], slots: tuple[Slot, ...]) -> Callable[..., Any]:
    def bound(*args: Any) -> Any:
        return hook(*args, slots=slots)

    return bound


def state_shard(local: torch.Tensor, shard: RaggedShard) -> torch.Tensor:
    """``local`` as a state-dict value: a StateShard, or the whole tensor itself where one rank holds all of it."""
    if shard.world_size == 1:
        return local.view(shard.global_shape)
    return StateShard(local, shard)


def local_part(value: torch.Tensor, shard: RaggedShard, key: str) -> torch.Tensor:
    """This rank's 1-D part of a state-dict value for ``shard``.

    The value may be a StateShard of this layout or a full tensor (sliced to this rank's
    range: a view of it). Anything else is refused, the same way on every rank (layouts are
    compared whole, shapes are global), naming what loads it.
    """
    if isinstance(value, StateShard):
        if value.layout != layout_of(shard):
            raise ValueError(
                f"{key!r} is a StateShard of another layout than this model's: load another layout's shards with "
                "dcp.load into this model's state dict (it reshards), or pass full tensors"
            )
        return value.local
    if tuple(value.shape) == tuple(shard.global_shape):
        return shard.local_part(value)
    raise ValueError(
        f"{key!r} has shape {list(value.shape)}; the parameter is {list(shard.global_shape)}: pass the full tensor, "
        f"or the StateShard of state_dict() (a 1-D local part is not taken: its size alone cannot tell every rank "
        f"that it is this layout's); {FULL_TENSORS}"
    )


def _state_shards(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any, *, slots: tuple[Slot, ...]
) -> None:
    for attr, dbuffer, name in slots:
        key, shard = prefix + attr, dbuffer.sharded_params[name]
        value = state_dict.get(key)
        if value is not None and value is not module._parameters.get(attr):  # keep_vars=True: the parameter itself
            state_dict[key] = state_shard(shard.detach(), shard.ragged_shard)


def _local_parts(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    metadata: dict[str, Any],
    *_args: Any,
    slots: tuple[Slot, ...],
) -> None:
    for attr, dbuffer, name in slots:
        key, shard = prefix + attr, dbuffer.sharded_params[name]
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if metadata.get("assign_to_params_buffers"):
            raise ValueError(
                f"load_state_dict(assign=True) would replace the sharded parameter {key!r} and cut it off its "
                "DBuffer; load with assign=False (the values are copied into the shards)"
            )
        if value is shard or value is module._parameters.get(attr):  # itself (state_dict(keep_vars=True))
            continue
        if module._parameters.get(attr) is not shard:
            _reshard(module, dbuffer, key)
        local = local_part(value, shard.ragged_shard, key)
        same = local.data_ptr() == shard.data_ptr() and local.shape == shard.shape and local.dtype == shard.dtype
        state_dict[key] = shard if same else local  # the shard itself: loading copies nothing


def _reshard(module: nn.Module, dbuffer: DBuffer, key: str) -> None:
    """Point the group holding ``dbuffer``'s full parameters back at its shards, so a load lands in them."""
    state = get_state(module)
    if state.running:
        raise RuntimeError(
            f"load_state_dict of {key!r} inside the model's forward or backward: load between steps"
        )
    next(group for group in state.all_groups if dbuffer in group.dbuffers).reshard()


def hook_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Hook an optimizer's state dicts (once), and make the states it holds so far this rank's parts.

    Every ``step()`` calls it first; lightning_ragged's own loaders and the strategy call it
    too, so an optimizer that holds states before its first step is covered there as well.
    Its parameter groups are checked for the choice-by-shape trap then (``param_groups.py``).
    """
    if "_ragged_state_dict_hooked" in optimizer.__dict__ or hasattr(optimizer, "state_layout"):
        return  # seen, or a lightning_ragged optimizer (its state_dict has its own named layout)
    optimizer.__dict__["_ragged_state_dict_hooked"] = True
    optimizer.register_state_dict_post_hook(_optimizer_state_shards)
    optimizer.register_load_state_dict_pre_hook(_optimizer_local_parts)
    for param, entries in optimizer.state.items():
        shard = getattr(param, "ragged_shard", None)
        if shard is not None:
            optimizer.state[param] = _local_entries(entries, shard, entries)
    warn_shape_chosen_groups(optimizer)  # last: a warning turned into an error leaves the hooks in place


def _before_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    hook_optimizer(optimizer)


def _sharded_states(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> Iterable[tuple[Any, torch.Tensor, dict]]:
    """(key, parameter, entries) of every state of a sharded parameter in ``state_dict``.

    Keys are matched to parameters as ``Optimizer.load_state_dict`` matches them: in the
    order of the saved groups' ``params`` (integers from ``state_dict()``, parameter names
    from torch's ``get_optimizer_state_dict``).
    """
    saved = [key for group in state_dict.get("param_groups", ()) for key in group.get("params", ())]
    by_key = dict(zip(saved, (p for group in optimizer.param_groups for p in group["params"])))
    for key, entries in state_dict.get("state", {}).items():
        param = by_key.get(key)
        if getattr(param, "ragged_shard", None) is not None and isinstance(entries, dict):
            yield key, param, entries


def _optimizer_state_shards(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    state = dict(state_dict["state"])  # the entries are the optimizer's own dicts: replace, never mutate them
    for key, param, entries in _sharded_states(optimizer, state_dict):
        shard = param.ragged_shard
        state[key] = {
            name: state_shard(value, shard) if _per_element(value, shard) else value for name, value in entries.items()
        }
    return {**state_dict, "state": state}


def _optimizer_local_parts(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    state = dict(state_dict.get("state", {}))
    for key, param, entries in _sharded_states(optimizer, state_dict):
        state[key] = _local_entries(entries, param.ragged_shard, optimizer.state.get(param, {}))
    return {**state_dict, "state": state}


def _local_entries(entries: dict[str, Any], shard: RaggedShard, current: dict[str, Any]) -> dict[str, Any]:
    """Per-element states as this rank's parts: StateShards and full tensors (copied out, not kept whole).

    A full state of a 0-D parameter is 0-D like its scalars (AdamW's ``step``): it is
    per-element where the optimizer's ``current`` entry of that name is.
    """
    local = {}
    for name, value in entries.items():
        if isinstance(value, StateShard):
            value = local_part(value, shard, f"state {name!r} of {shard.name!r}")
        elif isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(shard.global_shape) and (
            value.dim() or _per_element(current.get(name), shard)
        ):
            value = shard.local_part(value).clone()
        local[name] = value
    return local


def _per_element(value: Any, shard: RaggedShard) -> bool:
    """A local state with one value per element of the shard (AdamW's moments), not a scalar (its step)."""
    return (
        isinstance(value, torch.Tensor) and not isinstance(value, StateShard)
        and value.dim() == 1 and value.numel() == shard.local_numel
    )
