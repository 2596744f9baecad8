"""State dicts of a sharded model: where each key's shard lives, and full (original-shape) tensors in and out.

:func:`sharded_params` is the one map from a state-dict key to its sharded parameter
(the engine's own full state dicts and the checkpoint's sharded ones both read it);
slicing a full tensor to this rank's range is ``RaggedShard.local_part``. Full state dicts
move one DBuffer at a time (gathered, copied out, freed), optionally to CPU and to rank 0
only (loading them back: ``full_loads.py``).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

from lightning_ragged.engine import collectives, storage
from lightning_ragged.engine.checks import check_flag
from lightning_ragged.engine.runtime import get_state
from lightning_ragged.engine.dbuffer import DBuffer


class ShardedParam(NamedTuple):
    """Where one state-dict key's shard lives: its DBuffer and its name there."""

    dbuffer: DBuffer
    name: str

    @property
    def param(self) -> nn.Parameter:
        """The sharded (1-D, ``.ragged_shard``) parameter."""
        return self.dbuffer.sharded_params[self.name]


def load_full(dbuffer: DBuffer, tensors: dict[str, torch.Tensor]) -> None:
    """Copy this rank's pieces of full tensors (some or all of ``dbuffer``'s) into its sharded segment."""
    with torch.no_grad():
        for name, tensor in tensors.items():
            param = dbuffer.sharded_params[name]
            param.copy_(param.ragged_shard.local_part(tensor))


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
        # torch's checkpoint_wrapper drops its attribute from state-dict keys (and adds it back on load)
        prefixes.setdefault(id(submodule), []).append(f"{prefix}.".replace(_CHECKPOINT_PREFIX, "")[:-1])
    result = {}
    for group in get_state(module).all_groups:
        for owner, attr, dbuffer, name in group.slots:
            for prefix in prefixes.get(id(owner), []):
                result[f"{prefix}.{attr}" if prefix else attr] = ShardedParam(dbuffer, name)
    return result


def full_state_dict(module: nn.Module, *, cpu_offload: bool = False, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Full, original-shape tensors for every state-dict key of ``module`` (the sharded model or any
    submodule of it, keys relative to it). Collective: every rank calls it.

    One DBuffer at a time: each is gathered, its tensors copied out and its gathered buffer
    freed before the next, so the gathering itself never holds more than one DBuffer's full
    size. ``cpu_offload``: the copies (and the buffers) go to CPU, so the device holds at
    most one gathered DBuffer. ``rank0_only``: only global rank 0 gets the state dict (a
    gather to it, not an all-gather, where the backend has one); every other rank returns
    ``{}``. The names are those of torch's ``FullStateDictConfig(offload_to_cpu, rank0_only)``
    and ``StateDictOptions(cpu_offload=...)``.
    """
    check_flag("cpu_offload", cpu_offload)
    check_flag("rank0_only", rank0_only)
    keys = sharded_params(module)
    names: dict[int, dict[str, None]] = {}
    for entry in keys.values():
        names.setdefault(id(entry.dbuffer), {})[entry.name] = None  # tied keys: one copy
    device = torch.device("cpu") if cpu_offload else None
    gathered = {
        id(b): _gather_full(b, names[id(b)], device, rank0_only) for b in get_state(module).dbuffers() if id(b) in names
    }
    if rank0_only and dist.get_rank() != 0:
        return {}
    result = {}
    for key, value in module.state_dict().items():
        if key in keys:
            value = gathered[id(keys[key].dbuffer)][keys[key].name]
        elif cpu_offload and isinstance(value, torch.Tensor):  # an extra state (get_extra_state) stays as it is
            value = value.to("cpu")
        result[key] = value
    return result


def _gather_full(
    dbuffer: DBuffer, names: Iterable[str], device: torch.device | None, rank0_only: bool
) -> dict[str, torch.Tensor]:
    """Full, original-shape copies of one DBuffer's ``names`` in master dtype, on ``device`` (default the DBuffer's).

    One gathered buffer (m·S elements on the DBuffer's device) lives during the call and is
    freed before it returns. ``rank0_only``: only global rank 0 receives (a gather where the
    backend has one, else an all-gather the others drop) and every other rank returns ``{}``;
    a shard process group without global rank 0 (another HSDP replica) does not communicate.
    """
    group = dbuffer.process_group
    if rank0_only and 0 not in dist.get_process_group_ranks(group or dist.group.WORLD):
        return {}
    receives = not rank0_only or dist.get_rank() == 0
    gather = rank0_only and _has_gather(group)
    full = None
    if receives or not gather:
        full = torch.empty(dbuffer.full_numel, dtype=dbuffer.master_dtype, device=dbuffer.device)
    if gather:
        parts = [collectives.wire(part) for part in full.chunk(dbuffer.world_size)] if receives else None
        dist.gather(collectives.wire(dbuffer.sharded), parts, dst=0, group=group)
    else:
        collectives.all_gather(full, dbuffer.sharded, group, mode=dbuffer.gather_mode)
    out = {}
    if receives:
        for name in names:
            view = dbuffer.full_view(full, name)
            out[name] = view.to(dbuffer.device if device is None else device, copy=True)
    if full is not None:
        storage.free(full)  # now, not when the backend's work object lets go of it
    return out


_GATHER_BACKENDS = ("gloo", "nccl", "mpi", "ucc")


def _has_gather(group: dist.ProcessGroup | None) -> bool:
    """The group's backend (every backend of "cpu:gloo,cuda:nccl") has ``dist.gather``."""
    return all(part.split(":")[-1] in _GATHER_BACKENDS for part in dist.get_backend(group).split(","))
