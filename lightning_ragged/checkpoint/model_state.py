"""A model's state dict for a checkpoint: sharded parameters as DTensors of their boxes, and back.

Saving reads the shards where they are (views into the DBuffer: no gather, no copy);
loading writes into them in place, from a checkpoint directory of any layout (DCP
reshards) or from full tensors (sliced to this rank's range). A plain module works too
(its ``state_dict()``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_ragged.checkpoint.dcp import shard_as_dtensor
from lightning_ragged.checkpoint.reader import CheckpointInfo, check_model_matches, check_shapes, inspect_checkpoint
from lightning_ragged.engine.state_dict import load_full, sharded_params
from lightning_ragged.engine.state_dict_checks import expected_model_shapes
from lightning_ragged.engine.state_shard import StateShard
from lightning_ragged.engine.torch_state_dict import local_part, state_shard


def sharded_model_state_dict(module: nn.Module) -> dict[str, Any]:
    """Every state-dict key of ``module``; sharded parameters as DTensors of this rank's boxes.

    The boxes are views into the DBuffer (no gather, no copy). A parameter of which this
    rank holds nothing is left out on this rank. Buffers and unsharded tensors stay as
    they are (replicated: DCP writes them once). Works on a plain module too (then it is
    ``module.state_dict()``).
    """
    sharded = sharded_params(module)
    result: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=False).items():
        if key not in sharded:
            result[key] = value
            continue
        param = sharded[key].param
        wrapped = shard_as_dtensor(param.detach(), param.ragged_shard)
        if wrapped is not None:
            result[key] = wrapped
    return result


def load_sharded_model_state_dict(module: nn.Module, info: CheckpointInfo | str | os.PathLike, strict: bool = True) -> None:
    """Load the checkpoint's model in place into ``module`` (sharded: its DBuffer views; plain: its tensors).

    Validates keys and shapes first. Any saved layout (world size, granularity, planner,
    HSDP degree) loads into the current one.
    """
    if not isinstance(info, CheckpointInfo):
        info = inspect_checkpoint(info)
    check_model_matches(info, expected_model_shapes(module), strict=strict)
    template = sharded_model_state_dict(module)
    saved = set(info.model_shapes())
    template = {key: value for key, value in template.items() if key in saved}
    with info.reading():
        dcp.load({info.model_key: template}, storage_reader=info.reader(), planner=info.planner(allow_partial_load=not strict))
    # Tensors were loaded in place; non-tensor extra state comes back as new objects.
    rest = {key: value for key, value in template.items() if not isinstance(value, torch.Tensor)}
    if rest:
        module.load_state_dict(rest, strict=False)


def load_full_model_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True, source: Any = "the state dict"
) -> None:
    """Check keys and shapes, then copy this rank's pieces of full tensors into the shards (or the plain module)."""
    expected = expected_model_shapes(module)
    saved = {k: tuple(v.shape) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    check_shapes(saved, expected, strict, source)
    sharded = sharded_params(module)
    for key, (dbuffer, name) in sharded.items():
        value = state_dict.get(key)
        if isinstance(value, StateShard):  # of this layout (e.g. the module's own state_dict()): its local part
            shard = dbuffer.sharded_params[name]
            local = local_part(value, shard.ragged_shard, key)
            if local.data_ptr() != shard.data_ptr():
                with torch.no_grad():
                    shard.copy_(local)
        elif value is not None:
            load_full(dbuffer, {name: value})
    rest = {k: v for k, v in state_dict.items() if k not in sharded and k in expected}
    if rest or not sharded:
        module.load_state_dict(rest, strict=False)


def load_model_state_copy(module: nn.Module, info: CheckpointInfo, key: str, strict: bool = True) -> dict[str, Any]:
    """The checkpoint's model state under ``key`` (e.g. ``"current_model_state"``) in fresh tensors of
    ``module``'s current layout, as its ``state_dict()`` holds them (StateShards); the module is untouched.

    Any saved layout loads (DCP reshards). Keys and shapes are checked against the module first.
    """
    saved = info.model_shapes(key)
    check_shapes(saved, expected_model_shapes(module), strict, f"{info.path} [{key}]")
    sharded = sharded_params(module)
    template: dict[str, Any] = {}
    result: dict[str, Any] = {}
    for name, value in module.state_dict().items():
        if isinstance(value, torch.Tensor) and name not in saved:  # strict=False: what the checkpoint lacks
            continue
        if name in sharded:
            shard = sharded[name].param
            copy = torch.empty_like(shard.detach())
            wrapped = shard_as_dtensor(copy, shard.ragged_shard)
            if wrapped is not None:
                template[name] = wrapped
            result[name] = state_shard(copy, shard.ragged_shard)
        else:
            template[name] = result[name] = value.clone() if isinstance(value, torch.Tensor) else value
    template = load_in_place(info, key, template)
    for name, value in template.items():  # non-tensor extra state comes back as new objects
        if not isinstance(value, torch.Tensor):
            result[name] = value
    return result


def load_in_place(info: CheckpointInfo, key: str, template: dict[str, Any]) -> dict[str, Any]:
    """DCP-load the checkpoint's entry ``key`` into ``template``'s tensors in place (DTensors of any layout
    reshard); returns the template with its non-tensor entries replaced by the loaded objects."""
    with info.reading():
        dcp.load({key: template}, storage_reader=info.reader(), planner=info.planner())
    return template
