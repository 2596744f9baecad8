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
from lightning_ragged.engine.state_dict import sharded_params


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


def expected_model_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor key the module's state dict holds (what a checkpoint must have)."""
    sharded = sharded_params(module)
    shapes = {}
    for key, value in module.state_dict().items():
        if key in sharded:
            shapes[key] = tuple(sharded[key].param.ragged_shard.global_shape)
        elif isinstance(value, torch.Tensor):
            shapes[key] = tuple(value.shape)
    return shapes


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
        if key in state_dict:
            dbuffer.load_full({name: state_dict[key]})
    rest = {k: v for k, v in state_dict.items() if k not in sharded and k in expected}
    if rest or not sharded:
        module.load_state_dict(rest, strict=False)
