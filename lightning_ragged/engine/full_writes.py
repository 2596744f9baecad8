"""In-place writes to full parameters reach this rank's shard before the full buffer is freed.

Between a group's gather and its reshard the modules hold views into the DBuffer's full buffer.
Code that writes them in place there (a momentum encoder's EMA or a weight clamp in Lightning's
``training_step``, which runs inside the root's forward; ``nn.Embedding(max_norm=...)``, which
renormalizes rows in its forward) would lose the write when the buffer is freed, while under DDP
and in one process the parameter keeps it. The all-gather writes the buffer through an alias with
a counter of its own (``dbuffer.py``), so the buffer's version counter moves only for such writes
(``torch.no_grad()`` in-place ops, ``foreach``/``lerp_`` EMAs; not writes through ``.data``, which
bypass every version counter). ``ShardGroup`` compares it at each reshard and calls
:func:`keep_full_writes`. Each rank copies back only its own segment: the same write on every rank
(the same code on the same values, as DDP needs too) leaves the shards consistent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_ragged.engine.dbuffer import DBuffer


def writes_kept(dbuffer: "DBuffer") -> bool:
    """Whether writes to ``dbuffer``'s full parameters can reach its shard: not where the full buffer is the shard
    itself (nothing to do) or fp8-gathered (a dequantized copy: every element differs from its master)."""
    return not dbuffer.full_is_shard and dbuffer.fp8_gather is None


@torch.no_grad()
def keep_full_writes(dbuffer: "DBuffer") -> None:
    """Copy this rank's segment of the full buffer into its shard; in a narrower compute dtype only the elements
    that differ from the shard's cast (a round trip would round every other element of the fp32 master)."""
    own = dbuffer.unsharded[dbuffer.segment]
    if own.dtype == dbuffer.sharded.dtype:
        dbuffer.sharded.copy_(own)
        return
    changed = own != dbuffer.sharded.to(own.dtype)
    dbuffer.sharded[changed] = own[changed].to(dbuffer.sharded.dtype)
