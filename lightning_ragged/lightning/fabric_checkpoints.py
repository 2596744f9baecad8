"""``fabric.save(path, state)`` / ``fabric.load(path, state)`` as lightning_ragged checkpoints.

Fabric's state is a dict of the user's own keys: one sharded module, any optimizers, and other
values (``Stateful`` objects or plain data). On disk it is the same checkpoint as the Trainer's
(``checkpoint/format.py``): the module under ``"model"``, optimizer ``i`` under ``"optimizer_i"``
(in the state's order), everything else in ``meta.pt`` with a record of the user's keys, so a
Fabric checkpoint reshards to any world size and loads with the Trainer, ``lightning_ragged.checkpoint.load``
or ``consolidate`` alike; a checkpoint without the record (the Trainer's) maps its optimizers by position.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

from lightning.fabric.strategies.strategy import _apply_filter, _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _Stateful
from torch import nn
from torch.optim import Optimizer

from lightning_ragged.checkpoint.format import FORMAT_KEY, MODEL_KEY, MODEL_STATES_KEY, USER_KEYS
from lightning_ragged.checkpoint.model_state import (
    load_full_model_state_dict,
    load_in_place,
    load_sharded_model_state_dict,
)
from lightning_ragged.checkpoint.optimizer_state import (
    load_full_optimizer_state_dict,
    load_sharded_optimizer_state_dict,
)
from lightning_ragged.checkpoint.reader import check_model_matches, inspect_checkpoint
from lightning_ragged.checkpoint.single_file import read_file, rest_of_file
from lightning_ragged.engine.state_dict_checks import expected_model_shapes
from lightning_ragged.lightning.checkpoint_io import LightningCheckpointIO
from lightning_ragged.lightning.weight_averaging import ShardAveragedModel

_RESERVED = re.compile(rf"(state_dict|{MODEL_KEY}|optimizer_states|optimizer_\d+|{FORMAT_KEY}|{USER_KEYS})")

State = Mapping[str, Any]
Filter = Optional[Mapping[str, Callable[[str, Any], bool]]]


def save(io: LightningCheckpointIO, path: Union[str, os.PathLike], state: State, filter: Filter = None) -> None:
    """Collective: write ``state`` (its sharded module, optimizers and the rest) to ``path`` through ``io``.

    ``filter[key]`` keeps the entries ``(name, value)`` of that key's state dict it returns True
    for, as Fabric's: for the module, names are the parameter and buffer names and values this
    rank's shards. Optimizer states cannot be filtered (their entries are per-parameter states).
    """
    filter = dict(filter or {})
    module_key, module = _sharded_module(state, "save")
    optimizer_keys = [key for key, value in state.items() if isinstance(value, Optimizer)]
    filtered = sorted(set(filter) & set(optimizer_keys))
    if filtered:
        raise NotImplementedError(
            f"fabric.save(..., filter={{{filtered[0]!r}: ...}}): an optimizer's state cannot be filtered with "
            "RaggedFSDPFabricStrategy (its entries are per-parameter shards); filter the module or plain dicts only"
        )
    checkpoint: dict[str, Any] = {}
    averages = _averages(state)
    for key in averages:
        checkpoint[key] = state[key].state_dict()  # DTensors of this rank's shards: written by DCP, under its key
    for key, value in state.items():
        if key == module_key or key in optimizer_keys or key in averages:
            continue
        if _RESERVED.fullmatch(key):
            raise ValueError(
                f"fabric.save(path, state): the key {key!r} is reserved by lightning_ragged's checkpoint format "
                f"(the module and optimizers are stored under 'model' and 'optimizer_<i>'); rename it"
            )
        _apply_filter(key, filter, value.state_dict() if isinstance(value, _Stateful) else value, checkpoint)
    _apply_filter(MODEL_KEY, {MODEL_KEY: filter[module_key]} if module_key in filter else {}, io.state_dict(module),
                  checkpoint)
    for index, key in enumerate(optimizer_keys):
        checkpoint[f"optimizer_{index}"] = io.optimizer_state(module, state[key])
    checkpoint[USER_KEYS] = {"module": module_key, "optimizers": optimizer_keys}
    io.save(checkpoint, path, model_states=averages)


def load(
    io: LightningCheckpointIO,
    path: Union[str, os.PathLike],
    state: Union[nn.Module, Optimizer, dict[str, Any], None],
    strict: bool = True,
    weights_only: Optional[bool] = None,
) -> dict[str, Any]:
    """Restore ``state``'s objects in place from ``path``; return what the checkpoint holds beyond them.

    ``state`` is Fabric's: a dict of the objects to restore, a module alone (``fabric.load_raw``:
    a plain state dict file or our checkpoint's model), or nothing (a single file: its contents).
    """
    io.writer.wait()
    path = Path(path)
    trust = {"trust_checkpoint": io.trust_checkpoint, "verify_checksums": io.verify_checksums}
    if isinstance(state, Optimizer):
        raise ValueError(
            "fabric.load_raw(path, optimizer) is not supported with RaggedFSDPFabricStrategy: an optimizer's state "
            "is keyed by the module's parameter names, so load it with its module: "
            "fabric.load(path, {'model': model, 'optimizer': optimizer})"
        )
    if not state:
        if not path.is_file():
            raise ValueError(
                f"fabric.load({str(path)!r}) needs the state to restore in place ({{'model': model, ...}}): "
                "a sharded checkpoint directory has no whole tensors to return"
            )
        return {k: v for k, v in read_file(path, weights_only, **trust).items() if k not in (FORMAT_KEY, USER_KEYS)}
    if isinstance(state, nn.Module):
        if path.is_file():
            checkpoint = _in_our_layout(read_file(path, weights_only, **trust), MODEL_KEY, [])
            if FORMAT_KEY in checkpoint:  # our own full checkpoint: its model
                checkpoint = checkpoint.get("state_dict", checkpoint.get(MODEL_KEY, {}))
            load_full_model_state_dict(state, checkpoint, strict=strict, source=path)
            return {}
        state = {MODEL_KEY: state}
    module_key, module = _sharded_module(state, "load")
    optimizer_keys = [key for key, value in state.items() if isinstance(value, Optimizer)]
    averages = _averages(state)
    if path.is_file():
        checkpoint = _in_our_layout(read_file(path, weights_only, **trust), module_key, optimizer_keys)
        rest = rest_of_file(checkpoint)
        saved_optimizers = len(checkpoint.get("optimizer_states", []))
    else:
        info = inspect_checkpoint(path, weights_only=weights_only, **trust)
        rest = info.rest()
        saved_optimizers = info.optimizer_count
        for key in set(averages) & set(info.format.get(MODEL_STATES_KEY, [])):  # in place, from any layout
            rest[key] = load_in_place(info, key, state[key].state_dict())
    record = rest.pop(USER_KEYS, None) or {"module": module_key, "optimizers": optimizer_keys[:saved_optimizers]}
    _validate_keys_for_strict_loading(state, {record["module"], *record["optimizers"], *rest}, strict)
    indices = {record["optimizers"].index(key): state[key] for key in optimizer_keys if key in record["optimizers"]}
    if module_key == record["module"]:
        if path.is_file():
            model_state = checkpoint.get("state_dict", checkpoint.get(MODEL_KEY, {}))
            load_full_model_state_dict(module, model_state, strict=strict, source=path)
        else:
            check_model_matches(info, expected_model_shapes(module), strict=strict)
            load_sharded_model_state_dict(module, info, strict=strict)
    # an optimizer's state is keyed by parameter names: it loads under its own key whatever the module's is (as
    # Fabric's DDP loads each key; before, a module renamed with strict=False lost the optimizers silently)
    for index, optimizer in indices.items():
        if path.is_file():
            load_full_optimizer_state_dict(module, optimizer, checkpoint.get("optimizer_states", [])[index])
        else:
            load_sharded_optimizer_state_dict(module, optimizer, info, f"optimizer_{index}")
    if path.is_file():
        rest.update(_unrestored(checkpoint, record, module_key, optimizer_keys))
    for key, value in state.items():
        if key == module_key or key in optimizer_keys or key not in rest:
            continue
        if key in averages and not path.is_file():
            rest.pop(key)  # loaded in place above
        elif isinstance(value, _Stateful):
            value.load_state_dict(rest.pop(key))
        else:
            state[key] = rest.pop(key)
    return rest


def _in_our_layout(checkpoint: dict[str, Any], module_key: str, optimizer_keys: list[str]) -> dict[str, Any]:
    """A file ``fabric.save`` wrote (ours, with the record of its keys; or under another strategy, DDP: tested) holds
    the user's keys: the module's state dict under ``module_key``, each optimizer's torch state dict under its key.
    Put them where the Trainer's files hold them, with the record of the keys, so both load alike."""
    record = checkpoint.get(USER_KEYS)
    if record is not None and "state_dict" not in checkpoint and record["module"] in checkpoint:
        module_key, saved = record["module"], list(record["optimizers"])
    elif FORMAT_KEY in checkpoint or "state_dict" in checkpoint or module_key not in checkpoint:
        return checkpoint
    else:
        saved = [key for key in optimizer_keys if key in checkpoint]
    ours = {key: value for key, value in checkpoint.items() if key != module_key and key not in saved}
    ours.update({"state_dict": checkpoint[module_key], "optimizer_states": [checkpoint[key] for key in saved],
                 USER_KEYS: {"module": module_key, "optimizers": saved}})
    return ours


def _unrestored(checkpoint: dict[str, Any], record: dict[str, Any], module_key: str,
                optimizer_keys: list[str]) -> dict[str, Any]:
    """A single file's module and optimizer states that no object of the state restored, under the keys they were
    saved with: Fabric's DDP and FSDP return them in the remainder (a sharded directory's need their objects)."""
    saved = checkpoint.get("optimizer_states", [])
    unrestored = {key: saved[index] for index, key in enumerate(record["optimizers"][:len(saved)])
                  if key not in optimizer_keys}
    if record["module"] != module_key:
        unrestored[record["module"]] = checkpoint.get("state_dict", checkpoint.get(MODEL_KEY, {}))
    return unrestored


def _averages(state: State) -> list[str]:
    """The keys of ``state`` holding a ``ShardAveragedModel`` (an EMA of the module's shards)."""
    return [key for key, value in state.items() if isinstance(value, ShardAveragedModel)]


def _sharded_module(state: State, verb: str) -> tuple[str, nn.Module]:
    """The one module of ``state`` sharded by ``fully_shard`` (Fabric's FSDP rule: exactly one; averages aside)."""
    modules = [(key, value) for key, value in state.items()
               if isinstance(value, nn.Module) and not isinstance(value, ShardAveragedModel)]
    sharded = [(key, value) for key, value in modules if getattr(value, "_ragged_fsdp_state", None) is not None]
    if len(sharded) != 1 or len(modules) != 1:
        found = ", ".join(f"{key!r} ({'sharded' if (key, value) in sharded else 'not sharded'})"
                          for key, value in modules) or "none"
        raise ValueError(
            f"fabric.{verb}(path, state): the state must hold exactly one module, set up with "
            f"fabric.setup_module / fabric.setup under RaggedFSDPFabricStrategy (found: {found}); pass it like "
            "state={'model': model, 'optimizer': optimizer, ...}"
        )
    return sharded[0]
