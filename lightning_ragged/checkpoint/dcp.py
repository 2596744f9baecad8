"""Ragged shards as DCP chunks: a rank's boxes of a tensor as a ``DTensor`` over a ``LocalShardsWrapper``.

Each parameter's ragged flat range is written as at most 2·ndim − 1 N-D boxes
(``RaggedShard.local_boxes``) through a ``LocalShardsWrapper`` inside a ``DTensor``: every
box is a view into the DBuffer, so saving copies nothing but what DCP streams to disk,
and loading writes in place into the views of the *current* layout -- whatever world
size, granularity or planner the checkpoint was written with (DCP intersects the saved
boxes with the requested ones).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import warnings
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from lightning_ragged.layout.ragged_shard import RaggedShard

_MESHES: dict[tuple[int, str], Any] = {}
"""DeviceMeshes built for DCP, per process group. A mesh holds its group: a group still held
at interpreter exit can abort the process ("terminate called without an active exception"),
so :func:`release_meshes` runs at the strategy's teardown and at exit."""


def release_meshes() -> None:
    """Drop the cached DeviceMeshes (call before ``destroy_process_group``)."""
    _MESHES.clear()


atexit.register(release_meshes)


def _mesh(group: dist.ProcessGroup | None, device_type: str) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    group = group if group is not None else dist.group.WORLD
    key = (id(group), device_type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, device_type)
    return _MESHES[key]


def boxes_as_dtensor(
    flat: torch.Tensor,
    boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    global_shape: Sequence[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor | None:
    """A DTensor whose local part is ``boxes`` of ``global_shape``, viewed out of the flat tensor.

    ``flat`` holds the boxes' elements back to back in row-major order (as a ragged shard
    does: each box of ``flat_range_to_boxes`` is contiguous). Returns None when there is
    nothing local (DCP then simply gets no chunk from this rank).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    if not boxes:
        return None
    pieces, offsets, cursor = [], [], 0
    for box_offsets, sizes in boxes:
        count = math.prod(sizes)
        pieces.append(flat[cursor : cursor + count].view(sizes))
        offsets.append(tuple(box_offsets))
        cursor += count
    if cursor != flat.numel():
        raise ValueError(f"boxes cover {cursor} elements but the local tensor has {flat.numel()}")
    wrapper = LocalShardsWrapper(pieces, offsets)
    shape = torch.Size(global_shape)
    # The placement is only a label here (DCP asks the wrapper for the chunks); a 0-D
    # tensor has no dim 0 to shard, and its one box is the whole of it.
    placement = Shard(0) if len(shape) else Replicate()
    meta = TensorMeta(shape, _contiguous_stride(shape), flat.dtype)
    # Built directly, not by ``DTensor.from_local``: that views the wrapper as itself, which torch's
    # LocalShardsWrapper refuses for several boxes of a tensor of 3 or more dims (a fused expert stack cut
    # inside an expert: "No support for view on tensors ndim > 2").
    return DTensor(wrapper, DTensorSpec(_mesh(group, flat.device.type), (placement,), tensor_meta=meta), requires_grad=False)


def shard_as_dtensor(flat: torch.Tensor, shard: RaggedShard) -> torch.Tensor | None:
    """The rank's ragged range of one parameter (or of a state shaped like it) as a DTensor.

    A tensor with no elements (shape ``(3, 0)``) is on no rank: the empty tensor itself is returned, a replicated
    entry DCP writes once, so that the key is in the checkpoint the model's load expects it in."""
    if not math.prod(shard.global_shape):
        return flat.new_empty(tuple(shard.global_shape))
    return boxes_as_dtensor(flat.reshape(-1), shard.local_boxes(), shard.global_shape, shard.process_group)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


@contextlib.contextmanager
def quiet_without_process_group() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists; here that is intended."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
