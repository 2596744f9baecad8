"""Every rank runs a loop's batches in step: a clear error at the loop's start instead of a hang.

Each forward of a sharded model all-gathers, so a rank with more batches than another waits in a
collective its peers never issue, until the process-group timeout (DDP's evaluation does not hang
there: its forward has no collective). Lightning's ``DistributedSampler`` gives every rank the same
count; a dataloader of one's own (``use_distributed_sampler=False``, files per rank) may not. When a
training, validation, test or prediction loop starts, the ranks compare their batch counts (one small
collective) and all raise the same error, naming each rank's count: training over every rank (counted up to
``max_steps``, which stops every rank at the same batch), evaluation inside each shard group (HSDP: the
replicas evaluate apart). A rank whose loop has no batch at all skips the loop (Lightning's rule) before
this check: that case still waits for the timeout; so does a training loop whose dataloaders are
reloaded (``reload_dataloaders_every_n_epochs``) to other lengths, checked at the start only.
"""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist


class UnevenBatchesError(RuntimeError):
    """The ranks would run different numbers of batches in one loop."""


def check_same_batch_counts(loop: str, counts: Sequence[int | float], group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`UnevenBatchesError` on every rank of ``group`` (None: all) unless all have the same ``counts``
    (one per dataloader)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    everywhere: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everywhere, [float(count) for count in counts], group=group)
    if any(ranks != everywhere[0] for ranks in everywhere):
        ranks = [index if group is None else dist.get_global_rank(group, index) for index in range(len(everywhere))]
        per_rank = "; ".join(f"rank {rank}: {_show(counts)}" for rank, counts in zip(ranks, everywhere))
        raise UnevenBatchesError(
            f"the {loop} loop has a different number of batches per rank ({per_rank}): under sharding every "
            "forward is a collective, so every rank must run the same number; let Lightning add its "
            "DistributedSampler (use_distributed_sampler=True, the default) or give every rank's dataloader the same "
            "length (drop_last=True, limit_*_batches)"
        )


def _show(counts: list[float]) -> str:
    return ", ".join("unknown" if count == float("inf") else str(int(count)) for count in counts)
