"""A common start and DDP's buffer semantics: rank 0's parameters and buffers on every rank.

Without ``seed_everything`` each rank builds its own random init; ``fully_shard`` copies
only the local piece of each rank's own full tensors into its shard, so the sharded model
would be a patchwork of every rank's init. DDP broadcasts rank 0's state at construction;
the engine does the same, once and flat per DBuffer (``sync_module_states=True``):

* **parameters** — rank 0 of the shard group lays out its full tensors in one flat buffer
  of the planned layout and ``dist.scatter`` sends every rank exactly its segment (one
  collective per DBuffer; the others never receive what they do not keep). With HSDP
  (``replicate_group``) every replica then takes replica 0's segments (one ``broadcast``
  of the segment in the replicate group), so every rank starts from global rank 0's init.
* **buffers** (BatchNorm running statistics, ...) — broadcast from rank 0, coalesced
  (``torch.distributed._broadcast_coalesced``: few collectives, not one per buffer), in
  the shard group then in the replicate group.

A model on the meta device is skipped: it is materialized from a seed shared by all ranks.

``broadcast_buffers=True`` (DDP's default) also broadcasts the buffers from rank 0 before a
root forward, with DDP's rule: when the previous root forward was a training forward that
synchronizes gradients (or none ran yet), so ``no_sync`` micro-batches and repeated
evaluation forwards issue nothing; an explicit ``unshard()`` (every rank calls it) broadcasts
what is due then, so a forward on one rank alone after it issues nothing. A model without
buffers never issues a collective.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_ragged.engine.collectives import wire
from lightning_ragged.engine.dbuffer import DBuffer

BROADCAST_CHUNK_BYTES = 250 * 2**20
"""Bytes per coalesced broadcast (DDP's ``broadcast_bucket_size``)."""


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def scatter_from_rank0(dbuffer: DBuffer, params: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Overwrite every rank's segment of ``dbuffer`` with the same segment of rank 0's full tensors.

    ``params`` are the original full tensors (name, tensor) the DBuffer was built from; only
    rank 0 of the shard group reads them. Collective over the shard group (and the replicate group).
    """
    group = dbuffer.process_group
    segment = dbuffer.layout.segment_size
    if dbuffer.world_size > 1:
        scatter_list = None
        if dbuffer.rank == 0:
            full = torch.zeros(dbuffer.full_numel, dtype=dbuffer.master_dtype, device=dbuffer.device)
            with torch.no_grad():
                for name, param in params:
                    dbuffer.full_view(full, name).copy_(param.detach())
            scatter_list = [wire(part) for part in full.split(segment)]  # views: one flat buffer, no copy
        dist.scatter(wire(dbuffer.sharded), scatter_list, src=_global_rank(group, 0), group=group)
    replicate = dbuffer.replicate_group
    if replicate is not None and _size(replicate) > 1:
        dist.broadcast(wire(dbuffer.sharded), src=_global_rank(replicate, 0), group=replicate)


def _preserve_versions(tensors: list[torch.Tensor]) -> contextlib.AbstractContextManager:
    """As DDP: a broadcast into a buffer must not invalidate graphs that saved it."""
    preserve = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
    return preserve(tuple(tensors)) if preserve is not None else contextlib.nullcontext()


class BufferSync:
    """Broadcasts a module's buffers from rank 0 of the shard group (then of the replicate group)."""

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None = None,
        chunk_bytes: int = BROADCAST_CHUNK_BYTES,
    ) -> None:
        self.module = module
        self.groups: list[dist.ProcessGroup | None] = []
        self.rebind(process_group, replicate_group)
        self.chunk_bytes = chunk_bytes
        self.has_buffers = any(True for _ in module.buffers())
        """Decided at construction, as DDP: a model without buffers never issues a collective."""
        self.broadcasts = 0
        """Broadcast rounds issued (each a few coalesced collectives per group)."""

    def rebind(self, process_group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup | None) -> None:
        """Broadcast over these groups from now on (a module reused by a run with groups of its own)."""
        self.groups = [process_group] + ([replicate_group] if replicate_group is not None else [])  # None: the world

    def buffers(self) -> list[torch.Tensor]:
        # Collected every time: a module may re-assign its buffers (as DDP re-collects them).
        return [b.detach() for b in self.module.buffers() if not b.is_meta]

    def broadcast(self) -> None:
        """Collective: every rank's buffers become rank 0's."""
        if not self.has_buffers:
            return
        buffers = self.buffers()
        if not buffers:
            return
        with torch.no_grad(), _preserve_versions(buffers):
            for group in self.groups:
                if _size(group) > 1:
                    dist._broadcast_coalesced(group or _world(), [wire(b) for b in buffers], self.chunk_bytes, 0)
        self.broadcasts += 1


def _world() -> dist.ProcessGroup:
    return dist.group.WORLD  # type: ignore[return-value]


def sync_params_and_buffers(
    module: nn.Module,
    dbuffers_and_params: Iterator[tuple[DBuffer, Sequence[tuple[str, torch.Tensor]]]],
    process_group: dist.ProcessGroup | None,
    replicate_group: dist.ProcessGroup | None,
) -> None:
    """``fully_shard(sync_module_states=True)``: rank 0's parameters (per DBuffer) and buffers everywhere."""
    for dbuffer, params in dbuffers_and_params:
        if not any(p.is_meta for _, p in params):
            scatter_from_rank0(dbuffer, params)
    BufferSync(module, process_group, replicate_group).broadcast()
