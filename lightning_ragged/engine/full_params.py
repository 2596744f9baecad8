"""A group's parameters as whole tensors outside forward: full master-dtype buffers the modules point at.

Code that must see whole tensors between steps (an ``init_weights()`` after ``to_empty``, fan-based
initializers, surgery on a weight) cannot work on 1-D shards: a random initializer run on each rank's
shard draws each rank's own numbers instead of its slice of one tensor. ``summon_full_params`` (FSDP1's
name) gathers the groups of a module in their master dtype, points the modules at full-shape parameters
and, on exit, keeps each rank's segment of what they then hold.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from lightning_ragged.engine import collectives
from lightning_ragged.engine.checks import check_flag
from lightning_ragged.engine.runtime import get_state
from lightning_ragged.engine.shard_group import ShardGroup


def open_full(group: ShardGroup) -> dict[tuple[int, str], torch.Tensor]:
    """Allocate full master-dtype buffers for a group (zeros) and point its module slots at full views."""
    views: dict[tuple[int, str], torch.Tensor] = {}
    for dbuffer in group.dbuffers:
        full = torch.zeros(dbuffer.full_numel, dtype=dbuffer.master_dtype, device=dbuffer.device)
        for name, param in dbuffer.unsharded_params.items():
            views[(id(dbuffer), name)] = nn.Parameter(dbuffer.full_view(full, name), requires_grad=param.requires_grad)
        views[(id(dbuffer), "")] = full
    group.point_slots_at(lambda dbuffer, name: views[(id(dbuffer), name)])
    return views


def gather_grads(group: ShardGroup, views: dict[tuple[int, str], torch.Tensor]) -> None:
    """Give the full views ``.grad``: every rank's sharded gradients all-gathered into a full master-dtype buffer
    per DBuffer. A parameter gets one where some rank's shard has one (its other ranks' parts are zeros)."""
    for dbuffer in group.dbuffers:
        names = list(dbuffer.sharded_params)
        has = torch.tensor([dbuffer.sharded_params[n].grad is not None for n in names], dtype=torch.int32,
                           device=dbuffer.device)
        collectives.all_reduce(has, dbuffer.process_group).wait()
        if not has.any():
            continue
        segment = torch.zeros_like(dbuffer.sharded)
        base = dbuffer.sharded.storage_offset()
        for name in names:
            shard = dbuffer.sharded_params[name]
            if shard.grad is not None:
                begin = shard.storage_offset() - base
                segment[begin : begin + shard.numel()].copy_(shard.grad)
        full = torch.empty(dbuffer.full_numel, dtype=dbuffer.master_dtype, device=dbuffer.device)
        collectives.all_gather(full, segment, dbuffer.process_group, mode=dbuffer.gather_mode).wait()
        for name, flag in zip(names, has.tolist()):
            if flag > 0:
                views[(id(dbuffer), name)].grad = dbuffer.full_view(full, name)


def close_full(group: ShardGroup, views: dict[tuple[int, str], torch.Tensor], keep: bool = True) -> None:
    """Keep this rank's segment of each full buffer (``keep``), then drop the buffers and point at the shards."""
    if keep:
        for dbuffer in group.dbuffers:
            dbuffer.sharded.copy_(views[(id(dbuffer), "")][dbuffer.segment])
    group.reshard()
    views.clear()


@contextmanager
def summon_full_params(module: nn.Module, *, writeback: bool = True, with_grads: bool = False) -> Iterator[None]:
    """Inside, ``module``'s parameters are whole, original-shape tensors in their master dtype (every group that
    holds one of them is all-gathered); ``writeback``: on exit each rank keeps its segment of what they hold.
    ``with_grads`` (FSDP1's): their ``.grad`` are whole too, gathered from the sharded gradients (read-only: what
    they hold on exit is dropped; the shards keep theirs), for histograms or norms per tensor between backward
    and ``zero_grad``.

    For code that needs whole tensors outside forward, e.g. initializing a model built on the meta device::

        model.to_empty(device="cuda")             # the shards already have storage; buffers get theirs
        for layer in model.layers:                # one block at a time: at most a block's full size held
            with lr.summon_full_params(layer):
                layer.init_weights()              # every rank the same seed: the same tensors, the same shards

    Collective: every rank of the shard group enters and leaves together. Every rank must leave the same values
    (their segments are kept, not compared). Not inside a forward or backward of the model.
    """
    check_flag("writeback", writeback)
    check_flag("with_grads", with_grads)
    state = get_state(module)
    if state.running:
        raise RuntimeError("summon_full_params cannot be entered inside a forward or backward of the sharded model")
    inside = {id(submodule) for submodule in module.modules()}
    groups = [group for group in state.all_groups if any(id(owner) in inside for owner, *_ in group.slots)]
    opened = []
    keep = writeback
    try:
        with torch.no_grad():
            for group in groups:
                views = open_full(group)
                opened.append((group, views))
                for dbuffer in group.dbuffers:
                    collectives.all_gather(views[(id(dbuffer), "")], dbuffer.sharded, dbuffer.process_group,
                                           mode=dbuffer.gather_mode).wait()
                if with_grads:
                    gather_grads(group, views)
        yield
    except BaseException:
        keep = False  # what the block left half done is not written into the shards
        raise
    finally:
        with torch.no_grad():
            for group, views in opened:
                close_full(group, views, keep=keep)
