"""``load_full_state_dict``: full (original-shape) tensors into a sharded module, the inverse of ``full_state_dict``.

Everything the module's state dict holds is loaded, as by torch's ``load_state_dict``: the parameters
into this rank's shards (one DBuffer at a time), the buffers and other entries (BatchNorm's running
statistics, extra states) into the module. Keys and shapes are checked before anything is copied or
sent: a copy into a shard slices the flattened tensor, so a transposed or larger tensor would load
silently. Under ``broadcast_from_rank0`` rank 0's verdict is raised on every rank, so none is left
waiting in a broadcast.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from lightning_ragged.engine import collectives
from lightning_ragged.engine.checks import check_flag
from lightning_ragged.engine.collectives import on_device
from lightning_ragged.engine.dbuffer import DBuffer
from lightning_ragged.engine.runtime import get_state
from lightning_ragged.engine.state_dict import load_full, sharded_params
from lightning_ragged.engine.state_dict_checks import expected_model_shapes, shape_problems

_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024
"""Bytes per coalesced broadcast of the entries outside the DBuffers (DDP's bucket size)."""


def load_full_state_dict(
    module: nn.Module, state_dict: dict[str, Any], *, broadcast_from_rank0: bool = False, strict: bool = True
) -> _IncompatibleKeys:
    """Load full tensors (keys as in ``full_state_dict`` of the same module) into the shards and the module.

    ``strict`` (torch's): every key of the module's state dict present, no other; shapes must match either
    way (a ``RuntimeError`` naming the keys, before anything is loaded). Returns the missing and unexpected
    keys, as ``load_state_dict``. ``broadcast_from_rank0`` (torch's ``StateDictOptions`` name; collective):
    only global rank 0's ``state_dict`` is read, the other ranks may pass ``{}``; rank 0 packs one DBuffer's
    tensors at a time into a flat buffer on the DBuffer's device and broadcasts it, so no rank holds more
    than one DBuffer's full size beyond rank 0's own dict, then the other entries.
    """
    check_flag("broadcast_from_rank0", broadcast_from_rank0)
    check_flag("strict", strict)
    dbuffers = list(get_state(module).dbuffers())  # a module fully_shard never touched is an error here
    expected, sharded, current = expected_model_shapes(module), sharded_params(module), module.state_dict()
    others = [key for key in current if key not in sharded]
    verdict: list[Any] = [None]
    if not broadcast_from_rank0 or dist.get_rank() == 0:
        given = {key: tuple(value.shape) for key, value in state_dict.items() if isinstance(value, torch.Tensor)}
        missing = [key for key in [*sharded, *others] if key not in state_dict]
        unexpected = [key for key in state_dict if key not in sharded and key not in current]
        extras = {key: state_dict[key] for key in others if key in state_dict and key not in expected}
        verdict = [(shape_problems(given, expected, strict, "the state_dict"), missing, unexpected, extras)]
    device = dbuffers[0].device if dbuffers else torch.device("cpu")
    if broadcast_from_rank0:
        with on_device(device):
            dist.broadcast_object_list(verdict, src=0)
    problems, missing, unexpected, extras = verdict[0]
    absent = set(missing)
    if problems:
        whose = "rank 0's state_dict (broadcast_from_rank0=True)" if broadcast_from_rank0 else "the state_dict"
        raise RuntimeError(f"load_full_state_dict: {whose} does not fit the module: " + "; ".join(problems))
    per_dbuffer: dict[int, dict[str, str]] = {}
    for key, (dbuffer, name) in sharded.items():
        if key not in absent:
            per_dbuffer.setdefault(id(dbuffer), {})[name] = key
    for dbuffer in dbuffers:
        if id(dbuffer) in per_dbuffer:
            keys = per_dbuffer[id(dbuffer)]
            if broadcast_from_rank0:
                load_full(dbuffer, _broadcast_flat(dbuffer, state_dict, keys))
            else:
                load_full(dbuffer, {name: state_dict[key] for name, key in keys.items()})
    rest = [key for key in others if key not in absent]
    if rest:
        on_meta = any(isinstance(current[key], torch.Tensor) and current[key].is_meta for key in rest)
        values = _broadcast_rest(current, state_dict, rest, extras, device) if broadcast_from_rank0 else \
            {key: state_dict[key] for key in rest}
        if on_meta:  # a model built on meta, sharded without to_empty: its buffers get these tensors, on device
            values = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        module.load_state_dict(values, strict=False, assign=on_meta)
    return _IncompatibleKeys(missing, unexpected)


def _broadcast_flat(dbuffer: DBuffer, state_dict: dict[str, torch.Tensor], tensor_keys: dict[str, str]) -> dict[str, torch.Tensor]:
    """Rank 0's full tensors of one DBuffer, packed at their layout offsets and broadcast: name -> full view."""
    flat = torch.empty(dbuffer.full_numel, dtype=dbuffer.master_dtype, device=dbuffer.device)
    views = {}
    for name, key in tensor_keys.items():
        views[name] = dbuffer.full_view(flat, name)
        if dist.get_rank() == 0:
            views[name].copy_(state_dict[key])
    dist.broadcast(collectives.wire(flat), src=0)
    return views


def _broadcast_rest(
    current: dict[str, Any], state_dict: dict[str, Any], keys: list[str], extras: dict[str, Any], device: torch.device
) -> dict[str, Any]:
    """Rank 0's entries outside the DBuffers (buffers, extra states): tensors in the module's own dtypes and
    devices (the shards' for one still on meta), coalesced into few broadcasts; the rest came with the verdict."""
    received = dict(extras)
    tensors = []
    for key in keys:
        if key in extras:
            continue
        mine = current[key]
        received[key] = buffer = torch.empty(mine.shape, dtype=mine.dtype, device=device if mine.is_meta else mine.device)
        if dist.get_rank() == 0:
            buffer.copy_(state_dict[key])
        tensors.append(collectives.wire(buffer))
    if tensors:
        dist._broadcast_coalesced(dist.group.WORLD, tensors, _BROADCAST_BUCKET_BYTES, 0)
    return received
