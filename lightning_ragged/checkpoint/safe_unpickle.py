"""Reading checkpoint pickles without running code: DCP's ``.metadata``, its pickled items, ``meta.pt``.

A pickle can name any importable callable and have it called while loading (``__reduce__``),
so a checkpoint from someone else must never be fully unpickled. Three readers, each refusing
everything but the types that file holds when this project (or DCP) writes it:

* ``load_dcp_metadata``: DCP's ``.metadata`` (``FileSystemReader.read_metadata`` uses a plain
  ``pickle.load``) through an unpickler whose ``find_class`` knows only DCP's own metadata
  classes, ``torch.Size``, the torch dtypes / layouts / memory formats and ``pathlib`` paths
  (``StorageMeta.checkpoint_id``). That is every global a real ``.metadata`` names, compressed
  or not (measured on model + AdamW / Muon / Shampoo / AdamW8bit checkpoints, 0-D parameters).
* ``SafeLoadPlanner``: DCP's ``DefaultLoadPlanner.load_bytes`` ``torch.load``s every non-tensor
  item (param groups, the optimizer format, the 0-D record) with ``weights_only=False``; this one
  uses ``weights_only=True``.
* ``torch_load``: ``torch.load(weights_only=True)`` with ``pathlib`` paths allowed too (a common
  hyperparameter type); your own types: ``torch.serialization.add_safe_globals([...])``.

``trusted=True`` everywhere restores plain unpickling, for files whose writer you trust.
Refusals raise ``RefusedPickleError`` (a ``pickle.UnpicklingError``; torch's own weights-only
refusal from ``torch_load``); ``errors.untrusted`` turns them into ``UntrustedCheckpointError``.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import IO, Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # how a torch.layout pickles
    "torch": {"Size"},
}
"""Every global a ``.metadata`` written by DCP (through this project) names, besides dtypes and paths."""

_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}

SAFE_META_GLOBALS: list[Any] = [pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath]
"""Allowed in ``meta.pt`` / single-file checkpoints beyond torch's own weights-only types."""


class RefusedPickleError(pickle.UnpicklingError):
    """A pickle was refused because loading it could run code (not because it is damaged)."""


class ForbiddenGlobalError(RefusedPickleError):
    """The pickle names a global outside the allow-list (``module``, ``name``)."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name} is not allowed")
        self.module = module
        self.name = name

    def __reduce__(self) -> Any:  # DCP pickles a rank's exception to the others
        return (type(self), (self.module, self.name))


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        if module == "pathlib" and name in _PATHS:
            # A path written on the other OS cannot be instantiated here; its pure form can.
            native = getattr(pathlib, name)
            if name.startswith("Pure") or native is type(pathlib.Path()):
                return native
            return getattr(pathlib, "Pure" + name)  # pragma: no cover - written on another OS
        raise ForbiddenGlobalError(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickleError("persistent ids are not allowed in DCP metadata")


def load_dcp_metadata(file: IO[bytes] | bytes, *, trusted: bool = False) -> Metadata:
    """Unpickle a DCP ``.metadata`` (a stream or its bytes); only DCP's metadata types unless ``trusted``."""
    stream = io.BytesIO(file) if isinstance(file, (bytes, bytearray, memoryview)) else file
    metadata = pickle.load(stream) if trusted else _MetadataUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"DCP metadata must be a Metadata object, found {type(metadata).__name__}")
    return metadata


class SafeMetadataReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses the allow-list unpickler (plain pickle if ``trusted``)."""

    def __init__(self, path: str | os.PathLike, *, trusted: bool = False, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.trusted = trusted

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_dcp_metadata(stream, trusted=self.trusted)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that unpickles non-tensor items with ``weights_only=True`` unless ``trusted``."""

    def __init__(self, *args: Any, trusted: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trusted = trusted

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        if self.trusted:
            return super().load_bytes(read_item, value)
        try:
            loaded = torch_load(value, trusted=False)
        except pickle.UnpicklingError as error:
            if is_refusal(error):
                raise RefusedPickleError(f"item {read_item.dest_index.fqn!r}: {refusal_detail(error)}") from error
            raise pickle.UnpicklingError(f"item {read_item.dest_index.fqn!r} is damaged: {refusal_detail(error)}") from error
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


_REFUSED = ("GLOBAL", "unrecognized function", "Can only create new object", "Can only build")
"""Heads of torch's weights-only messages for an object it will not build (code could run). Its
others ("Unsupported operand", "String is too long", "Can only append to lists") mean damaged bytes."""


def is_refusal(error: BaseException) -> bool:
    """A weights-only / allow-list refusal (code could run), as opposed to a damaged file."""
    if isinstance(error, RefusedPickleError):
        return True
    text = str(error)
    return isinstance(error, pickle.UnpicklingError) and "Weights only load failed" in text and any(
        marker in refusal_detail(error) for marker in _REFUSED
    )


def refusal_detail(error: BaseException) -> str:
    """The useful line of a refusal (torch's weights-only message: the global it did not allow)."""
    text = str(error)
    marker = "WeightsUnpickler error: "
    if marker in text:
        text = text.split(marker, 1)[1]
    return (text.strip().splitlines() or [type(error).__name__])[0].split(". Please use")[0]


def torch_load(file: Any, *, trusted: bool = False, **kwargs: Any) -> Any:
    """``torch.load``: weights-only (plus ``SAFE_META_GLOBALS``) unless ``trusted``."""
    if trusted:
        return torch.load(file, weights_only=False, **kwargs)
    with torch.serialization.safe_globals(SAFE_META_GLOBALS):
        return torch.load(file, weights_only=True, **kwargs)
