"""Materialize a model that ``fully_shard`` sharded while its parameters were on the meta device.

``fully_shard(model, device=...)`` on a meta model allocates the shards but leaves them
uninitialized. ``materialize_meta_module`` fills them group by group:

1. allocate one full, master-dtype buffer for a group (its planned layout, so every
   parameter is a view at its planned offset),
2. point the modules' parameter slots at those full views,
3. call ``reset_parameters()`` of the modules in **module order** under a seed shared by
   all ranks (so each rank computes the same full tensors),
4. copy this rank's segment into ``bucket.sharded`` and free the buffer.

A group's buffer is released right after the last module that touches it, so peak
memory is the shards plus the groups being initialized (one block group, and the root
group when its modules surround the blocks, e.g. embedding before and head after).
Calling ``reset_parameters`` in module order reproduces an eager construction with the
same seed for models whose parameters all come from modules that initialize themselves
in ``reset_parameters`` (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``...).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from lightning_ragged.fsdp import get_state
from lightning_ragged.shard_group import ShardGroup


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def shared_seed(default: int | None = None) -> int:
    """A seed every rank agrees on: ``default``, else ``PL_GLOBAL_SEED``, else rank 0's initial seed."""
    import os

    if default is None and os.environ.get("PL_GLOBAL_SEED") is not None:
        default = int(os.environ["PL_GLOBAL_SEED"])
    if default is None:
        default = torch.initial_seed() % 2**63
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [default]
        dist.broadcast_object_list(box, src=0)
        default = box[0]
    return int(default)


@dataclass
class MaterializeReport:
    """What materialization held at once: full-buffer bytes and number of groups."""

    peak_full_bytes: int = 0
    peak_open_groups: int = 0
    largest_group_bytes: int = 0


def materialize_meta_module(
    module: nn.Module, device: torch.device | str, seed: int | None = None
) -> MaterializeReport:
    """Initialize the shards (and meta buffers) of a module sharded from the meta device.

    ``seed`` defaults to ``shared_seed()``; the global RNG state is left untouched.
    Returns how many full-buffer bytes and groups were alive at the peak.
    Raises ``RuntimeError`` naming the parameters or buffers that no module's
    ``reset_parameters`` would initialize (they would otherwise hold garbage).
    """
    device = torch.device(device)
    state = get_state(module)
    groups = state.all_groups
    _materialize_buffers(module, device)

    owners = _modules_to_reset(module)
    _check_coverage(module, groups, owners)
    group_of_slot = {(id(owner), attr): group for group in groups for owner, attr, _b, _n in group.slots}
    touches: list[list[ShardGroup]] = []
    for owner in owners:
        touched = {id(group_of_slot[(id(owner), attr)]): group_of_slot[(id(owner), attr)]
                   for attr, p in owner._parameters.items() if p is not None and (id(owner), attr) in group_of_slot}
        touches.append(list(touched.values()))
    last_use = {id(group): index for index, touched in enumerate(touches) for group in touched}

    seed = shared_seed(seed)
    live: dict[int, dict[tuple[int, str], torch.Tensor]] = {}
    by_id = {id(group): group for group in groups}
    report = MaterializeReport(largest_group_bytes=max(_group_bytes(g) for g in groups))
    with _forked_rng(device), torch.no_grad():
        torch.manual_seed(seed)
        for index, owner in enumerate(owners):
            for group in touches[index]:
                if id(group) not in live:
                    live[id(group)] = _open_group(group)
            report.peak_open_groups = max(report.peak_open_groups, len(live))
            report.peak_full_bytes = max(report.peak_full_bytes, sum(_group_bytes(by_id[g]) for g in live))
            owner.reset_parameters()
            for group_id in [g for g, last in last_use.items() if last == index]:
                _close_group(by_id[group_id], live.pop(group_id))
    for group in groups:  # point every module back at its shards
        group.reshard()
    return report


def _group_bytes(group: ShardGroup) -> int:
    return sum(b.world_size * b.layout.segment_size * b.sharded.element_size() for b in group.buckets)


def _modules_to_reset(module: nn.Module) -> list[nn.Module]:
    """Modules, in module order, that own parameters or buffers directly and define ``reset_parameters``."""
    return [
        m
        for m in module.modules()
        if callable(getattr(m, "reset_parameters", None))
        and (any(p is not None for p in m._parameters.values()) or any(b is not None for b in m._buffers.values()))
    ]


def _check_coverage(module: nn.Module, groups: list[ShardGroup], owners: list[nn.Module]) -> None:
    covered = {id(m) for m in owners}
    missing = []
    for name, sub in module.named_modules():
        if id(sub) in covered:
            continue
        for attr, param in sub._parameters.items():
            if param is not None:
                missing.append(f"{name + '.' if name else ''}{attr}")
        for attr, buffer in sub._buffers.items():
            if buffer is not None and getattr(sub, "_ragged_meta_buffer_" + attr, False):
                missing.append(f"{name + '.' if name else ''}{attr} (buffer)")
    if missing:
        raise RuntimeError(
            "cannot initialize a model built on the meta device: these tensors belong to modules without a "
            f"`reset_parameters()` method, so nothing would initialize them: {', '.join(missing)}. Give those "
            "modules a `reset_parameters()` that initializes their own parameters/buffers, or build the model "
            "without `Trainer.init_module(empty_init=True)` / `torch.device('meta')`."
        )


def _materialize_buffers(module: nn.Module, device: torch.device) -> None:
    """Give meta buffers real (uninitialized) storage; ``reset_parameters`` must fill them."""
    for sub in module.modules():
        for attr, buffer in list(sub._buffers.items()):
            if buffer is not None and buffer.is_meta:
                sub._buffers[attr] = torch.empty_like(buffer, device=device)
                setattr(sub, "_ragged_meta_buffer_" + attr, True)


def _open_group(group: ShardGroup) -> dict[tuple[int, str], torch.Tensor]:
    """Allocate full master-dtype buffers for a group and point its module slots at full views."""
    views: dict[tuple[int, str], torch.Tensor] = {}
    for bucket in group.buckets:
        layout = bucket.layout
        full = torch.zeros(bucket.world_size * layout.segment_size, dtype=bucket.master_dtype, device=bucket.device)
        for name, param in bucket.unsharded_params.items():
            begin = layout.offsets[name]
            views[(id(bucket), name)] = nn.Parameter(
                full[begin : begin + param.numel()].view(param.shape), requires_grad=param.requires_grad
            )
        views[(id(bucket), "")] = full
    group._swap(lambda bucket, name: views[(id(bucket), name)])
    return views


def _close_group(group: ShardGroup, views: dict[tuple[int, str], torch.Tensor]) -> None:
    """Keep this rank's segment of each full buffer, then drop the buffers."""
    for bucket in group.buckets:
        bucket.sharded.copy_(views[(id(bucket), "")][bucket.segment])
    group.reshard()
    views.clear()


@contextmanager
def _forked_rng(device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield
