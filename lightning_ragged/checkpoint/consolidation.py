"""Turn a sharded checkpoint directory into one ordinary Lightning ``.ckpt`` file, tensor by tensor.

    python -m lightning_ragged.consolidate CKPT_DIR OUT.ckpt

The result is a plain ``torch.save`` file with ``"state_dict"`` (original names and shapes),
``"optimizer_states"`` and everything Lightning keeps in ``meta.pt`` (loops, callbacks,
schedulers, hparams): ``LightningModule.load_from_checkpoint`` and ``Trainer.fit(ckpt_path=...)``
read it with no lightning_ragged installed. A checkpoint ``fabric.save`` wrote keeps its state's own keys
(``"model"``, ``"optimizer"``, as Fabric's files). Optimizer states of ``torch.optim`` optimizers are
converted back to torch's index-keyed layout; those of ``lightning_ragged.optim``
optimizers keep their named layout (their ``load_state_dict`` accepts full states).

Memory stays small whatever the model size: the file is first written with every tensor's
bytes skipped (``torch.serialization.skip_data``), then memory-mapped (shared) and filled
one batch of tensors at a time straight from the DCP shards. No process ever holds the
whole model. The output is written to a hidden sibling and renamed into place when done.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.utils._pytree import key_get, tree_flatten_with_path, tree_map

from lightning_ragged.checkpoint.checksums import remove_sidecar, write_sidecar
from lightning_ragged.checkpoint.errors import CheckpointError
from lightning_ragged.checkpoint.format import FORMAT_KEY, MODEL_KEY, MODEL_STATES_KEY, USER_KEYS
from lightning_ragged.checkpoint.metadata_checks import OPTIMIZER_KEY
from lightning_ragged.checkpoint.reader import CheckpointInfo, inspect_checkpoint
from lightning_ragged.checkpoint.safe_unpickle import torch_load
from lightning_ragged.checkpoint.zero_dim import ZERO_DIM_STATES_KEY

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
    if output.resolve() == info.path.resolve() or info.path.resolve() in output.resolve().parents:
        raise ValueError(f"output_file={str(output_file)!r} is inside the checkpoint it consolidates ({info.path}): "
                         "writing it there would replace the checkpoint's own files; choose a path outside it")
    if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes <= 0:
        raise ValueError(f"batch_bytes={batch_bytes!r} must be a positive int (bytes per read; default {BATCH_BYTES})")
    part = output.with_name(f".{output.name}.partial")
    part.unlink(missing_ok=True)  # an earlier run's leftover; a link is removed, never written through
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
        set_element(nested, planner_data.get(key, (key,)), fake)

    checkpoint, locate = _to_lightning_layout(nested, info)
    # Real tensors outside DCP (meta.pt: e.g. a callback's best score) are skipped by
    # skip_data too: swap them for fakes and write them back after the mmap load.
    real = [(path, value) for path, value in tree_flatten_with_path(checkpoint)[0] if _is_real(value)]
    _require_all_found(checkpoint, len(real), info.path)

    def fake_of(value: Any) -> Any:
        if not _is_real(value):
            return value
        with fake_mode:
            return torch.empty(value.shape, dtype=value.dtype)

    checkpoint = tree_map(fake_of, checkpoint)

    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(checkpoint, output)
    del checkpoint
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        # Our own file, holding only what meta.pt held: weights-only unless that was trusted.
        mapped = torch_load(output, trusted=info.trusted, mmap=True, map_location="cpu")
    for path, value in real:
        key_get(mapped, path).copy_(value)

    batch: dict[str, Any] = {}
    size = 0
    for key in tensor_keys:
        target = _get(mapped, locate(planner_data.get(key, (key,))))
        set_element(batch, planner_data.get(key, (key,)), target)
        size += target.numel() * target.element_size()
        if size >= batch_bytes:
            info.read_locally(batch)  # shards verified against their checksums, pickled items weights-only unless trusted
            batch, size = {}, 0
    if batch:
        info.read_locally(batch)
    del mapped, batch
    with open(output, "rb+") as handle:
        os.fsync(handle.fileno())


def _load_objects(info: CheckpointInfo, keys: list[str]) -> dict[str, Any]:
    """The checkpoint's non-tensor entries (param groups, formats) as a nested dict."""
    planner_data = info.metadata.planner_data or {}
    template: dict[str, Any] = {}
    for key in keys:
        set_element(template, planner_data.get(key, (key,)), None)
    if keys:
        info.read_locally(template)
    return template


def _to_lightning_layout(nested: dict[str, Any], info: CheckpointInfo) -> tuple[dict[str, Any], Any]:
    """Lightning's single-file layout, and a function mapping a DCP path to its place in it."""
    checkpoint: dict[str, Any] = {k: v for k, v in info.meta.items() if k != FORMAT_KEY}
    user = info.meta.get(USER_KEYS)  # fabric.save's state: its own keys, as Fabric's files (torch.load(f)["model"])
    module_key = user["module"] if user else "state_dict"
    checkpoint[module_key] = nested.get(MODEL_KEY, {})
    model_states = info.format.get(MODEL_STATES_KEY, [])  # e.g. WeightAveraging's "current_model_state"
    for key in model_states:
        checkpoint[key] = nested.get(key, {})
    count = sum(1 for k in nested if OPTIMIZER_KEY.fullmatch(k))
    others = [k for k in nested if k != MODEL_KEY and k not in model_states and not OPTIMIZER_KEY.fullmatch(k)]
    for key in others:  # a Fabric state's own entries (a GAN's "optimizer_g"): kept under their names
        checkpoint[key] = nested[key]
    renames: dict[int, dict[str, int]] = {}
    states = []
    for index in range(count):
        state = nested[f"optimizer_{index}"]
        if state.get("format") == "torch":
            state, renames[index] = _to_torch_optimizer_layout(state)
        states.append(state)
    if count and user:
        checkpoint.update(zip(user["optimizers"], states))
    elif count:
        checkpoint["optimizer_states"] = states
    checkpoint[FORMAT_KEY] = {"consolidated_from": str(info.path), **info.format}

    def locate(path: tuple) -> tuple:
        head, rest = path[0], tuple(path[1:])
        if head == MODEL_KEY:
            return (module_key, *rest)
        if head in model_states or head in others:
            return (head, *rest)
        index = int(str(head).split("_", 1)[1])
        if index in renames and len(rest) >= 2 and rest[0] == "state":
            rest = ("state", renames[index][rest[1]], *rest[2:])
        return (user["optimizers"][index], *rest) if user else ("optimizer_states", index, *rest)

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


def _is_real(value: Any) -> bool:
    """A tensor with data (not one of the fakes standing in for the DCP tensors)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor)


def _require_all_found(checkpoint: Any, found: int, source: Any) -> None:
    """Refuse to write a file that would silently lack data: ``skip_data`` drops every real tensor, and
    only those pytree reaches are written back, so one inside a container pytree does not know (a
    user's dict subclass, an object's attribute) would come out empty. Pickling counts them all."""
    pickled = 0

    class _Counter(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            nonlocal pickled
            if isinstance(obj, torch.Tensor):
                pickled += _is_real(obj)
                return id(obj)  # do not descend into the tensor
            return None

    _Counter(io.BytesIO()).dump(checkpoint)
    if pickled != found:
        raise CheckpointError(
            f"{source}: meta.pt holds {pickled - found} tensor(s) inside containers consolidation cannot walk "
            "(e.g. a dict subclass or an object's attribute); nothing was written. Keep such values in plain "
            "dicts/lists/tuples, or load the sharded checkpoint directly (lightning_ragged.checkpoint.load)"
        )


def _get(root: Any, path: tuple) -> Any:
    """``root[path[0]][path[1]]...`` (torch's ``get_element`` indexes only lists by int; torch-layout optimizer states are dicts keyed by int)."""
    for key in path:
        root = root[key]
    return root
