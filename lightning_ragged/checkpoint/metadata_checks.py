"""The structure of a DCP ``.metadata``, checked before anything reads a shard or builds a tensor from it.

The allow-list unpickler (``safe_unpickle``) guarantees that ``.metadata`` holds only DCP's
metadata types, not that their fields make sense. A damaged or hostile file can still name a
data file outside the checkpoint directory (an absolute path, ``..``, a symlink: DCP reads
``directory / relative_path``), declare a tensor that its chunks do not cover (DCP then loads
nothing into the uncovered part, silently, and consolidation writes whatever the declared size
is), or hold fields of the wrong type (a bare ``AttributeError`` deep in DCP). Each of these
raises ``CorruptCheckpointError`` here, naming the file, the entry and what is wrong.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from lightning_ragged.checkpoint.errors import CorruptCheckpointError

OPTIMIZER_KEY = re.compile(r"optimizer_[0-9]+")
"""The top-level key of the i-th optimizer's state (lightning_ragged's and Lightning's)."""

MAX_PATH_DEPTH = 64
"""Deepest nesting of a saved state dict (``planner_data`` paths); real ones are under ten."""


def check_structure(directory: Path, metadata: Metadata, trusted: bool = False) -> None:
    """Raise ``CorruptCheckpointError`` for the first field of ``metadata`` that no DCP save writes.

    ``trusted``: a data file may be a link to a file elsewhere (a Hugging Face cache's blobs, shards moved
    to another disk); untrusted, such a link is refused (a hostile directory could point it at a
    checkpoint of yours). A name in ``.metadata`` outside the directory (absolute, ``..``) is refused always.
    """
    where = directory / ".metadata"
    items = metadata.state_dict_metadata
    if not isinstance(items, dict):
        raise CorruptCheckpointError(f"{where} is damaged: state_dict_metadata is a {type(items).__name__}, not a dict")
    for key, item in items.items():
        if not isinstance(key, str):
            raise CorruptCheckpointError(f"{where} is damaged: a state dict key is a {type(key).__name__} ({key!r})")
        if isinstance(item, TensorStorageMetadata):
            _check_tensor(where, key, item)
        elif not isinstance(item, BytesStorageMetadata):
            raise CorruptCheckpointError(f"{where} is damaged: entry {key!r} is a {type(item).__name__}")
    _check_planner_data(where, metadata.planner_data)
    _check_storage(directory, where, metadata.storage_data, items, trusted)


def _is_int_tuple(value: Any, length: int | None = None) -> bool:
    return (
        isinstance(value, (tuple, list))
        and (length is None or len(value) == length)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    )


def _check_tensor(where: Path, key: str, item: TensorStorageMetadata) -> None:
    size = item.size
    dtype = getattr(getattr(item, "properties", None), "dtype", None)
    if not _is_int_tuple(size) or not isinstance(dtype, torch.dtype) or not isinstance(item.chunks, list):
        raise CorruptCheckpointError(f"{where} is damaged: tensor {key!r} has no valid size, dtype and chunk list")
    boxes = []
    for chunk in item.chunks:
        if not (
            isinstance(chunk, ChunkStorageMetadata)
            and _is_int_tuple(chunk.offsets, len(size))
            and _is_int_tuple(chunk.sizes, len(size))
            and all(o + s <= d for o, s, d in zip(chunk.offsets, chunk.sizes, size))
        ):
            raise CorruptCheckpointError(
                f"{where} is damaged: tensor {key!r} of size {list(size)} has a chunk outside it "
                f"({getattr(chunk, 'offsets', None)!r} + {getattr(chunk, 'sizes', None)!r})"
            )
        if math.prod(chunk.sizes):
            boxes.append((tuple(chunk.offsets), tuple(chunk.sizes)))
    covered = sum(math.prod(s) for _, s in boxes)
    overlap = _first_overlap(boxes)
    if covered != math.prod(size) or overlap is not None:
        why = f"chunks {overlap[0]} and {overlap[1]} overlap" if overlap else f"its chunks hold {covered} of {math.prod(size)} elements"
        raise CorruptCheckpointError(
            f"{where} is damaged: tensor {key!r} of size {list(size)} is not covered exactly once by its saved chunks "
            f"({why}); loading it would leave part of the tensor unset"
        )


def _first_overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[Any, Any] | None:
    """Two boxes that share an element, else None: a sweep along the dimension in which the boxes are thinnest
    (dim 0 for row shards, dim 1 for FSDP2's ``Shard(1)``, the rows for element cuts), each box against those
    still open on it (few, on the layouts saves write)."""
    if not boxes or not boxes[0][0]:
        return (boxes[0], boxes[1]) if len(boxes) > 1 else None  # 0-D: one chunk at most
    def thickness(d: int) -> float:  # the boxes' summed extent in dim d, in units of the tensor's
        return sum(sizes[d] for _, sizes in boxes) / max(offsets[d] + sizes[d] for offsets, sizes in boxes)

    axis = min(range(len(boxes[0][0])), key=thickness)
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for box in sorted(boxes, key=lambda b: b[0][axis]):
        start = box[0][axis]
        active = [a for a in active if a[0][axis] + a[1][axis] > start]
        for other in active:
            if all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(box[0], box[1], other[0], other[1])):
                return other, box
        active.append(box)
    return None


def _check_planner_data(where: Path, planner_data: Any) -> None:
    if planner_data is None:
        return
    if not isinstance(planner_data, dict):
        raise CorruptCheckpointError(f"{where} is damaged: planner_data is a {type(planner_data).__name__}, not a dict")
    for key, path in planner_data.items():
        if not (
            isinstance(path, (tuple, list))
            and 0 < len(path) <= MAX_PATH_DEPTH
            and isinstance(path[0], str)
            and all(isinstance(p, (str, int)) for p in path)
        ):
            raise CorruptCheckpointError(
                f"{where} is damaged: the state dict path of {key!r} is not a sequence of 1 to {MAX_PATH_DEPTH} "
                f"keys starting with a name ({str(path)[:80]})"
            )
    numbers = sorted({int(path[0][10:]) for path in planner_data.values() if OPTIMIZER_KEY.fullmatch(path[0])})
    if numbers != list(range(len(numbers))):  # ours and Lightning's; other names (a GAN's optimizer_g) are the user's
        raise CorruptCheckpointError(
            f"{where} is damaged: its optimizer states are numbered {numbers[:8]}, not 0 .. N (optimizer_0, optimizer_1, ...)"
        )


def _check_storage(directory: Path, where: Path, storage: Any, items: dict[str, Any], trusted: bool) -> None:
    """Every item's bytes lie in a file inside ``directory``, and every saved chunk has its bytes."""
    if not isinstance(storage, dict):
        raise CorruptCheckpointError(f"{where} is damaged: storage_data is a {type(storage).__name__}, not a dict")
    root = directory.resolve()
    files: set[str] = set()
    for index, info in storage.items():
        relative = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (
            isinstance(index, MetadataIndex)
            and isinstance(relative, str)
            and _is_int_tuple((offset, length))
            and _is_int_tuple(getattr(index, "offset", None) or ())
        ):
            raise CorruptCheckpointError(f"{where} is damaged: a storage entry is not (file, offset >= 0, length >= 0): {index!r}")
        if relative not in files:
            _check_inside(root, directory, where, relative, trusted)
            files.add(relative)
    for key, item in items.items():
        indices = [MetadataIndex(key, chunk.offsets) for chunk in item.chunks] if isinstance(item, TensorStorageMetadata) else [MetadataIndex(key)]
        for index in indices:
            if index not in storage:
                raise CorruptCheckpointError(f"{where} is damaged: no saved bytes for {key!r} at chunk offsets {list(index.offset or ())}")


def _check_inside(root: Path, directory: Path, where: Path, relative: str, trusted: bool) -> None:
    """Refuse a name outside ``directory``, and untrusted, a link whose target lies outside it."""
    candidate = directory / relative
    if Path(relative).is_absolute() or ".." in Path(relative).parts:
        raise CorruptCheckpointError(
            f"{where} names data file {relative!r}, outside {directory}: refused (a checkpoint reads only its own files)"
        )
    resolved = candidate.resolve()
    if not trusted and not resolved.is_relative_to(root):
        raise CorruptCheckpointError(
            f"{where} names data file {relative!r}, a link to {resolved}, outside {directory}: refused (a checkpoint "
            "reads only its own files); if you made these links (a Hugging Face cache, shards moved to another "
            "disk), load with trust_checkpoint=True"
        )


def check_data_files(directory: Path, metadata: Metadata) -> None:
    """Every data file ``.metadata`` names exists and is at least as long as its items (after ``check_structure``)."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        file = directory / relative
        if not file.is_file():
            raise CorruptCheckpointError(f"{directory} is incomplete: data file {relative} is missing")
        actual = file.stat().st_size
        if actual < size:
            raise CorruptCheckpointError(
                f"{directory} is truncated: data file {relative} has {actual} bytes, the checkpoint records {size}"
            )
