"""Staging sharded tensors for an async save: the boxes of each ragged shard, not the DTensor around them.

DCP's ``StateDictStager`` copies a ``DTensor`` by ``new_empty(..., device="cpu")`` first, and torch's
``LocalShardsWrapper`` answers that with ``empty_like`` of every box on the boxes' own device, ignoring
``device=``: two uninitialized copies of each tensor on the GPU (the DTensor's and the wrapper's) before the
pinned CPU copy replaces them, up to twice the largest tensor on top of training's peak during a save
(measured on CPU: 2x the shards' bytes allocated per stage). Here the stager gets the boxes alone (plain
views of the DBuffers: one CPU storage per DBuffer, reused from save to save) and the DTensors are rebuilt
around the staged boxes with the same spec.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.utils._pytree import tree_flatten, tree_unflatten


def boxes_apart(tensors: Any) -> tuple[dict[str, list[Any]], Callable[[dict[str, list[Any]]], Any]]:
    """``tensors`` with every DTensor over a ``LocalShardsWrapper`` replaced by its list of boxes, and the function
    that rebuilds the same structure from a staged copy of it."""
    leaves, spec = tree_flatten(tensors)
    wrapped: dict[int, tuple[Any, list[tuple[int, ...]]]] = {}
    plain: list[Any] = []
    for index, leaf in enumerate(leaves):
        local = leaf._local_tensor if isinstance(leaf, DTensor) else None
        if isinstance(local, LocalShardsWrapper):
            wrapped[index] = (leaf._spec, [tuple(offset) for offset in local.local_offsets()])
            plain.append(list(local.local_shards()))
        else:
            plain.append(leaf)

    def rebuild(staged: dict[str, list[Any]]) -> Any:
        out = list(staged["leaves"])
        for index, (dtensor_spec, offsets) in wrapped.items():
            out[index] = DTensor(LocalShardsWrapper(out[index], offsets), dtensor_spec, requires_grad=False)
        return tree_unflatten(out, spec)

    return {"leaves": plain}, rebuild
