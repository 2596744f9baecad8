"""DDP's ``grad is None`` for a parameter no rank used, after a synchronized backward.

Every rank reduces every trainable DBuffer (zeros where it got no gradient: its peers may have
some), so a reduced gradient alone cannot tell "used nowhere" from "summed to zero". One small
all-reduce of per-parameter "got a gradient" flags over the reduced DBuffers tells; it is issued
before the last reductions are waited for, so it overlaps them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from lightning_ragged.engine import collectives
from lightning_ragged.engine.collectives import CommStats
from lightning_ragged.engine.dbuffer import DBuffer


def settle_unused(reduced: Sequence[DBuffer], stats: CommStats, finish_in_flight: Callable[[], None]) -> None:
    """One small all-reduce: a parameter that received no gradient on any rank keeps ``grad is None``.

    Only a rank that missed a gradient itself reads the sums back; the others know the answer. A single
    rank (a shard group of one, no HSDP) has no other rank to ask: its own flags are the answer.
    ``finish_in_flight`` waits for the reductions still running (after the flags are issued).
    """
    per_buffer = [dbuffer.used_flags() for dbuffer in reduced]
    flags = [flag for buffer_flags in per_buffer for flag in buffer_flags]
    first = reduced[0]
    if first.single_rank:
        finish_in_flight()
        used = flags
    else:
        counts = collectives.host_tensor(flags, torch.int32, first.device)  # NCCL serves device tensors only
        pending = collectives.all_reduce(counts, first.process_group, async_op=True)
        finish_in_flight()
        pending.wait()
        if first.replicate_group is not None:
            collectives.all_reduce(counts, first.replicate_group)
        stats.flag_syncs += 1
        if all(flags):  # every count includes this rank's own 1: nothing to read back (a device sync on NCCL)
            used = flags
        else:
            used = counts.tolist()
            stats.flag_reads += 1
    for dbuffer, buffer_flags in zip(reduced, per_buffer):
        count = len(buffer_flags)
        dbuffer.settle_unused([u > 0 for u in used[:count]])
        used = used[count:]
