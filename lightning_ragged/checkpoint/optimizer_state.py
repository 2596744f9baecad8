"""An optimizer's state for a checkpoint: keyed by parameter names, per-parameter states as DTensors, and back.

``torch.optim`` optimizers (states that are scalars or shaped like the parameter: AdamW,
Adam, SGD, ...) and :class:`NamedStateOptimizer` ones (``lightning_ragged.optim``: their
declared layouts) are both saved as ``{"state": {name: {key: ...}}, "param_groups":
[{..., "params": [names]}], "format": "torch" | "ragged"}``, and loaded at the current
layout from a directory of any layout or from a full (consolidated) state.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Protocol, runtime_checkable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_ragged.checkpoint.dcp import boxes_as_dtensor, shard_as_dtensor
from lightning_ragged.checkpoint.errors import CheckpointError, CheckpointMismatchError
from lightning_ragged.checkpoint.reader import CheckpointInfo, inspect_checkpoint
from lightning_ragged.engine.state_dict_checks import short_list
from lightning_ragged.checkpoint.zero_dim import (
    ZERO_DIM_STATES_KEY,
    require_known_zero_dim_layout,
    zero_dim_flat_keys,
    zero_dim_flat_keys_in_directory,
)
from lightning_ragged.engine.torch_state_dict import hook_optimizer
from lightning_ragged.layout.ragged_shard import RaggedShard, shard_of


@runtime_checkable
class NamedStateOptimizer(Protocol):
    """An optimizer whose state is keyed by parameter name and that declares the layout of each entry.

    ``lightning_ragged.optim.RaggedOptimizer`` is one. Checkpoint code tells it apart from a
    ``torch.optim`` optimizer structurally (``isinstance`` against this protocol), so it
    never imports an optimizer package. What it relies on:

    * ``param_name(param)``: the name the parameter's state is saved under;
    * ``state_layout(param)``: for state entries, their layout: "flat" (one value per local
      element), "blocks:B" (one value per block of B elements counted from the parameter's
      start), "tiles" (a dict keyed by global tile coordinates) or "scalar"; an entry it
      leaves out is judged by its shape;
    * ``load_state_dict(state)``: accepts ``{"state": {name: {key: value}}, "param_groups":
      [{..., "params": [names]}], "ragged": {...}}`` holding this rank's own entries or full
      (consolidated) ones, which it slices to this rank itself.
    """

    param_groups: list[dict[str, Any]]

    def param_name(self, param: torch.Tensor) -> str: ...

    def state_layout(self, param: torch.Tensor) -> dict[str, str]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _optimizer_param_names(module: nn.Module | None, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """id(param) -> the name its state is saved under (the module's parameter name)."""
    if isinstance(optimizer, NamedStateOptimizer):
        return {id(p): optimizer.param_name(p) for group in optimizer.param_groups for p in group["params"]}
    names: dict[int, str] = {}
    if module is not None:
        for name, param in module.named_parameters():
            names.setdefault(id(param), name)
    result = {}
    for group in optimizer.param_groups:
        group_names = group.get("param_names")
        for index, param in enumerate(group["params"]):
            if id(param) in names:
                result[id(param)] = names[id(param)]
            elif group_names:
                result[id(param)] = group_names[index]
            elif getattr(param, "ragged_shard", None) is not None:
                result[id(param)] = param.ragged_shard.name
            else:
                raise CheckpointMismatchError(
                    "an optimizer parameter is not a parameter of the module and has no name; "
                    "pass the module whose parameters the optimizer updates"
                )
    return result


def _state_layout(optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str, value: Any, shard: RaggedShard) -> str:
    """How one state entry relates to the parameter: flat | blocks:B | tiles | scalar."""
    if isinstance(optimizer, NamedStateOptimizer):
        layout = optimizer.state_layout(param).get(key)
        if layout is not None:
            return layout
    if isinstance(value, Mapping):
        return "tiles"
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return "scalar"
    if getattr(param, "ragged_shard", None) is not None and value.numel() == shard.local_numel and value.dim() == 1:
        return "flat"
    if getattr(param, "ragged_shard", None) is None and tuple(value.shape) == tuple(param.shape):
        return "flat"
    raise CheckpointError(
        f"cannot checkpoint optimizer state {key!r} of parameter {shard.name!r}: shape {tuple(value.shape)} is neither "
        f"a scalar nor shaped like the local shard ({shard.local_numel} elements); a RaggedOptimizer must declare "
        "its layout in state_layout()"
    )


def _block_range(shard: RaggedShard, block: int) -> tuple[int, int, int]:
    return (*shard.local_blocks(block), math.ceil(shard.numel / block))


def _shard_state_entry(value: Any, layout: str, shard: RaggedShard, sharded: bool) -> Any:
    if layout == "flat" and isinstance(value, torch.Tensor):
        if not sharded:
            return value
        return shard_as_dtensor(value, shard)
    if layout.startswith("blocks:") and isinstance(value, torch.Tensor):
        if not sharded:
            return value
        first, last, total = _block_range(shard, int(layout.split(":", 1)[1]))
        if last - first != value.shape[0]:
            raise CheckpointError(f"block state of {shard.name!r} has {value.shape[0]} blocks, expected {last - first}")
        if first == last:
            return None
        rest = tuple(value.shape[1:])
        boxes = [((first, *[0] * len(rest)), (last - first, *rest))]
        return boxes_as_dtensor(value.reshape(-1), boxes, (total, *rest), shard.process_group)
    return value  # scalars (replicated) and tiles (dicts keyed by global tile coordinates)


def sharded_optimizer_state_dict(module: nn.Module | None, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's state keyed by parameter names, per-parameter states as DTensors of the shard's boxes.

    ``{"state": {name: {key: DTensor | tensor}}, "param_groups": [{..., "params": [names]}],
    "format": "torch" | "ragged"}``. Works for ``torch.optim`` optimizers whose states are
    scalars or shaped like the parameter (AdamW, Adam, SGD, ...) and for
    ``lightning_ragged.optim`` optimizers (their declared "flat", "blocks:B", "tiles" and
    "scalar" layouts). Nothing is copied: the DTensors view the optimizer's own tensors.
    """
    names = _optimizer_param_names(module, optimizer)
    ragged = isinstance(optimizer, NamedStateOptimizer)
    groups = []
    for group in optimizer.param_groups:
        saved = {key: value for key, value in group.items() if key not in ("params", "param_names")}
        saved["params"] = [names[id(p)] for p in group["params"]]
        groups.append(saved)
    state: dict[str, Any] = {}
    zero_dim: dict[str, list[str]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            entries = optimizer.state.get(param)
            if not entries:
                continue
            name = names[id(param)]
            shard = shard_of(param, name)
            sharded = getattr(param, "ragged_shard", None) is not None
            converted = {}
            for key, value in entries.items():
                layout = _state_layout(optimizer, param, key, value, shard)
                entry = _shard_state_entry(value, layout, shard, sharded)
                if entry is not None:
                    converted[key] = entry
                if sharded and not ragged and len(shard.global_shape) == 0 and layout == "flat":
                    zero_dim.setdefault(name, []).append(key)
            state[name] = converted
    result = {"state": state, "param_groups": groups, "format": "ragged" if ragged else "torch"}
    if zero_dim:
        result[ZERO_DIM_STATES_KEY] = zero_dim
    return result


_NOT_HYPERPARAMETERS = frozenset({"params", "param_names"})


def _require_same_kind(saved_groups: list[dict[str, Any]], optimizer: torch.optim.Optimizer, where: str) -> None:
    """Refuse another kind of optimizer's state (AdamW's into SGD: torch's bare ``KeyError: 'momentum'`` at the
    first step). Keys only one side lacks are a torch version's or an LR scheduler's (``initial_lr``): allowed."""
    saved = {key for group in saved_groups for key in group} - _NOT_HYPERPARAMETERS
    current = {key for group in optimizer.param_groups for key in group} - _NOT_HYPERPARAMETERS
    if saved - current and current - saved:
        raise CheckpointMismatchError(
            f"{where} was saved by another kind of optimizer than {type(optimizer).__name__}: its param groups hold "
            f"{sorted(saved - current)} where this optimizer's hold {sorted(current - saved)}; resume with the "
            "optimizer the checkpoint was saved with"
        )


def load_full_optimizer_state_dict(module: nn.Module | None, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load a full (consolidated) optimizer state, slicing per-parameter states to this rank's shard."""
    hook_optimizer(optimizer)  # its torch state dicts hold StateShards from now on, before any step too
    _require_same_kind(list(state.get("param_groups", [])), optimizer, "the optimizer state")
    if isinstance(optimizer, NamedStateOptimizer):
        optimizer.load_state_dict(dict(state) if "ragged" in state else {**state, "ragged": {}})
        return
    names = _optimizer_param_names(module, optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    named = state.get("format") == "torch" or any(isinstance(k, str) for k in state.get("state", {}))
    if named:  # our named layout (e.g. read back from a directory by other tools)
        index = {name: i for i, name in enumerate(n for g in state["param_groups"] for n in g["params"])}
        state = {
            "state": {index[name]: entries for name, entries in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
            **({ZERO_DIM_STATES_KEY: {index[n]: keys for n, keys in state[ZERO_DIM_STATES_KEY].items()}}
               if ZERO_DIM_STATES_KEY in state else {}),
        }
    saved_count = sum(len(g["params"]) for g in state["param_groups"])
    if saved_count != len(params):
        raise CheckpointMismatchError(f"optimizer state covers {saved_count} parameters, the optimizer has {len(params)}")
    shards = {idx: shard_of(params[idx], names.get(id(params[idx]), str(idx))) for idx in state["state"]}
    sharded = {idx for idx in shards if getattr(params[idx], "ragged_shard", None) is not None}
    zero_dim_flat: dict[Any, set[str]] = {}
    if any(len(shards[idx].global_shape) == 0 for idx in sharded):
        zero_dim_flat, unknown = zero_dim_flat_keys(
            {idx: tuple(shard.global_shape) for idx, shard in shards.items()},
            {idx: {k: tuple(v.shape) for k, v in entries.items() if isinstance(v, torch.Tensor)} for idx, entries in state["state"].items()},
            state.get(ZERO_DIM_STATES_KEY),
        )
        require_known_zero_dim_layout(
            {names.get(id(params[idx]), idx): keys for idx, keys in unknown.items() if idx in sharded}, "the optimizer state"
        )
    local_state = {}
    for idx, entries in state["state"].items():
        shard = shards[idx]
        local_entries = {}
        for key, value in entries.items():
            if (
                idx in sharded
                and isinstance(value, torch.Tensor)
                and tuple(value.shape) == tuple(shard.global_shape)
                and (value.dim() or key in zero_dim_flat.get(idx, ()))
            ):
                value = shard.local_part(value)
            local_entries[key] = value.clone() if isinstance(value, torch.Tensor) else value
        local_state[idx] = local_entries
    optimizer.load_state_dict({"state": local_state, "param_groups": state["param_groups"]})


def load_sharded_optimizer_state_dict(
    module: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    info: CheckpointInfo | str | os.PathLike,
    key: str = "optimizer_0",
) -> None:
    """Load ``key`` of the checkpoint into ``optimizer`` at the current layout (any saved layout)."""
    hook_optimizer(optimizer)  # its torch state dicts hold StateShards from now on, before any step too
    if not isinstance(info, CheckpointInfo):
        info = inspect_checkpoint(info)
    paths = info.paths(key)
    if not paths:
        raise CheckpointMismatchError(f"{info.path} holds no optimizer state {key!r} (it has {info.optimizer_count})")
    names = _optimizer_param_names(module, optimizer)
    by_name = {names[id(p)]: p for group in optimizer.param_groups for p in group["params"]}
    ragged = isinstance(optimizer, NamedStateOptimizer)
    zero_dim_flat = {} if ragged else zero_dim_flat_keys_in_directory(info, paths, by_name)
    template: dict[str, Any] = {}
    local: dict[tuple[str, str], torch.Tensor] = {}  # (name, entry) -> this rank's tensor of a sharded entry
    unknown = set()
    for flat_key, path in paths.items():
        item = info.metadata.state_dict_metadata[flat_key]
        if len(path) >= 4 and path[1] == "state" and path[2] not in by_name:
            unknown.add(path[2])
            continue
        if len(path) >= 2 and path[1] == ZERO_DIM_STATES_KEY:
            continue  # read above; the optimizer's own state_dict has no such entry
        if not isinstance(item, TensorStorageMetadata):
            set_element(template, path, None)  # param_groups, format, non-tensor state: DCP fills them in
            continue
        if len(path) < 4 or path[1] != "state":
            set_element(template, path, torch.empty(tuple(item.size), dtype=item.properties.dtype))
            continue
        name, entry = path[2], path[3]
        param = by_name[name]
        shard = shard_of(param, name)
        sharded = getattr(param, "ragged_shard", None) is not None
        dtype, size = item.properties.dtype, tuple(item.size)
        layout = optimizer.state_layout(param).get(entry) if ragged else None
        if len(path) > 4 or layout is None or layout == "tiles":
            shaped_like_param = size == tuple(shard.global_shape) and (size or entry in zero_dim_flat.get(name, ()))
            layout = "tiles" if len(path) > 4 else ("flat" if shaped_like_param else "scalar")
        if layout == "flat" and sharded:
            if size != tuple(shard.global_shape):
                raise CheckpointMismatchError(
                    f"optimizer state {entry!r} of {name!r} has shape {list(size)} in {info.path}, the parameter "
                    f"{list(shard.global_shape)}"
                )
            tensor = torch.empty(shard.local_numel, dtype=dtype, device=param.device)
            local[(name, entry)] = tensor
            wrapped = shard_as_dtensor(tensor, shard)
        elif layout.startswith("blocks:") and sharded:
            first, last, total = _block_range(shard, int(layout.split(":", 1)[1]))
            rest = size[1:]
            tensor = torch.empty((last - first, *rest), dtype=dtype, device=param.device)
            local[(name, entry)] = tensor
            boxes = [((first, *[0] * len(rest)), (last - first, *rest))] if last > first else []
            wrapped = boxes_as_dtensor(tensor.reshape(-1), boxes, (total, *rest), shard.process_group)
        else:  # scalars, tiles, and every state of an unsharded parameter: the whole saved tensor
            wrapped = torch.empty(size, dtype=dtype, device=param.device)
        if wrapped is not None:
            set_element(template, path, wrapped)
    if unknown:
        raise CheckpointMismatchError(
            f"{info.path} {key!r} holds optimizer state for parameters the optimizer does not have: {short_list(sorted(unknown))}"
        )
    with info.reading():
        dcp.load(template, storage_reader=info.reader(), planner=info.planner())
    saved = template.get(key, {})
    local_state: dict[str, dict[str, Any]] = saved.get("state", {})
    for (name, entry), tensor in local.items():
        local_state.setdefault(name, {})[entry] = tensor
    # The checkpoint's entry order on every rank: a rank holding none of a parameter has no sharded
    # entries to add last, and code that walks the state in its order (torch's full state dict) then
    # issues the same collectives everywhere.
    order = {path[2:4]: index for index, path in enumerate(paths.values()) if len(path) >= 4 and path[1] == "state"}
    for name, entries in local_state.items():
        local_state[name] = dict(sorted(entries.items(), key=lambda item: order.get((name, item[0]), len(order))))
    groups = saved.get("param_groups", [])
    current = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    saved_names = [list(group.get("params", [])) for group in groups]
    if saved_names != current:
        raise CheckpointMismatchError(
            f"{info.path} {key!r} was saved for other parameter groups: saved {saved_names}, optimizer has {current}"
        )
    _require_same_kind(groups, optimizer, f"{info.path} {key!r}")
    if ragged:
        state = {
            "state": local_state,
            "param_groups": groups,
            "ragged": {},
        }
        optimizer.load_state_dict(state)
        return
    index = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            index[names[id(param)]] = len(index)
    torch_state = {}
    for name, entries in local_state.items():
        param = by_name[name]
        torch_state[index[name]] = {
            entry: (value.view(param.shape) if value.dim() and value.numel() == param.numel() and value.dim() != param.dim() else value)
            for entry, value in entries.items()
        }
    torch_groups = []
    for group, saved_group in zip(optimizer.param_groups, groups):
        restored = {k: v for k, v in saved_group.items() if k != "params"}
        restored["params"] = [index[names[id(p)]] for p in group["params"]]
        if "param_names" in group:
            restored["param_names"] = group["param_names"]
        torch_groups.append(restored)
    optimizer.load_state_dict({"state": torch_state, "param_groups": torch_groups})
