"""Reading a checkpoint directory: validation before anything touches a model, and what it holds.

:func:`inspect_checkpoint` checks that a directory is complete (DCP ``.metadata``,
``meta.pt``, every data file at least as long as recorded), of a format version we read,
untampered (``checksums.json``) and safe to unpickle (allow-list / weights-only unless
trusted), and returns a :class:`CheckpointInfo`: the DCP storage reader and load planner
that apply the same checks while the shards are read. A missing path falls back to the
newest complete hidden copy an interrupted save left (``atomic_dir.hidden_copies``).
:func:`check_model_matches` compares the saved keys and shapes with a model's.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from lightning_ragged.checkpoint import atomic_dir, bounded_reads, checksums, metadata_checks, safe_unpickle
from lightning_ragged.checkpoint.dcp import quiet_without_process_group
from lightning_ragged.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointVersionError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    MissingCheckpointError,
    is_refusal,
    is_trusted,
    untrusted,
)
from lightning_ragged.checkpoint.format import FORMAT_KEY, FORMAT_VERSION, META_FILENAME, MODEL_KEY
from lightning_ragged.checkpoint.ranks import rank_zero_warn
from lightning_ragged.engine.checks import check_flag
from lightning_ragged.engine.state_dict_checks import shape_problems


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


class CheckpointInfo:
    """What a validated checkpoint directory holds: DCP metadata and the meta.pt contents.

    ``manifest``: the checksums the shards are verified against as they are read (None: not
    verified); ``trusted``: whether pickled items in the shards may be fully unpickled.
    ``reader()`` / ``planner()`` are the DCP storage reader and load planner that apply both.
    """

    def __init__(
        self,
        path: Path,
        metadata: Metadata,
        meta: dict[str, Any],
        *,
        manifest: checksums.Manifest | None = None,
        trusted: bool = False,
    ) -> None:
        self.path = path
        self.metadata = metadata
        self.meta = meta
        self.manifest = manifest
        self.trusted = trusted

    def reader(self) -> "_CheckpointReader":
        return _CheckpointReader(self.path, trusted=self.trusted, manifest=self.manifest, metadata=self.metadata)

    def planner(self, allow_partial_load: bool = False) -> safe_unpickle.SafeLoadPlanner:
        return safe_unpickle.SafeLoadPlanner(allow_partial_load=allow_partial_load, trusted=self.trusted)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Around a DCP load from this checkpoint: its failures as the named ``CheckpointError``s."""
        try:
            with quiet_without_process_group():
                yield
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            named = _named_load_error(self.path, error)
            if named is error:
                raise
            raise named from error

    def read_locally(self, template: dict[str, Any]) -> None:
        """Fill ``template`` (nested, keyed by DCP paths) from the checkpoint on this rank alone: no collective."""
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        with self.reading():
            _load_state_dict(template, storage_reader=self.reader(), planner=self.planner(allow_partial_load=True), no_dist=True)

    @property
    def format(self) -> dict[str, Any]:
        return self.meta.get(FORMAT_KEY, {})

    def rest(self) -> dict[str, Any]:
        """meta.pt without our format record: what Lightning gets back (loops, callbacks, schedulers, ...)."""
        return {k: v for k, v in self.meta.items() if k != FORMAT_KEY}

    def paths(self, prefix: str) -> dict[str, tuple]:
        """Flat DCP key -> nested path, for the keys under ``prefix`` ("model", "optimizer_0")."""
        planner_data = self.metadata.planner_data or {}
        result = {}
        for key in self.metadata.state_dict_metadata:
            path = planner_data.get(key, tuple(key.split(".")))
            if path and path[0] == prefix:
                result[key] = tuple(path)
        return result

    @property
    def model_key(self) -> str:
        """"model" (ours, Lightning's FSDP layout) or "state_dict" (Lightning's ModelParallelStrategy)."""
        prefixes = {path[0] for path in (self.metadata.planner_data or {}).values() if path}
        return "state_dict" if MODEL_KEY not in prefixes and "state_dict" in prefixes else MODEL_KEY

    def model_shapes(self, prefix: str | None = None) -> dict[str, tuple[int, ...]]:
        """Global shape of every tensor of the model (or of another model state saved under ``prefix``)."""
        shapes = {}
        for key, path in self.paths(prefix or self.model_key).items():
            item = self.metadata.state_dict_metadata[key]
            if isinstance(item, TensorStorageMetadata):
                shapes[".".join(str(p) for p in path[1:])] = tuple(item.size)
        return shapes

    @property
    def optimizer_count(self) -> int:
        keys = {path[0] for path in (self.metadata.planner_data or {}).values() if path}
        return sum(1 for key in keys if metadata_checks.OPTIMIZER_KEY.fullmatch(str(key)))


class _CheckpointReader(checksums.VerifyingReaderMixin, safe_unpickle.SafeMetadataReader):
    """DCP's file reader: ``.metadata`` through the allow-list unpickler (or the one already
    validated), every item's bytes checked against the manifest as they are read."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        trusted: bool = False,
        manifest: checksums.Manifest | None = None,
        metadata: Metadata | None = None,
    ) -> None:
        super().__init__(str(path), trusted=trusted)
        self.manifest = manifest
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None or kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        self._metadata.storage_meta = self._metadata.storage_meta or StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if not self.trusted and not isinstance(self.transforms, bounded_reads.BoundedTransforms):
            self.transforms = bounded_reads.BoundedTransforms(self.transforms, self.storage_data, metadata)
        if self.manifest is not None and not checksums.reader_hook_available(dcp.FileSystemReader):
            raise CheckpointError(  # pragma: no cover - a torch without FileSystemReader._slice_file
                "this torch's FileSystemReader has no _slice_file hook, so checksums cannot be verified while "
                "reading; pass verify_checksums=False"
            )


def _named_load_error(path: Path, error: BaseException) -> BaseException:
    """A DCP load failure as the ``CheckpointError`` it stands for (DCP wraps every rank's exception)."""
    from torch.distributed.checkpoint.api import CheckpointException

    causes: list[BaseException] = [error]
    if isinstance(error, CheckpointException):
        causes = [wrapped[0] for _, wrapped in sorted(error.failures.items())] or causes
    for cause in causes:
        if isinstance(cause, CheckpointError):
            return cause
        if isinstance(cause, checksums.ChecksumMismatch):
            return ChecksumMismatchError(f"{path / cause.file} is corrupt: {cause}", path / cause.file, cause.tensor)
        if is_refusal(cause):
            return untrusted(f"{path} (a pickled item of its shards)", cause)
    for cause in causes:
        if _is_damage(cause):
            detail = safe_unpickle.refusal_detail(cause) if isinstance(cause, pickle.UnpicklingError) else str(cause)[:300]
            return CorruptCheckpointError(f"{path} is damaged: reading its shards failed ({type(cause).__name__}: {detail})")
    return error


def _is_damage(cause: BaseException) -> bool:
    """What DCP raises on saved bytes no save wrote: an item that does not decode, a compressed one inflating past
    what it holds, one decoding to another size than its chunk ("mismatch sizes"). Not what a mismatch on the
    loading side or the filesystem raises (those stay as DCP reports them)."""
    return (
        isinstance(cause, (pickle.UnpicklingError, EOFError, bounded_reads.InflationError))
        or (isinstance(cause, AssertionError) and "mismatch sizes" in str(cause))
        or (isinstance(cause, RuntimeError) and "PytorchStreamReader failed" in str(cause))  # a tensor item's archive
    )


def _describe_unfinished(path: Path) -> str:
    tmp = atomic_dir.partial_path(path)
    if tmp.exists():
        return f" A save to this path did not finish (its partial data is in {tmp}); the last complete checkpoint is elsewhere."
    return ""


def _newest_complete_copy(path: Path, **inspect_kwargs: Any) -> Path:
    """``path`` does not exist: the newest hidden copy of it that validates (``atomic_dir.hidden_copies``).

    What an interrupted save leaves there: the new version (link publishing) or, from the
    previous two-rename publish, its new and old copies. An incomplete or damaged copy is
    never chosen; one that is complete but refused (trust, format version) is, so that
    loading says why. None: ``MissingCheckpointError``.
    """
    for candidate in atomic_dir.hidden_copies(path):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                inspect_checkpoint(candidate, **inspect_kwargs)
        except (CorruptCheckpointError, MissingCheckpointError, OSError):
            continue
        except CheckpointError:
            pass
        rank_zero_warn(
            f"no checkpoint at {path}: a save to it was interrupted; loading the newest complete "
            f"copy it left, {candidate}"
        )
        return candidate
    raise MissingCheckpointError(f"no checkpoint at {path}.{_describe_unfinished(path)}")


def inspect_checkpoint(
    path: str | os.PathLike,
    *,
    weights_only: bool | None = None,
    trust_checkpoint: bool = False,
    verify_checksums: bool = True,
) -> CheckpointInfo:
    """Validate a checkpoint directory without touching any model; raise a ``CheckpointError`` naming the problem.

    Checks: the directory exists and is complete (DCP ``.metadata`` and ``meta.pt``),
    ``meta.pt`` is readable and its format version is one we read, and every data file
    DCP refers to exists and is at least as long as the bytes recorded for it.

    Trust: ``.metadata`` is read with an allow-list of DCP's metadata types and ``meta.pt``
    with ``torch.load(weights_only=True)``; anything else raises ``UntrustedCheckpointError``
    unless ``trust_checkpoint=True`` (or an explicit ``weights_only=False``). Checksums
    (``checksums.json``, written at save): ``.metadata`` and ``meta.pt`` are verified here, the
    shards as they are read; ``verify_checksums=False`` skips all of it.
    """
    check_flag("verify_checksums", verify_checksums)
    path = Path(path)
    if not path.exists():  # an interrupted save or removal: the newest complete hidden copy, if any
        path = _newest_complete_copy(
            path, weights_only=weights_only, trust_checkpoint=trust_checkpoint, verify_checksums=verify_checksums
        )
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a sharded checkpoint directory (load it with torch.load)")
    trusted = is_trusted(trust_checkpoint, weights_only)
    metadata_file = path / ".metadata"
    if not metadata_file.is_file():
        raise CorruptCheckpointError(
            f"{path} is not a complete sharded checkpoint: DCP's '.metadata' is missing (the save did not finish, "
            "or this is not a checkpoint directory)"
        )
    if not (path / META_FILENAME).is_file():
        raise CorruptCheckpointError(f"{path} is not a complete checkpoint: '{META_FILENAME}' is missing (the save did not finish)")
    manifest = None
    if verify_checksums:
        try:
            manifest = checksums.Manifest.read(path)
        except ValueError as error:
            raise CorruptCheckpointError(str(error)) from error
    # Untrusted, both small files are unpickled safely (allow-list / weights-only) before their
    # checksums are compared, so that a format version newer than ours is reported as such, and a
    # refusal as a refusal; a file that does not unpickle is checked first (a checksum mismatch
    # says more than "unreadable"). Trusted, they are checked before they are unpickled.
    metadata_bytes = _read_small_file(path, ".metadata", manifest)
    meta_bytes = _read_small_file(path, META_FILENAME, manifest)
    if trusted:
        _verify_small_file(path, ".metadata", metadata_bytes, manifest)
        _verify_small_file(path, META_FILENAME, meta_bytes, manifest)
    try:
        if metadata_bytes is None:
            with open(metadata_file, "rb") as stream:  # streamed: the unpickler stops at its end, whatever the file's size
                metadata = safe_unpickle.load_dcp_metadata(stream, trusted=trusted)
        else:
            metadata = safe_unpickle.load_dcp_metadata(metadata_bytes, trusted=trusted)
    except Exception as error:
        if is_refusal(error):
            raise untrusted(metadata_file, error) from error
        _verify_small_file(path, ".metadata", metadata_bytes, manifest)
        raise CorruptCheckpointError(f"{metadata_file} is unreadable ({type(error).__name__}: {error})") from error
    try:
        meta = _load_meta(path / META_FILENAME, trusted, meta_bytes)
    except CorruptCheckpointError:
        _verify_small_file(path, META_FILENAME, meta_bytes, manifest)
        raise
    if not isinstance(meta, dict):
        _verify_small_file(path, META_FILENAME, meta_bytes, manifest)
        raise CorruptCheckpointError(f"{path / META_FILENAME} is damaged: it holds a {type(meta).__name__}, not a dict")
    info = CheckpointInfo(path, metadata, meta, manifest=manifest, trusted=trusted)
    fmt = info.format
    if not isinstance(fmt, dict):
        raise CorruptCheckpointError(f"{path / META_FILENAME} is damaged: its {FORMAT_KEY!r} record is a {type(fmt).__name__}")
    if not fmt:
        # A Lightning/FSDP2 sharded checkpoint (no ragged format record): readable, version 0.
        fmt = {"format_version": 0}
    version = fmt.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointVersionError(
            f"{path} was written in checkpoint format version {version!r}; this lightning_ragged reads versions "
            f"0..{FORMAT_VERSION}. Upgrade lightning_ragged (or consolidate the checkpoint with the version that wrote it)."
        )
    _verify_small_file(path, ".metadata", metadata_bytes, manifest)
    _verify_small_file(path, META_FILENAME, meta_bytes, manifest)
    metadata_checks.check_structure(path, metadata, trusted)
    if verify_checksums and manifest is None and fmt.get("checksums"):
        raise CorruptCheckpointError(
            f"{path} is damaged: its checksums ('{fmt['checksums']}') are missing, though the save recorded them "
            "(pass verify_checksums=False to load it unverified)"
        )
    if manifest is not None:
        try:
            manifest.check_covers(metadata.storage_data or {})
        except checksums.ChecksumMismatch as error:
            raise ChecksumMismatchError(f"{path} is damaged: {error}", path / checksums.MANIFEST_FILENAME, error.tensor) from error
    metadata_checks.check_data_files(path, metadata)
    return info


def _read_small_file(directory: Path, name: str, manifest: checksums.Manifest | None) -> bytes | None:
    """A small file, read whole when the manifest records it at its present size; else None, and it is read
    as a stream (a huge or sparse file is never taken into memory; ``_verify_small_file`` refuses it)."""
    recorded = manifest.files.get(name) if manifest is not None else None
    if recorded is None or (directory / name).stat().st_size != recorded["size"]:
        return None
    return (directory / name).read_bytes()


def _verify_small_file(directory: Path, name: str, data: bytes | None, manifest: checksums.Manifest | None) -> None:
    """Check a small file of the checkpoint against the manifest (``data``: its bytes, None if not read whole)."""
    recorded = manifest.files.get(name) if manifest is not None else None
    if recorded is None:
        return
    if data is None:
        size = (directory / name).stat().st_size
        raise ChecksumMismatchError(
            f"{directory / name} is corrupt: it has {size} bytes, the checkpoint recorded {recorded['size']} bytes", directory / name
        )
    try:
        manifest.verify_file_bytes(name, data)
    except checksums.ChecksumMismatch as error:
        raise ChecksumMismatchError(f"{directory / name} is corrupt: {error}", directory / name) from error


def _load_meta(file: Path, trusted: bool, data: bytes | None = None) -> dict[str, Any]:
    """meta.pt: weights-only (no fallback) unless ``trusted``."""
    try:
        return safe_unpickle.torch_load(io.BytesIO(data) if data is not None else file, trusted=trusted, map_location="cpu")
    except Exception as error:
        if is_refusal(error):
            raise untrusted(file, error) from error
        raise CorruptCheckpointError(f"{file} is unreadable ({type(error).__name__}: {error})") from error


def check_model_matches(info: CheckpointInfo, expected: Mapping[str, tuple[int, ...]], strict: bool = True) -> None:
    """Raise ``CheckpointMismatchError`` naming missing/unexpected keys and shape mismatches."""
    check_shapes(info.model_shapes(), expected, strict, info.path)


def check_shapes(
    saved: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]], strict: bool, source: Any
) -> None:
    """Raise ``CheckpointMismatchError`` if ``source``'s shapes (``saved``) are not the model's (``expected``)."""
    problems = shape_problems(saved, expected, strict, "the checkpoint")
    if problems:
        raise CheckpointMismatchError(f"{source} holds a different model: " + "; ".join(problems))
