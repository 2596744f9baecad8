"""Sharded checkpoints: ragged shards as DCP chunks, atomic directories, validation, resharding.

On disk a checkpoint is a directory that ``torch.distributed.checkpoint`` (DCP) and
Lightning both recognise::

    ckpt/                 the final name appears only once the save is complete
      .metadata           DCP: every tensor's global shape and the chunks each rank wrote
      __0_0.distcp ...    DCP: one file per rank, only that rank's shards
      meta.pt             Lightning's non-tensor parts (loops, callbacks, schedulers, hparams)
                          plus {"ragged_checkpoint": {"format_version": ...}}; written last

The model lives under ``"model"`` and optimizer ``i`` under ``"optimizer_{i}"`` (the
layout Lightning's ``consolidate_checkpoint`` expects). Each parameter's ragged flat range
is written as at most 2·ndim − 1 N-D boxes (``RaggedShard.local_boxes``) through a
``LocalShardsWrapper`` inside a ``DTensor``: every box is a view into the DBuffer, so
saving copies nothing but what DCP streams to disk, and loading writes in place into the
views of the *current* layout — whatever world size, granularity or planner the
checkpoint was written with (DCP intersects the saved boxes with the requested ones).

Safety: a save goes to a hidden sibling directory, every rank writes its shards, rank 0
writes ``meta.pt`` last and publishes the directory with one atomic rename
(``atomic_dir.py``). A crash at any point leaves the name holding the previous checkpoint
or the new one, and the hidden directory is never mistaken for a checkpoint (its name
matches neither ``last*.ckpt`` nor ``hpc_ckpt_*``); a missing path loads the newest complete
hidden copy a crash left. A save's collectives that time out raise ``CheckpointTimeoutError``
(``checkpoint_timeout.py``). Loading
validates the directory (complete, untruncated, a format version we read, the same
model) before anything is written into the model.
"""

from __future__ import annotations

import atexit

import contextlib
import math
import os
import shutil
import threading
import warnings
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from lightning_ragged.checkpoint import atomic_dir, checksums, safe_unpickle
from lightning_ragged.checkpoint import timeout as checkpoint_timeout
from lightning_ragged.layout.ragged_shard import RaggedShard

FORMAT_VERSION = 1
"""Bumped when the layout of a checkpoint changes in a way older readers cannot follow."""

FORMAT_KEY = "ragged_checkpoint"
META_FILENAME = "meta.pt"  # Lightning's `_METADATA_FILENAME`: its consolidation merges this file
MODEL_KEY = "model"
TMP_PREFIX = atomic_dir.PARTIAL_PREFIX  # ".ragged-partial-": hidden names and the one-rename publish live in atomic_dir.py
OLD_PREFIX = atomic_dir.OLD_PREFIX
TRASH_PREFIX = atomic_dir.TRASH_PREFIX


# ---------------------------------------------------------------------------------- errors
class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says what is wrong and where."""


class MissingCheckpointError(CheckpointError, FileNotFoundError):
    """No checkpoint (or only an unfinished save) at the path."""


class CorruptCheckpointError(CheckpointError):
    """A file of the checkpoint is missing, truncated or unreadable."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint holds a different model or optimizer (keys or shapes differ)."""


class CheckpointVersionError(CheckpointError):
    """The checkpoint was written in a format version this code cannot read."""


class UntrustedCheckpointError(CheckpointError):
    """A pickle in the checkpoint names objects that could run code; refused unless ``trust_checkpoint=True``."""


class ChecksumMismatchError(CorruptCheckpointError):
    """Bytes of a checkpoint file differ from the checksum recorded at save: ``file`` (and ``tensor`` when known)."""

    def __init__(self, message: str, file: str | os.PathLike | None = None, tensor: str | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.tensor = tensor


_TRUST_HINT = (
    "Refused: unpickling it could run arbitrary code. If you trust whoever wrote this checkpoint, load it with "
    "trust_checkpoint=True (RaggedFSDPStrategy(trust_checkpoint=True), lightning_ragged.checkpoint.core.load(..., "
    "trust_checkpoint=True), python -m lightning_ragged.consolidate --trust-checkpoint); to allow only your own "
    "types, register them with torch.serialization.add_safe_globals([...])."
)


def _is_trusted(trust_checkpoint: bool, weights_only: bool | None) -> bool:
    """Full unpickling only on request: ``trust_checkpoint=True`` or an explicit ``weights_only=False``."""
    if trust_checkpoint and weights_only:
        raise ValueError("trust_checkpoint=True contradicts weights_only=True; pass one of them")
    return bool(trust_checkpoint) or weights_only is False


def _untrusted(source: Any, error: BaseException) -> UntrustedCheckpointError:
    """The refusal, naming the file and the first global that was not allowed."""
    detail = safe_unpickle.refusal_detail(error)
    return UntrustedCheckpointError(f"{source} holds objects beyond tensors and plain containers ({detail}). {_TRUST_HINT}")


def _is_refusal(error: BaseException) -> bool:
    """A weights-only / allow-list refusal (code could run), as opposed to a damaged file."""
    return isinstance(error, safe_unpickle.RefusedPickleError) or (
        isinstance(error, __import__("pickle").UnpicklingError) and "Weights only load failed" in str(error)
    )


# ------------------------------------------------------------------- ragged -> DTensor
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
    return DTensor.from_local(
        wrapper, _mesh(group, flat.device.type), [placement], shape=shape, stride=_contiguous_stride(shape), run_check=False
    )


def shard_as_dtensor(flat: torch.Tensor, shard: RaggedShard) -> torch.Tensor | None:
    """The rank's ragged range of one parameter (or of a state shaped like it) as a DTensor."""
    return boxes_as_dtensor(flat.reshape(-1), shard.local_boxes(), shard.global_shape, shard.process_group)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


# ----------------------------------------------------------------------- model state
def _is_sharded(module: nn.Module) -> bool:
    return getattr(module, "_ragged_fsdp_state", None) is not None


def _sharded_params(module: nn.Module) -> dict[str, nn.Parameter]:
    """State-dict key -> the sharded (1-D, ``.ragged_shard``) parameter, tied keys included.

    Built from the engine's (module, attribute) slots, so it holds whether the module
    currently points at its shards (at rest) or at its full parameters (inside a step).
    """
    if not _is_sharded(module):
        return {}
    from lightning_ragged.engine.api import get_state

    prefixes: dict[int, list[str]] = {}
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(submodule), []).append(prefix)
    result = {}
    for group in get_state(module).all_groups:
        for owner, attr, dbuffer, name in group.slots:
            for prefix in prefixes.get(id(owner), []):
                result[f"{prefix}.{attr}" if prefix else attr] = dbuffer.sharded_params[name]
    return result


def sharded_model_state_dict(module: nn.Module) -> dict[str, Any]:
    """Every state-dict key of ``module``; sharded parameters as DTensors of this rank's boxes.

    The boxes are views into the DBuffer (no gather, no copy). A parameter of which this
    rank holds nothing is left out on this rank. Buffers and unsharded tensors stay as
    they are (replicated: DCP writes them once). Works on a plain module too (then it is
    ``module.state_dict()``).
    """
    sharded = _sharded_params(module)
    result: dict[str, Any] = {}
    for key, value in module.state_dict(keep_vars=False).items():
        param = sharded.get(key)
        if param is None:
            result[key] = value
            continue
        wrapped = shard_as_dtensor(param.detach(), param.ragged_shard)
        if wrapped is not None:
            result[key] = wrapped
    return result


def expected_model_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor key the module's state dict holds (what a checkpoint must have)."""
    sharded = _sharded_params(module)
    shapes = {}
    for key, value in module.state_dict().items():
        if key in sharded:
            shapes[key] = tuple(sharded[key].ragged_shard.global_shape)
        elif isinstance(value, torch.Tensor):
            shapes[key] = tuple(value.shape)
    return shapes


# ------------------------------------------------------------------- optimizer state
def _is_ragged_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    try:
        from lightning_ragged.optim.named_state import RaggedOptimizer
    except ImportError:  # pragma: no cover - the optim package is part of this project
        return False
    return isinstance(optimizer, RaggedOptimizer)


def _shard_or_whole(param: torch.Tensor, name: str) -> RaggedShard:
    shard = getattr(param, "ragged_shard", None)
    if shard is not None:
        return shard
    numel = param.numel()
    return RaggedShard(name, param.shape, max(numel, 1), ((0, numel),), 0, None)


def _optimizer_param_names(module: nn.Module | None, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """id(param) -> the name its state is saved under (the module's parameter name)."""
    if _is_ragged_optimizer(optimizer):
        return {id(p): optimizer.param_name(p) for group in optimizer.param_groups for p in group["params"]}
    names: dict[int, str] = {}
    if module is not None:
        for name, param in module.named_parameters():
            names.setdefault(id(param), name)
    result = {}
    for group in optimizer.param_groups:
        group_names = group.get("param_names")
        for index, param in enumerate(group["params"]):
            if id(param) in names:
                result[id(param)] = names[id(param)]
            elif group_names:
                result[id(param)] = group_names[index]
            elif getattr(param, "ragged_shard", None) is not None:
                result[id(param)] = param.ragged_shard.name
            else:
                raise CheckpointMismatchError(
                    "an optimizer parameter is not a parameter of the module and has no name; "
                    "pass the module whose parameters the optimizer updates"
                )
    return result


def _state_layout(optimizer: torch.optim.Optimizer, param: torch.Tensor, key: str, value: Any, shard: RaggedShard) -> str:
    """How one state entry relates to the parameter: flat | blocks:B | tiles | scalar."""
    if _is_ragged_optimizer(optimizer):
        layout = optimizer.state_layout(param).get(key)
        if layout is not None:
            return layout
    if isinstance(value, Mapping):
        return "tiles"
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return "scalar"
    if getattr(param, "ragged_shard", None) is not None and value.numel() == shard.local_numel and value.dim() == 1:
        return "flat"
    if getattr(param, "ragged_shard", None) is None and tuple(value.shape) == tuple(param.shape):
        return "flat"
    raise CheckpointError(
        f"cannot checkpoint optimizer state {key!r} of parameter {shard.name!r}: shape {tuple(value.shape)} is neither "
        f"a scalar nor shaped like the local shard ({shard.local_numel} elements); a RaggedOptimizer must declare "
        "its layout in state_layout()"
    )


ZERO_DIM_STATES_KEY = "zero_dim_param_states"
"""In a torch-format optimizer state: for each 0-D parameter, the names of its state entries
shaped like it (one value per element, as AdamW's ``exp_avg``).

A 0-D parameter's per-element states and its scalar states (``step``) both have the global
shape ``()``, so shapes alone cannot tell them apart; sharded, the former are this rank's
one element or nothing (a 1-D view of 1 or 0 elements), the latter are whole on every rank.
A save of sharded 0-D parameters records which is which here (an entry only for 0-D
parameters: other checkpoints are unchanged); consolidation keeps it, keyed like "state"."""


def _zero_dim_flat_keys(
    param_shapes: Mapping[Any, Sequence[int]],
    state_shapes: Mapping[Any, Mapping[str, Sequence[int]]],
    recorded: Mapping[Any, Sequence[str]] | None = None,
) -> tuple[dict[Any, set[str]], dict[Any, set[str]]]:
    """For each 0-D parameter: (its 0-D entries shaped like it, its 0-D entries nothing tells apart).

    ``recorded`` (``ZERO_DIM_STATES_KEY``) decides where it names the parameter. Otherwise the
    optimizer's parameters of one or more dimensions tell: torch.optim optimizers keep the
    same entries for every parameter, so an entry name that holds a value of its parameter's
    shape there is per-element here, and one that holds anything else is a scalar.
    """
    per_element: set[str] = set()
    scalar: set[str] = set()
    for param, entries in state_shapes.items():
        shape = param_shapes.get(param)
        if not shape:  # unknown, or 0-D itself
            continue
        for key, size in entries.items():
            (per_element if tuple(size) == tuple(shape) else scalar).add(key)
    flat: dict[Any, set[str]] = {}
    unknown: dict[Any, set[str]] = {}
    for param, entries in state_shapes.items():
        if param_shapes.get(param) is None or tuple(param_shapes[param]) != ():
            continue
        zero_dim = {key for key, size in entries.items() if tuple(size) == ()}
        if recorded is not None and param in recorded:
            flat[param] = zero_dim & set(recorded[param])
            continue
        flat[param] = {key for key in zero_dim if key in per_element and key not in scalar}
        unknown[param] = {key for key in zero_dim if (key in per_element) == (key in scalar)}
    return flat, {param: keys for param, keys in unknown.items() if keys}


def _require_known_zero_dim_layout(unknown: Mapping[Any, set[str]], source: Any) -> None:
    if unknown:
        described = ", ".join(f"{param!r}: {sorted(keys)}" for param, keys in sorted(unknown.items(), key=str))
        raise CheckpointMismatchError(
            f"{source} holds optimizer state of 0-D parameters that cannot be told apart from scalar state "
            f"({described}): shape () fits both, no other parameter of the optimizer shows which entries are "
            f"per-element, and the state has no {ZERO_DIM_STATES_KEY!r} record (a sharded save writes one)"
        )


def _block_range(shard: RaggedShard, block: int) -> tuple[int, int, int]:
    return (*shard.local_blocks(block), math.ceil(shard.numel / block))


def _shard_state_entry(value: Any, layout: str, shard: RaggedShard, sharded: bool) -> Any:
    if layout == "flat" and isinstance(value, torch.Tensor):
        if not sharded:
            return value
        return shard_as_dtensor(value, shard)
    if layout.startswith("blocks:") and isinstance(value, torch.Tensor):
        if not sharded:
            return value
        first, last, total = _block_range(shard, int(layout.split(":", 1)[1]))
        if last - first != value.shape[0]:
            raise CheckpointError(f"block state of {shard.name!r} has {value.shape[0]} blocks, expected {last - first}")
        if first == last:
            return None
        rest = tuple(value.shape[1:])
        boxes = [((first, *[0] * len(rest)), (last - first, *rest))]
        return boxes_as_dtensor(value.reshape(-1), boxes, (total, *rest), shard.process_group)
    return value  # scalars (replicated) and tiles (dicts keyed by global tile coordinates)


def sharded_optimizer_state_dict(module: nn.Module | None, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's state keyed by parameter names, per-parameter states as DTensors of the shard's boxes.

    ``{"state": {name: {key: DTensor | tensor}}, "param_groups": [{..., "params": [names]}],
    "format": "torch" | "ragged"}``. Works for ``torch.optim`` optimizers whose states are
    scalars or shaped like the parameter (AdamW, Adam, SGD, ...) and for
    ``lightning_ragged.optim`` optimizers (their declared "flat", "blocks:B", "tiles" and
    "scalar" layouts). Nothing is copied: the DTensors view the optimizer's own tensors.
    """
    names = _optimizer_param_names(module, optimizer)
    ragged = _is_ragged_optimizer(optimizer)
    groups = []
    for group in optimizer.param_groups:
        saved = {key: value for key, value in group.items() if key not in ("params", "param_names")}
        saved["params"] = [names[id(p)] for p in group["params"]]
        groups.append(saved)
    state: dict[str, Any] = {}
    zero_dim: dict[str, list[str]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            entries = optimizer.state.get(param)
            if not entries:
                continue
            name = names[id(param)]
            shard = _shard_or_whole(param, name)
            sharded = getattr(param, "ragged_shard", None) is not None
            converted = {}
            for key, value in entries.items():
                layout = _state_layout(optimizer, param, key, value, shard)
                entry = _shard_state_entry(value, layout, shard, sharded)
                if entry is not None:
                    converted[key] = entry
                if sharded and not ragged and len(shard.global_shape) == 0 and layout == "flat":
                    zero_dim.setdefault(name, []).append(key)
            state[name] = converted
    result = {"state": state, "param_groups": groups, "format": "ragged" if ragged else "torch"}
    if zero_dim:
        result[ZERO_DIM_STATES_KEY] = zero_dim
    return result


# ----------------------------------------------------------------- directory helpers
def _hidden_sibling(path: Path, prefix: str) -> Path:
    return atomic_dir.hidden_sibling(path, prefix)


def partial_path(path: str | os.PathLike) -> Path:
    """Where a save to ``path`` is written before it is published."""
    return atomic_dir.partial_path(Path(path))


_fsync_dir = atomic_dir.fsync_dir


def _write_file_atomically(obj: Any, path: Path) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    atomic_dir.step("write_meta", part)
    os.replace(part, path)
    atomic_dir.step("rename_meta", path)


def _move_into_place(tmp: Path, path: Path) -> None:
    """Make ``tmp`` the checkpoint at ``path`` with one atomic rename; what was there is deleted afterwards.

    A crash at any moment leaves ``path`` the previous checkpoint or the new one (see
    ``atomic_dir.publish``: an atomic exchange of the two names, or a symlink to a hidden
    version replaced with one ``os.replace``).
    """
    atomic_dir.publish(tmp, path)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint (directory, file or symlink) so that no half-deleted directory ever looks valid.

    A symlink is unlinked (its target is left alone), unless it is the link a save made to
    its own hidden version (then both go); a directory is first renamed to a hidden name,
    then deleted.
    """
    atomic_dir.remove(Path(path))


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file()


# --------------------------------------------------------------------------- writing
def _split_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what DCP writes: "model", "optimizer_i"; what goes to meta.pt: everything else)."""
    tensors: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for key, value in checkpoint.items():
        if key in ("state_dict", MODEL_KEY):
            tensors[MODEL_KEY] = value
        elif key == "optimizer_states":
            for index, state in enumerate(value):
                tensors[f"optimizer_{index}"] = state
        elif key.startswith("optimizer_") and key[len("optimizer_") :].isdigit():
            tensors[key] = value
        else:
            meta[key] = value
    return tensors, meta


def _storage_writer(path: Path, compress: bool) -> checksums.ChecksummingWriter:
    """DCP's file writer, recording a CRC-32 of every item it writes (``writer.manifest`` on rank 0)."""
    extensions = None
    if compress:
        from torch.distributed.checkpoint._extension import ZStandard

        if not ZStandard.is_available():
            raise RuntimeError(
                "checkpoint compression needs the 'zstandard' (or 'pyzstd') package: pip install zstandard"
            )
        extensions = [ZStandard()]
    return checksums.ChecksummingWriter(str(path), _extensions=extensions)


def _is_rank_zero(group: dist.ProcessGroup | None = None) -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


@contextlib.contextmanager
def _quiet_without_process_group() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists; here that is intended."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class _AlreadyStaged:
    """An ``AsyncStager`` for a state dict we copied ourselves (one flat copy per buffer)."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class PendingSave:
    """An asynchronous save in flight; ``wait()`` finishes it (meta.pt, rename) on rank 0.

    ``translating(label)``: a context manager that raises a timeout of the save's
    collectives as ``CheckpointTimeoutError`` (see ``checkpoint_timeout``). A failure is
    kept and raised again by every later ``wait()`` (the finish never runs twice).
    """

    def __init__(self, future: Future, finish: Any, path: Path, translating: Any = None) -> None:
        self.future = future
        self._finish = finish
        self.path = path
        self.translating = translating or (lambda label, group=None: contextlib.nullcontext())
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None

    def wait(self) -> None:
        with self._lock:  # the done-callback (rank 0) and the next save may both get here
            if self._error is not None:
                raise self._error
            if self._done:
                return
            try:
                with self.translating("dcp.async_save"):
                    self.future.result()
                self._finish()
            except BaseException as error:
                self._error = error
                raise
            self._done = True


class CheckpointWriter:
    """Writes checkpoint directories (sync or async) and keeps at most one async save in flight."""

    def __init__(self, timeout: timedelta | None = None) -> None:
        self.pending: PendingSave | None = None
        self._async_group: dist.ProcessGroup | None = None
        self.timeout = timeout
        """The async save's process-group timeout; None: the default group's (the strategy's ``timeout``)."""
        self._saves = 0  # every rank counts the same saves: names a timed-out save's collectives in the store

    def wait(self) -> None:
        """Finish the save in flight, if any (every rank)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()
            with pending.translating("barrier after the asynchronous save", None):  # the default group
                _barrier()

    def save(
        self,
        checkpoint: Mapping[str, Any],
        path: str | os.PathLike,
        *,
        compress: bool = False,
        async_save: bool = False,
        full: bool = False,
        extra_meta: Mapping[str, Any] | None = None,
    ) -> None:
        """Write ``checkpoint`` (Lightning layout or {"model", "optimizer_i", ...}) to the directory ``path``.

        With ``full=True`` the result is instead one ordinary ``torch.save`` file at ``path``
        (Lightning's single-file layout): the shards are written as above to a hidden
        directory, then rank 0 streams them tensor by tensor into the file
        (``consolidate.py``), so no rank ever holds the whole model.

        Collective. Tensors under "state_dict"/"model" and "optimizer_states"/"optimizer_i"
        go through DCP (DTensors: each rank writes its boxes; plain tensors: written
        once); everything else goes to ``meta.pt``, which rank 0 writes last before the
        directory is renamed into place. With ``async_save`` this returns once the
        shards are staged (one copy of each buffer); the write and the rename finish in
        the background and the next save (or ``wait()``) waits for them.
        """
        self.wait()
        path = Path(path)
        tmp = partial_path(path)
        tensors, meta = _split_checkpoint(checkpoint)
        self._saves += 1
        sequence, saved_step = self._saves, meta.get("global_step", meta.get("step"))

        def translating(label: str, group: dist.ProcessGroup | None = None, note: str | None = None) -> Any:
            step = saved_step if isinstance(saved_step, int) else None
            return checkpoint_timeout.translating(path, label, sequence=sequence, step=step, group=group, note=note)

        meta[FORMAT_KEY] = {
            "format_version": FORMAT_VERSION,
            "world_size": _world_size(),
            "optimizers": sum(1 for key in tensors if key.startswith("optimizer_")),
            "has_model": MODEL_KEY in tensors,
            "compressed": compress,
            "checksums": checksums.MANIFEST_FILENAME,  # a directory without it is then known to be damaged
            **(extra_meta or {}),
        }
        if _is_rank_zero():
            atomic_dir.prepare_partial(path, META_FILENAME)  # an earlier save to this path that never finished is removed
        with translating("barrier before writing"):
            _barrier()

        def finish() -> None:
            atomic_dir.step("write_shards", tmp)
            if not _is_rank_zero():
                return
            _write_file_atomically(meta, tmp / META_FILENAME)
            manifest = _publish_checksums(writer, tmp)
            atomic_dir.step("write_checksums", tmp / checksums.MANIFEST_FILENAME)
            _fsync_dir(tmp)
            if not full:
                _move_into_place(tmp, path)
                return
            from lightning_ragged.checkpoint.consolidation import write_full_checkpoint

            # Our own fresh save: meta is the live objects (trusted); the shards are verified as read.
            metadata = safe_unpickle.load_dcp_metadata((tmp / ".metadata").read_bytes())
            info = CheckpointInfo(tmp, metadata, meta, manifest=manifest, trusted=True)
            part = atomic_dir.file_part_path(path)  # hidden, no digits of the name: Lightning's hpc_ckpt_<N> scan
            write_full_checkpoint(info, part)
            atomic_dir.step("write_file", part)
            checksums.remove_sidecar(path)  # never an old file's checksum next to the new file
            _move_into_place(part, path)
            checksums.write_sidecar(path)
            shutil.rmtree(tmp, ignore_errors=True)

        writer = _storage_writer(tmp, compress)
        if not async_save:
            with translating("dcp.save"), _quiet_without_process_group():
                dcp.save(tensors, storage_writer=writer)
            with translating("barrier after writing the shards"):
                _barrier()  # every rank's files are complete (DCP's .metadata is written by rank 0 last)
            finish()
            with translating("barrier after publishing", note=f"Rank 0 may have published {path} already. "):
                _barrier()
            return
        if dist.is_initialized() and self._async_group is None:
            # its own group (DCP's collectives run in a background thread), with the default group's timeout
            timeout = self.timeout or checkpoint_timeout.group_timeout()
            self._async_group = dist.new_group(backend="gloo", **({"timeout": timeout} if timeout else {}))
        staged = _stage(tensors)
        future = dcp.async_save(
            staged, storage_writer=writer, process_group=self._async_group, async_stager=_AlreadyStaged()
        )
        # DCP's rank 0 finishes (writes .metadata) only after every rank's data is written,
        # so rank 0 may publish the directory as soon as its own future completes.
        group = self._async_group
        self.pending = PendingSave(future, finish, path, lambda label, group=group: translating(label, group=group))
        if _is_rank_zero():
            pending = self.pending
            future.add_done_callback(lambda f: f.exception() is None and pending.wait())


def _publish_checksums(writer: checksums.ChecksummingWriter, directory: Path) -> checksums.Manifest:
    """Rank 0, before the directory is published: ``checksums.json`` (items from DCP, ``.metadata``, meta.pt)."""
    manifest = writer.manifest
    if manifest is None:
        raise CheckpointError(f"the save to {directory} recorded no checksums (DCP's finish did not run on this rank)")
    manifest.add_file(directory, ".metadata")
    manifest.add_file(directory, META_FILENAME)
    manifest.write(directory)
    return manifest


def _stage(tree: Any) -> Any:
    """A copy of every tensor the training step will overwrite, one flat copy per shared storage."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    copies: dict[int, torch.Tensor] = {}

    def copy_of(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in copies:
            copies[key] = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage.clone())
        base = copies[key]
        return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
            base.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
        )

    def visit(value: Any) -> Any:
        if isinstance(value, DTensor):
            local = value._local_tensor
            if isinstance(local, LocalShardsWrapper):
                pieces = [copy_of(piece) for piece in local.local_shards()]
                wrapper = LocalShardsWrapper(pieces, [tuple(o) for o in local.local_offsets()])
                return DTensor.from_local(
                    wrapper, value.device_mesh, value.placements, shape=value.shape, stride=value.stride(), run_check=False
                )
            return value.clone()
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, Mapping):
            return {key: visit(item) for key, item in value.items()}
        if isinstance(value, list):
            return [visit(item) for item in value]
        return value

    return visit(tree)


# --------------------------------------------------------------------------- reading
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
            with _quiet_without_process_group():
                yield
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            named = _named_load_error(self.path, error)
            if named is error:
                raise
            raise named from error

    @property
    def format(self) -> dict[str, Any]:
        return self.meta.get(FORMAT_KEY, {})

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

    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        for key, path in self.paths(self.model_key).items():
            item = self.metadata.state_dict_metadata[key]
            if isinstance(item, TensorStorageMetadata):
                shapes[".".join(str(p) for p in path[1:])] = tuple(item.size)
        return shapes

    @property
    def optimizer_count(self) -> int:
        keys = {path[0] for path in (self.metadata.planner_data or {}).values() if path}
        return sum(1 for key in keys if str(key).startswith("optimizer_"))


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
        if _is_refusal(cause):
            return _untrusted(f"{path} (a pickled item of its shards)", cause)
    return error


def _describe_unfinished(path: Path) -> str:
    tmp = partial_path(path)
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
        _rank_zero_warn(
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
    path = Path(path)
    if not path.exists():  # an interrupted save or removal: the newest complete hidden copy, if any
        path = _newest_complete_copy(
            path, weights_only=weights_only, trust_checkpoint=trust_checkpoint, verify_checksums=verify_checksums
        )
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a sharded checkpoint directory (load it with torch.load)")
    trusted = _is_trusted(trust_checkpoint, weights_only)
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
    metadata_bytes = metadata_file.read_bytes()
    meta_bytes = (path / META_FILENAME).read_bytes()
    if trusted:
        _verify_small_file(path, ".metadata", metadata_bytes, manifest)
        _verify_small_file(path, META_FILENAME, meta_bytes, manifest)
    try:
        metadata = safe_unpickle.load_dcp_metadata(metadata_bytes, trusted=trusted)
    except Exception as error:
        if _is_refusal(error):
            raise _untrusted(metadata_file, error) from error
        _verify_small_file(path, ".metadata", metadata_bytes, manifest)
        raise CorruptCheckpointError(f"{metadata_file} is unreadable ({type(error).__name__}: {error})") from error
    try:
        meta = _load_meta(path / META_FILENAME, trusted, meta_bytes)
    except CorruptCheckpointError:
        _verify_small_file(path, META_FILENAME, meta_bytes, manifest)
        raise
    info = CheckpointInfo(path, metadata, meta, manifest=manifest, trusted=trusted)
    fmt = info.format
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
    _check_data_files(path, metadata)
    return info


def _verify_small_file(directory: Path, name: str, data: bytes, manifest: checksums.Manifest | None) -> None:
    """Check a small file of the checkpoint (read whole) against the manifest."""
    if manifest is not None:
        try:
            manifest.verify_file_bytes(name, data)
        except checksums.ChecksumMismatch as error:
            raise ChecksumMismatchError(f"{directory / name} is corrupt: {error}", directory / name) from error


def _load_meta(file: Path, trusted: bool, data: bytes | None = None) -> dict[str, Any]:
    """meta.pt: weights-only (no fallback) unless ``trusted``."""
    import io

    try:
        return safe_unpickle.torch_load(io.BytesIO(data) if data is not None else file, trusted=trusted, map_location="cpu")
    except Exception as error:
        if _is_refusal(error):
            raise _untrusted(file, error) from error
        raise CorruptCheckpointError(f"{file} is unreadable ({type(error).__name__}: {error})") from error


def _check_data_files(path: Path, metadata: Metadata) -> None:
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is None:
            continue
        needed[relative] = max(needed.get(relative, 0), info.offset + info.length)
    for relative, size in sorted(needed.items()):
        file = path / relative
        if not file.is_file():
            raise CorruptCheckpointError(f"{path} is incomplete: data file {relative} is missing")
        actual = file.stat().st_size
        if actual < size:
            raise CorruptCheckpointError(
                f"{path} is truncated: data file {relative} has {actual} bytes, the checkpoint records {size}"
            )


def check_model_matches(info: CheckpointInfo, expected: Mapping[str, tuple[int, ...]], strict: bool = True) -> None:
    """Raise ``CheckpointMismatchError`` naming missing/unexpected keys and shape mismatches."""
    _check_shapes(info.model_shapes(), expected, strict, info.path)


def _check_shapes(
    saved: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]], strict: bool, source: Any
) -> None:
    """Raise ``CheckpointMismatchError`` if ``source``'s shapes (``saved``) are not the model's (``expected``)."""
    missing = sorted(expected.keys() - saved.keys())
    unexpected = sorted(saved.keys() - expected.keys())
    shapes = sorted(
        f"{key}: checkpoint {list(saved[key])} vs model {list(expected[key])}"
        for key in expected.keys() & saved.keys()
        if tuple(saved[key]) != tuple(expected[key])
    )
    problems = []
    if missing and strict:
        problems.append(f"missing keys (in the model, not in the checkpoint): {_short(missing)}")
    if unexpected and strict:
        problems.append(f"unexpected keys (in the checkpoint, not in the model): {_short(unexpected)}")
    if shapes:
        problems.append(f"shape mismatch: {_short(shapes)}")
    if problems:
        raise CheckpointMismatchError(f"{source} holds a different model: " + "; ".join(problems))


def _short(items: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" ... and {len(items) - limit} more" if len(items) > limit else "")


def _set_path(root: dict, path: tuple, value: Any) -> None:
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


def load_sharded_model_state_dict(module: nn.Module, info: CheckpointInfo | str | os.PathLike, strict: bool = True) -> None:
    """Load the checkpoint's model in place into ``module`` (sharded: its DBuffer views; plain: its tensors).

    Validates keys and shapes first. Any saved layout (world size, granularity, planner,
    HSDP degree) loads into the current one.
    """
    if not isinstance(info, CheckpointInfo):
        info = inspect_checkpoint(info)
    check_model_matches(info, expected_model_shapes(module), strict=strict)
    template = sharded_model_state_dict(module)
    saved = set(info.model_shapes())
    template = {key: value for key, value in template.items() if key in saved}
    with info.reading():
        dcp.load({info.model_key: template}, storage_reader=info.reader(), planner=info.planner(allow_partial_load=not strict))
    # Tensors were loaded in place; non-tensor extra state comes back as new objects.
    rest = {key: value for key, value in template.items() if not isinstance(value, torch.Tensor)}
    if rest:
        module.load_state_dict(rest, strict=False)


def _zero_dim_flat_keys_in_directory(
    info: CheckpointInfo, paths: Mapping[str, tuple], by_name: Mapping[str, torch.Tensor]
) -> dict[str, set[str]]:
    """For the sharded 0-D parameters of the optimizer: their saved entries shaped like them (see ``ZERO_DIM_STATES_KEY``)."""
    param_shapes = {name: tuple(_shard_or_whole(param, name).global_shape) for name, param in by_name.items()}
    sharded_zero_dim = {
        name for name, param in by_name.items() if param_shapes[name] == () and getattr(param, "ragged_shard", None) is not None
    }
    if not sharded_zero_dim:
        return {}
    state_shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    record_keys = []
    for flat_key, path in paths.items():
        item = info.metadata.state_dict_metadata[flat_key]
        if len(path) == 4 and path[1] == "state" and isinstance(item, TensorStorageMetadata):
            state_shapes.setdefault(path[2], {})[path[3]] = tuple(item.size)
        elif len(path) == 3 and path[1] == ZERO_DIM_STATES_KEY and path[2] in sharded_zero_dim:
            record_keys.append(flat_key)
    recorded: dict[str, Any] = {}
    if record_keys:
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        template: dict[str, Any] = {}
        for flat_key in record_keys:
            _set_path(template, paths[flat_key], None)
        with info.reading():
            _load_state_dict(  # a few pickled name lists, read by each rank on its own (no collective)
                template, storage_reader=info.reader(), planner=info.planner(allow_partial_load=True), no_dist=True
            )
        recorded = {paths[k][2]: list(_get_path(template, paths[k]) or ()) for k in record_keys}
    flat, unknown = _zero_dim_flat_keys(param_shapes, state_shapes, recorded)
    _require_known_zero_dim_layout({n: keys for n, keys in unknown.items() if n in sharded_zero_dim}, info.path)
    return flat


def _get_path(root: Any, path: tuple) -> Any:
    for key in path:
        root = root[key]
    return root


def load_sharded_optimizer_state_dict(
    module: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    info: CheckpointInfo | str | os.PathLike,
    key: str = "optimizer_0",
) -> None:
    """Load ``key`` of the checkpoint into ``optimizer`` at the current layout (any saved layout)."""
    if not isinstance(info, CheckpointInfo):
        info = inspect_checkpoint(info)
    paths = info.paths(key)
    if not paths:
        raise CheckpointMismatchError(f"{info.path} holds no optimizer state {key!r} (it has {info.optimizer_count})")
    names = _optimizer_param_names(module, optimizer)
    by_name = {names[id(p)]: p for group in optimizer.param_groups for p in group["params"]}
    ragged = _is_ragged_optimizer(optimizer)
    zero_dim_flat = {} if ragged else _zero_dim_flat_keys_in_directory(info, paths, by_name)
    template: dict[str, Any] = {}
    local: dict[tuple[str, str], torch.Tensor] = {}  # (name, entry) -> this rank's tensor of a sharded entry
    unknown = set()
    for flat_key, path in paths.items():
        item = info.metadata.state_dict_metadata[flat_key]
        if len(path) >= 4 and path[1] == "state" and path[2] not in by_name:
            unknown.add(path[2])
            continue
        if len(path) >= 2 and path[1] == ZERO_DIM_STATES_KEY:
            continue  # read above; the optimizer's own state_dict has no such entry
        if not isinstance(item, TensorStorageMetadata):
            _set_path(template, path, None)  # param_groups, format, non-tensor state: DCP fills them in
            continue
        if len(path) < 4 or path[1] != "state":
            _set_path(template, path, torch.empty(tuple(item.size), dtype=item.properties.dtype))
            continue
        name, entry = path[2], path[3]
        param = by_name[name]
        shard = _shard_or_whole(param, name)
        sharded = getattr(param, "ragged_shard", None) is not None
        dtype, size = item.properties.dtype, tuple(item.size)
        layout = optimizer.state_layout(param).get(entry) if ragged else None
        if len(path) > 4 or layout is None or layout == "tiles":
            shaped_like_param = size == tuple(shard.global_shape) and (size or entry in zero_dim_flat.get(name, ()))
            layout = "tiles" if len(path) > 4 else ("flat" if shaped_like_param else "scalar")
        if layout == "flat" and sharded:
            if size != tuple(shard.global_shape):
                raise CheckpointMismatchError(
                    f"optimizer state {entry!r} of {name!r} has shape {list(size)} in {info.path}, the parameter "
                    f"{list(shard.global_shape)}"
                )
            tensor = torch.empty(shard.local_numel, dtype=dtype, device=param.device)
            local[(name, entry)] = tensor
            wrapped = shard_as_dtensor(tensor, shard)
        elif layout.startswith("blocks:") and sharded:
            first, last, total = _block_range(shard, int(layout.split(":", 1)[1]))
            rest = size[1:]
            tensor = torch.empty((last - first, *rest), dtype=dtype, device=param.device)
            local[(name, entry)] = tensor
            boxes = [((first, *[0] * len(rest)), (last - first, *rest))] if last > first else []
            wrapped = boxes_as_dtensor(tensor.reshape(-1), boxes, (total, *rest), shard.process_group)
        else:  # scalars, tiles, and every state of an unsharded parameter: the whole saved tensor
            wrapped = torch.empty(size, dtype=dtype, device=param.device)
        if wrapped is not None:
            _set_path(template, path, wrapped)
    if unknown:
        raise CheckpointMismatchError(
            f"{info.path} {key!r} holds optimizer state for parameters the optimizer does not have: {_short(sorted(unknown))}"
        )
    with info.reading():
        dcp.load(template, storage_reader=info.reader(), planner=info.planner())
    saved = template.get(key, {})
    local_state: dict[str, dict[str, Any]] = saved.get("state", {})
    for (name, entry), tensor in local.items():
        local_state.setdefault(name, {})[entry] = tensor
    groups = saved.get("param_groups", [])
    current = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    saved_names = [list(group.get("params", [])) for group in groups]
    if saved_names != current:
        raise CheckpointMismatchError(
            f"{info.path} {key!r} was saved for other parameter groups: saved {saved_names}, optimizer has {current}"
        )
    if ragged:
        state = {
            "state": local_state,
            "param_groups": groups,
            "ragged": {},
        }
        optimizer.load_state_dict(state)
        return
    index = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            index[names[id(param)]] = len(index)
    torch_state = {}
    for name, entries in local_state.items():
        param = by_name[name]
        torch_state[index[name]] = {
            entry: (value.view(param.shape) if value.dim() and value.numel() == param.numel() and value.dim() != param.dim() else value)
            for entry, value in entries.items()
        }
    torch_groups = []
    for group, saved_group in zip(optimizer.param_groups, groups):
        restored = {k: v for k, v in saved_group.items() if k != "params"}
        restored["params"] = [index[names[id(p)]] for p in group["params"]]
        if "param_names" in group:
            restored["param_names"] = group["param_names"]
        torch_groups.append(restored)
    optimizer.load_state_dict({"state": torch_state, "param_groups": torch_groups})


# --------------------------------------------------------------------- convenience API
_DEFAULT_WRITER = CheckpointWriter()


def save(
    path: str | os.PathLike,
    module: nn.Module | None = None,
    optimizers: Iterable[torch.optim.Optimizer] = (),
    extra: Mapping[str, Any] | None = None,
    *,
    compress: bool = False,
    async_save: bool = False,
    full: bool = False,
    writer: CheckpointWriter | None = None,
) -> None:
    """Save a module (and optimizers, and picklable extras) as a sharded checkpoint directory (collective).

    ``full=True`` writes one ordinary single-file checkpoint instead (see ``CheckpointWriter.save``).
    """
    checkpoint: dict[str, Any] = dict(extra or {})
    if module is not None:
        checkpoint[MODEL_KEY] = sharded_model_state_dict(module)
    for index, optimizer in enumerate(optimizers):
        checkpoint[f"optimizer_{index}"] = sharded_optimizer_state_dict(module, optimizer)
    (writer or _DEFAULT_WRITER).save(checkpoint, path, compress=compress, async_save=async_save, full=full)


def wait_for_pending_save(writer: CheckpointWriter | None = None) -> None:
    (writer or _DEFAULT_WRITER).wait()


def load(
    path: str | os.PathLike,
    module: nn.Module | None = None,
    optimizers: Iterable[torch.optim.Optimizer] = (),
    *,
    strict: bool = True,
    weights_only: bool | None = None,
    trust_checkpoint: bool = False,
    verify_checksums: bool = True,
) -> dict[str, Any]:
    """Validate, then load the model and optimizers in place; return meta.pt's contents (the rest).

    ``path`` is a sharded checkpoint directory (any layout) or an ordinary single-file
    checkpoint (``full=True`` or consolidated; loaded memory-mapped, sliced to the shards).
    Pickles are read weights-only (``.metadata``: DCP's metadata types only) unless
    ``trust_checkpoint=True`` (or ``weights_only=False``): ``UntrustedCheckpointError``
    otherwise. Recorded checksums are verified (``ChecksumMismatchError`` naming the file and
    tensor) unless ``verify_checksums=False``.
    """
    if Path(path).is_file():
        return _load_file(
            Path(path), module, list(optimizers), strict=strict, weights_only=weights_only,
            trust_checkpoint=trust_checkpoint, verify_checksums=verify_checksums,
        )
    info = inspect_checkpoint(path, weights_only=weights_only, trust_checkpoint=trust_checkpoint, verify_checksums=verify_checksums)
    optimizers = list(optimizers)
    if module is not None:
        check_model_matches(info, expected_model_shapes(module), strict=strict)
    if optimizers and info.optimizer_count < len(optimizers):
        raise CheckpointMismatchError(
            f"{info.path} holds {info.optimizer_count} optimizer state(s), {len(optimizers)} optimizer(s) given"
            + (" (it was saved with weights only)" if info.optimizer_count == 0 else "")
        )
    if module is not None:
        load_sharded_model_state_dict(module, info, strict=strict)
    for index, optimizer in enumerate(optimizers):
        load_sharded_optimizer_state_dict(module, optimizer, info, f"optimizer_{index}")
    return {k: v for k, v in info.meta.items() if k != FORMAT_KEY}


# ---------------------------------------------------------------- single-file checkpoints
def _read_file(
    path: Path, weights_only: bool | None = None, *, trust_checkpoint: bool = False, verify_checksums: bool = True
) -> dict[str, Any]:
    """torch.load a single-file checkpoint memory-mapped: weights-only (never a silent fallback) unless trusted.

    With ``verify_checksums`` and a sidecar (``<file>.checksum.json``, written by our saves)
    the whole file is checked first (one streamed read); a file without one loads unverified.
    """
    trusted = _is_trusted(trust_checkpoint, weights_only)
    if verify_checksums:
        try:
            checksums.verify_file(path)
        except checksums.ChecksumMismatch as error:
            raise ChecksumMismatchError(f"{path} is corrupt: {error}", path) from error
    try:
        return safe_unpickle.torch_load(path, trusted=trusted, map_location="cpu", mmap=True)
    except Exception as error:
        if _is_refusal(error):
            raise _untrusted(path, error) from error
        raise CorruptCheckpointError(f"{path} is unreadable ({type(error).__name__}: {error})") from error


def _load_file(
    path: Path,
    module: nn.Module | None,
    optimizers: list[torch.optim.Optimizer],
    *,
    strict: bool,
    weights_only: bool | None,
    trust_checkpoint: bool = False,
    verify_checksums: bool = True,
) -> dict[str, Any]:
    checkpoint = _read_file(path, weights_only, trust_checkpoint=trust_checkpoint, verify_checksums=verify_checksums)
    if module is not None:
        load_full_model_state_dict(module, checkpoint.get("state_dict", checkpoint.get(MODEL_KEY, {})), strict=strict, source=path)
    states = checkpoint.get("optimizer_states", [])
    if optimizers and len(states) < len(optimizers):
        raise CheckpointMismatchError(f"{path} holds {len(states)} optimizer state(s), {len(optimizers)} optimizer(s) given")
    for optimizer, state in zip(optimizers, states):
        load_full_optimizer_state_dict(module, optimizer, state)
    return {k: v for k, v in checkpoint.items() if k not in ("state_dict", MODEL_KEY, "optimizer_states", FORMAT_KEY)}


def load_full_model_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True, source: Any = "the state dict"
) -> None:
    """Check keys and shapes, then copy this rank's pieces of full tensors into the shards (or the plain module)."""
    expected = expected_model_shapes(module)
    saved = {k: tuple(v.shape) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    _check_shapes(saved, expected, strict, source)
    sharded = _sharded_params(module)
    with torch.no_grad():
        for key, param in sharded.items():
            if key in state_dict:
                start, end = param.ragged_shard.local_range
                param.copy_(state_dict[key].reshape(-1)[start:end])
    rest = {k: v for k, v in state_dict.items() if k not in sharded and k in expected}
    if rest or not sharded:
        module.load_state_dict(rest, strict=False)


def load_full_optimizer_state_dict(module: nn.Module | None, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load a full (consolidated) optimizer state, slicing per-parameter states to this rank's shard."""
    if _is_ragged_optimizer(optimizer):
        optimizer.load_state_dict(dict(state) if "ragged" in state else {**state, "ragged": {}})
        return
    names = _optimizer_param_names(module, optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    named = state.get("format") == "torch" or any(isinstance(k, str) for k in state.get("state", {}))
    if named:  # our named layout (e.g. read back from a directory by other tools)
        index = {name: i for i, name in enumerate(n for g in state["param_groups"] for n in g["params"])}
        state = {
            "state": {index[name]: entries for name, entries in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]],
            **({ZERO_DIM_STATES_KEY: {index[n]: keys for n, keys in state[ZERO_DIM_STATES_KEY].items()}}
               if ZERO_DIM_STATES_KEY in state else {}),
        }
    saved_count = sum(len(g["params"]) for g in state["param_groups"])
    if saved_count != len(params):
        raise CheckpointMismatchError(f"optimizer state covers {saved_count} parameters, the optimizer has {len(params)}")
    shards = {idx: _shard_or_whole(params[idx], names.get(id(params[idx]), str(idx))) for idx in state["state"]}
    sharded = {idx for idx in shards if getattr(params[idx], "ragged_shard", None) is not None}
    zero_dim_flat: dict[Any, set[str]] = {}
    if any(len(shards[idx].global_shape) == 0 for idx in sharded):
        zero_dim_flat, unknown = _zero_dim_flat_keys(
            {idx: tuple(shard.global_shape) for idx, shard in shards.items()},
            {idx: {k: tuple(v.shape) for k, v in entries.items() if isinstance(v, torch.Tensor)} for idx, entries in state["state"].items()},
            state.get(ZERO_DIM_STATES_KEY),
        )
        _require_known_zero_dim_layout(
            {names.get(id(params[idx]), idx): keys for idx, keys in unknown.items() if idx in sharded}, "the optimizer state"
        )
    local_state = {}
    for idx, entries in state["state"].items():
        shard = shards[idx]
        local_entries = {}
        for key, value in entries.items():
            if (
                idx in sharded
                and isinstance(value, torch.Tensor)
                and tuple(value.shape) == tuple(shard.global_shape)
                and (value.dim() or key in zero_dim_flat.get(idx, ()))
            ):
                start, end = shard.local_range
                value = value.reshape(-1)[start:end]
            local_entries[key] = value.clone() if isinstance(value, torch.Tensor) else value
        local_state[idx] = local_entries
    optimizer.load_state_dict({"state": local_state, "param_groups": state["param_groups"]})


# ------------------------------------------------------------------- Lightning glue
class LightningCheckpointIO:
    """What ``RaggedFSDPStrategy`` does for checkpoints; the strategy only delegates here.

    * ``state_dict()`` / ``optimizer_state()``: DTensor views of the shards (no gather).
    * ``save()``: a sharded directory (``state_dict_type="sharded"``) or one ordinary file
      (``"full"``), atomically, optionally Zstandard-compressed and/or asynchronous.
    * ``load()``: validates, loads the model and (when fitting) the optimizers in place
      at the current layout, and returns the rest for Lightning (loops, callbacks,
      schedulers). A weights-only checkpoint resumes the weights and warns that the
      optimizer state is absent. Ordinary single-file checkpoints load too.
    * ``remove()``: directories, files and ``save_last="link"`` symlinks.
    """

    def __init__(
        self,
        state_dict_type: str = "sharded",
        compress: bool = False,
        async_save: bool = False,
        *,
        trust_checkpoint: bool = False,
        verify_checksums: bool = True,
    ) -> None:
        self.state_dict_type = state_dict_type
        self.compress = compress
        self.async_save = async_save
        self.trust_checkpoint = trust_checkpoint  # full unpickling of meta.pt / .metadata / .ckpt: only for files you trust
        self.verify_checksums = verify_checksums
        self.writer = CheckpointWriter()

    def state_dict(self, module: nn.Module) -> dict[str, Any]:
        return sharded_model_state_dict(module)

    def optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return sharded_optimizer_state_dict(module, optimizer)

    def save(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(
                "RaggedFSDPStrategy.save_checkpoint(..., storage_options=...) is not supported: checkpoints are "
                "written with torch.distributed.checkpoint, not a CheckpointIO plugin"
            )
        self.writer.save(
            checkpoint,
            path,
            compress=self.compress,
            async_save=self.async_save,
            full=self.state_dict_type == "full",
        )

    def load(
        self,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        path: str | os.PathLike,
        *,
        fitting: bool,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        self.writer.wait()
        path = Path(path)
        trust = {"trust_checkpoint": self.trust_checkpoint, "verify_checksums": self.verify_checksums}
        if path.is_file():
            checkpoint = _read_file(path, weights_only, **trust)
            state_dict = checkpoint.get("state_dict", checkpoint.get(MODEL_KEY, {}))
            load_full_model_state_dict(module, state_dict, strict=strict, source=path)
            states = list(checkpoint.get("optimizer_states", []))
            rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", MODEL_KEY, "optimizer_states", FORMAT_KEY)}
            optimizer_count = len(states)
            load_optimizers = lambda: [  # noqa: E731
                load_full_optimizer_state_dict(module, optimizer, state) for optimizer, state in zip(optimizers, states)
            ]
        else:
            info = inspect_checkpoint(path, weights_only=weights_only, **trust)
            check_model_matches(info, expected_model_shapes(module), strict=strict)
            load_sharded_model_state_dict(module, info, strict=strict)
            rest = {k: v for k, v in info.meta.items() if k != FORMAT_KEY}
            optimizer_count = info.optimizer_count
            load_optimizers = lambda: [  # noqa: E731
                load_sharded_optimizer_state_dict(module, optimizer, info, f"optimizer_{i}")
                for i, optimizer in enumerate(optimizers)
            ]
        if fitting and optimizers:
            if optimizer_count == 0:
                _rank_zero_warn(
                    f"{path} was saved with weights only (e.g. ModelCheckpoint(save_weights_only=True)): the model "
                    "weights are restored, but the optimizer and LR-scheduler states are absent, so the optimizers "
                    "start fresh."
                )
                rest.setdefault("lr_schedulers", [])
            elif optimizer_count != len(optimizers):
                raise CheckpointMismatchError(
                    f"{path} holds {optimizer_count} optimizer state(s) but the LightningModule configures "
                    f"{len(optimizers)} optimizer(s)"
                )
            else:
                load_optimizers()
        return rest

    def remove(self, path: str | os.PathLike) -> None:
        """Rank 0 only (Lightning calls it on every rank and filters)."""
        pending = self.writer.pending
        if pending is not None:
            pending.wait()  # never delete next to a directory that is still being renamed
        checksums.remove_sidecar(path)  # a single file's checksum goes with it (a symlink's target keeps its own)
        remove_checkpoint(path)

    def teardown(self) -> None:
        pending, self.writer.pending = self.writer.pending, None
        if pending is not None:
            pending.wait()


def _rank_zero_warn(message: str) -> None:
    if _is_rank_zero():
        warnings.warn(message, stacklevel=3)
