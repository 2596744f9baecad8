"""Turn a sharded checkpoint directory into one ordinary Lightning ``.ckpt`` file, tensor by tensor.

    python -m lightning_ragged.consolidate CKPT_DIR OUT.ckpt

The result is a plain ``torch.save`` file with ``"state_dict"`` (original names and shapes),
``"optimizer_states"`` and everything Lightning keeps in ``meta.pt`` (loops, callbacks,
schedulers, hparams): ``LightningModule.load_from_checkpoint`` and ``Trainer.fit(ckpt_path=...)``
read it with no lightning_ragged installed. Optimizer states of ``torch.optim`` optimizers are
converted back to torch's index-keyed layout; those of ``lightning_ragged.optim``
optimizers keep their named layout (their ``load_state_dict`` accepts full states).

Memory stays small whatever the model size: the file is first written with every tensor's
bytes skipped (``torch.serialization.skip_data``), then memory-mapped (shared) and filled
one batch of tensors at a time straight from the DCP shards. No process ever holds the
whole model. The output is written to a hidden sibling and renamed into place when done.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_ragged.checkpoint.core import FORMAT_KEY, MODEL_KEY, ZERO_DIM_STATES_KEY, CheckpointInfo, inspect_checkpoint
from lightning_ragged.checkpoint.checksums import remove_sidecar, write_sidecar
from lightning_ragged.checkpoint.safe_unpickle import torch_load

BATCH_BYTES = 256 * 2**20
"""Tensors filled per DCP read (a bound on the extra memory consolidation uses)."""


def consolidate(
    checkpoint_dir: str | os.PathLike,
    output_file: str | os.PathLike,
    *,
    weights_only: bool | None = None,
    trust_checkpoint: bool = False,
    verify_checksums: bool = True,
    batch_bytes: int = BATCH_BYTES,
) -> Path:
    """Write ``checkpoint_dir`` (a sharded checkpoint) as the single file ``output_file``; return its path.

    The input is read without running code (``.metadata``: DCP's metadata types; ``meta.pt``
    and pickled items: weights-only) unless ``trust_checkpoint=True``, and its shards are
    verified against their checksums unless ``verify_checksums=False``. The output gets a
    checksum sidecar ``OUT.ckpt.checksum.json`` (lightning_ragged verifies it when loading).
    """
    info = inspect_checkpoint(
        checkpoint_dir, weights_only=weights_only, trust_checkpoint=trust_checkpoint, verify_checksums=verify_checksums
    )
    output = Path(output_file)
    part = output.with_name(f".{output.name}.partial")
    write_full_checkpoint(info, part, batch_bytes=batch_bytes)
    remove_sidecar(output)
    os.replace(part, output)
    write_sidecar(output)
    return output


def write_full_checkpoint(info: CheckpointInfo, output: Path, *, batch_bytes: int = BATCH_BYTES) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    metadata = info.metadata
    planner_data = metadata.planner_data or {}
    tensor_keys = [k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
    nested: dict[str, Any] = _load_objects(info, [k for k in metadata.state_dict_metadata if k not in tensor_keys])

    fake_mode = FakeTensorMode()
    for key in tensor_keys:
        item = metadata.state_dict_metadata[key]
        with fake_mode:
            fake = torch.empty(tuple(item.size), dtype=item.properties.dtype)
        _set(nested, planner_data.get(key, (key,)), fake)

    checkpoint, locate = _to_lightning_layout(nested, info)
    # Real tensors outside DCP (meta.pt: e.g. a callback's best score) are skipped by
    # skip_data too: swap them for fakes and write them back after the mmap load.
    real: list[tuple[tuple, torch.Tensor]] = []
    for path, value in list(_walk(checkpoint)):
        if isinstance(value, torch.Tensor) and not _is_fake(value):
            with fake_mode:
                fake = torch.empty(value.shape, dtype=value.dtype)
            real.append((path, value))
            _set(checkpoint, path, fake)

    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(checkpoint, output)
    del checkpoint
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        # Our own file, holding only what meta.pt held: weights-only unless that was trusted.
        mapped = torch_load(output, trusted=info.trusted, mmap=True, map_location="cpu")
    for path, value in real:
        _get(mapped, path).copy_(value)

    batch: dict[str, Any] = {}
    size = 0
    for key in tensor_keys:
        target = _get(mapped, locate(planner_data.get(key, (key,))))
        _set(batch, planner_data.get(key, (key,)), target)
        size += target.numel() * target.element_size()
        if size >= batch_bytes:
            _read_into(info, batch)
            batch, size = {}, 0
    if batch:
        _read_into(info, batch)
    del mapped, batch
    with open(output, "rb+") as handle:
        os.fsync(handle.fileno())


def _read_into(info: CheckpointInfo, template: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    with info.reading():  # shards verified against their checksums, pickled items weights-only unless trusted
        _load_state_dict(template, storage_reader=info.reader(), planner=info.planner(allow_partial_load=True), no_dist=True)


def _load_objects(info: CheckpointInfo, keys: list[str]) -> dict[str, Any]:
    """The checkpoint's non-tensor entries (param groups, formats) as a nested dict."""
    planner_data = info.metadata.planner_data or {}
    template: dict[str, Any] = {}
    for key in keys:
        _set(template, planner_data.get(key, (key,)), None)
    if keys:
        _read_into(info, template)
    return template


def _to_lightning_layout(nested: dict[str, Any], info: CheckpointInfo) -> tuple[dict[str, Any], Any]:
    """Lightning's single-file layout, and a function mapping a DCP path to its place in it."""
    checkpoint: dict[str, Any] = {k: v for k, v in info.meta.items() if k != FORMAT_KEY}
    checkpoint["state_dict"] = nested.get(MODEL_KEY, {})
    count = sum(1 for k in nested if k.startswith("optimizer_"))
    renames: dict[int, dict[str, int]] = {}
    states = []
    for index in range(count):
        state = nested[f"optimizer_{index}"]
        if state.get("format") == "torch":
            state, renames[index] = _to_torch_optimizer_layout(state)
        states.append(state)
    if count:
        checkpoint["optimizer_states"] = states
    checkpoint[FORMAT_KEY] = {"consolidated_from": str(info.path), **info.format}

    def locate(path: tuple) -> tuple:
        head, rest = path[0], tuple(path[1:])
        if head == MODEL_KEY:
            return ("state_dict", *rest)
        index = int(str(head).split("_", 1)[1])
        if index in renames and len(rest) >= 2 and rest[0] == "state":
            rest = ("state", renames[index][rest[1]], *rest[2:])
        return ("optimizer_states", index, *rest)

    return checkpoint, locate


def _to_torch_optimizer_layout(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, int]]:
    """Named state ({"state": {name: ...}, "param_groups": [{"params": [names]}]}) -> torch's index-keyed one."""
    index: dict[str, int] = {}
    groups = []
    for group in state.get("param_groups", []):
        converted = dict(group)
        converted["params"] = []
        for name in group["params"]:
            index[name] = len(index)
            converted["params"].append(index[name])
        groups.append(converted)
    named = state.get("state", {})
    converted_state = {"state": {index[name]: entries for name, entries in named.items()}, "param_groups": groups}
    if ZERO_DIM_STATES_KEY in state:  # which states of 0-D parameters are per-element (torch ignores the key)
        converted_state[ZERO_DIM_STATES_KEY] = {index[name]: list(keys) for name, keys in state[ZERO_DIM_STATES_KEY].items()}
    return converted_state, index


def _is_fake(value: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def _walk(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, (*path, key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _walk(item, (*path, index))
    else:
        yield path, value


def _get(root: Any, path: tuple) -> Any:
    for key in path:
        root = root[key]
    return root


def _set(root: Any, path: tuple, value: Any) -> None:
    """Set ``root[path]``, creating dicts (str keys) and lists (int keys) on the way."""
    for position, key in enumerate(path[:-1]):
        following = path[position + 1]
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(root, list):
            while len(root) <= key:
                root.append(None)
            if root[key] is None:
                root[key] = empty
        elif key not in root or root[key] is None:
            root[key] = empty
        root = root[key]
    last = path[-1]
    if isinstance(root, list):
        while len(root) <= last:
            root.append(None)
        root[last] = value
    elif isinstance(root, tuple):
        raise TypeError(f"cannot set an element of a tuple at {path}")
    else:
        root[last] = value
