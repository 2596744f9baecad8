"""StateShard: a sharded tensor in a state dict, with the global shape outside and this rank's part inside.

``model.state_dict()`` and a ``torch.optim`` optimizer's ``state_dict()`` hold one for each
sharded parameter (and for each state shaped like it), where FSDP2's hold DTensors.

- **DCP.** It implements the checkpointable protocol DTensor implements
  (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``). So every
  rank writes its ragged range as N-D boxes at their offsets in the global shape, and loading
  reads any saved layout into those boxes in place.
- **Elementwise operations** run on the local part and give StateShards of the same boxes: a
  copy, ``.to()``, an EMA's ``lerp_``. ``torch.equal`` is all-reduced over the shard group, as
  DTensor's is.
- **What needs the whole tensor is refused**, naming the way to full tensors: reductions,
  reading values, filling a full tensor, pickling. It is never answered from the local part.
  ``full_tensor()`` gathers the whole, as DTensor's does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.utils import _pytree as pytree

from lightning_ragged.engine import collectives
from lightning_ragged.layout.ragged_shard import Box, RaggedShard

aten = torch.ops.aten

FULL_TENSORS = (
    "full tensors come from lightning_ragged.full_state_dict(model), a StateShard's full_tensor() or torch's "
    "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)); shards are saved and loaded "
    "with torch.distributed.checkpoint (dcp.save / dcp.load)"
)

_ELEMENTWISE = {
    aten.clone.default, aten.detach.default, aten.alias.default, aten._to_copy.default, aten.copy_.default,
    aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
    aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default,
}
"""Operations that run on the local part although they lack the pointwise tag."""


def layout_of(shard: RaggedShard) -> tuple:
    """The global shape and every rank's range: the same on every rank, so ranks agree on what matches."""
    return tuple(shard.global_shape), shard.rank_ranges


class StateShard(torch.Tensor):
    """A sharded tensor in a state dict: shape and dtype of the whole, elements of this rank's boxes."""

    _local: torch.Tensor
    _shard: RaggedShard

    @staticmethod
    def __new__(cls, local: torch.Tensor, shard: RaggedShard) -> "StateShard":
        """``local``: this rank's 1-D part of a tensor shaped like ``shard``'s parameter (viewed, not copied)."""
        tensor = torch.Tensor._make_wrapper_subclass(cls, shard.global_shape, dtype=local.dtype, device=local.device)
        tensor._local, tensor._shard = local, shard
        return tensor

    @property
    def layout(self) -> tuple:
        return layout_of(self._shard)

    @property
    def _boxes(self) -> list[Box]:
        return self._shard.local_boxes()

    @property
    def local(self) -> torch.Tensor:
        """This rank's part: the 1-D tensor of its boxes' elements, back to back."""
        return self._local

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor, on every rank: gathered over the shard group, as DTensor's ``full_tensor()``.

        A collective: every rank of the shard group calls it, in the same order. A tensor one
        rank holds whole is broadcast from it; a split one is all-gathered in parts padded to
        the longest (each rank sends its part once). On NCCL a CPU part travels through a CUDA copy.
        """
        shard, group = self._shard, self._shard.process_group
        device = _collective_device(group, self._local.device)
        local = self._local.to(device)
        owner = shard.owner()
        if owner is not None:
            full = local.clone() if shard.rank == owner else local.new_empty(shard.numel)
            dist.broadcast(full, src=dist.get_global_rank(group, owner) if group is not None else owner, group=group)
        else:
            longest = max(end - start for start, end in shard.rank_ranges)
            padded = local.new_zeros(longest)
            padded[: local.numel()] = local
            gathered = local.new_empty(longest * shard.world_size)
            collectives.all_gather(gathered, padded, group)  # the non-deprecated name on torch 2.13
            full = local.new_empty(shard.numel)
            for rank, (start, end) in enumerate(shard.rank_ranges):
                full[start:end] = gathered[rank * longest : rank * longest + end - start]
        return full.to(self._local.device).view(shard.global_shape)

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"StateShard(shape={list(self.shape)}, dtype={self.dtype}, this rank's {self._local.numel()} elements "
            f"of {self._shard.world_size} ranks' ragged ranges)"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"a StateShard holds only this rank's part of a sharded tensor of shape {list(self.shape)}; pickling it "
            f"(torch.save) would write that part as the whole: {FULL_TENSORS}"
        )

    def __deepcopy__(self, memo: dict) -> "StateShard":
        return StateShard(self._local.clone(), self._shard)

    # -- DCP's checkpointable protocol: the boxes at their offsets in the global shape
    def __create_write_items__(self, fqn: str, _object: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self._local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)), properties, self.shape
                ),
            )
            for offsets, sizes in self._boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        cursor = 0
        for offsets, sizes in self._boxes:
            count = torch.Size(sizes).numel()
            if index.offset is not None and tuple(index.offset) == tuple(offsets):
                return self._local[cursor : cursor + count].view(sizes)
            cursor += count
        raise ValueError(f"{index.fqn!r}: this rank holds no box at offsets {index.offset} (it holds {self._boxes})")

    # -- operations
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is aten.equal.default:
            return _equal(*args)
        shards = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, StateShard)]
        first = shards[0]
        if any(s.layout != first.layout for s in shards):
            raise ValueError(f"{func}: StateShards of different layouts; {FULL_TENSORS}")
        if func is aten.is_same_size.default:
            return args[0].shape == args[1].shape
        if func in (aten.new_empty.default, aten.new_empty_strided.default) and list(args[1]) == list(first.shape):
            # a tensor like this one (DCP's async staging allocates its copy so): empty boxes of the same layout
            kwargs = {k: v for k, v in kwargs.items() if k != "requires_grad"}
            return cls(first._local.new_empty(first._local.shape, **kwargs), first._shard)
        if torch.Tag.pointwise not in func.tags and func not in _ELEMENTWISE:
            raise NotImplementedError(
                f"{func} does not run on a StateShard, which holds only this rank's part of a sharded tensor "
                f"(shape {list(first.shape)}): {FULL_TENSORS}"
            )

        def unwrap(value: Any) -> Any:
            if isinstance(value, StateShard):
                return value._local
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                raise ValueError(
                    f"{func} mixes a StateShard (this rank's part of a tensor of shape {list(first.shape)}) with a "
                    f"tensor of shape {list(value.shape)}: {FULL_TENSORS}"
                )
            return value

        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs))
        if func._schema.is_mutable:  # in place: the StateShard itself (its local part was written)
            return args[0] if func._schema.returns else None
        return pytree.tree_map(lambda o: cls(o, first._shard) if isinstance(o, torch.Tensor) else o, out)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` of the wholes: all-reduced over the shard group, as DTensor's (every rank must call it)."""
    if not (isinstance(a, StateShard) and isinstance(b, StateShard)):
        raise ValueError(f"torch.equal of a StateShard and a plain tensor of shape {list(b.shape)}: {FULL_TENSORS}")
    if a.layout != b.layout or a.dtype != b.dtype:
        return False  # the same answer on every rank, with no collective
    group = a._shard.process_group
    same = torch.equal(a._local, b._local)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return same
    flag = torch.tensor([int(same)], device=_collective_device(group, torch.device("cpu")))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _collective_device(group: Any, device: torch.device) -> torch.device:
    """Where a tensor on ``device`` goes for a collective of ``group``: NCCL takes CUDA tensors only."""
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device
