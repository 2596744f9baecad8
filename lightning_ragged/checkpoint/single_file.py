"""Loading an ordinary single-file checkpoint (``state_dict_type="full"``, or consolidated) into a sharded model.

The file is read memory-mapped, weights-only unless trusted, after its checksum sidecar
(``<file>.checksum.json``) is verified; the full tensors are then sliced to this rank's
shards, so a file written at any world size (or by plain Lightning) loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_ragged.checkpoint import checksums, safe_unpickle
from lightning_ragged.checkpoint.errors import (
    CheckpointMismatchError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    is_refusal,
    is_trusted,
    untrusted,
)
from lightning_ragged.checkpoint.format import FORMAT_KEY, MODEL_KEY
from lightning_ragged.checkpoint.model_state import load_full_model_state_dict
from lightning_ragged.checkpoint.optimizer_state import load_full_optimizer_state_dict

def read_file(
    path: Path, weights_only: bool | None = None, *, trust_checkpoint: bool = False, verify_checksums: bool = True
) -> dict[str, Any]:
    """torch.load a single-file checkpoint memory-mapped: weights-only (never a silent fallback) unless trusted.

    With ``verify_checksums`` and a sidecar (``<file>.checksum.json``, written by our saves)
    the whole file is checked first (one streamed read); a file without one loads unverified.
    """
    trusted = is_trusted(trust_checkpoint, weights_only)
    if verify_checksums:
        try:
            checksums.verify_file(path)
        except checksums.ChecksumMismatch as error:
            raise ChecksumMismatchError(f"{path} is corrupt: {error}", path) from error
    try:
        return safe_unpickle.torch_load(path, trusted=trusted, map_location="cpu", mmap=True)
    except Exception as error:
        if is_refusal(error):
            raise untrusted(path, error) from error
        raise CorruptCheckpointError(f"{path} is unreadable ({type(error).__name__}: {error})") from error


def load_file(
    path: Path,
    module: nn.Module | None,
    optimizers: list[torch.optim.Optimizer],
    *,
    strict: bool,
    weights_only: bool | None,
    trust_checkpoint: bool = False,
    verify_checksums: bool = True,
) -> dict[str, Any]:
    """Load the file's model and optimizer states into ``module`` and ``optimizers``; return the rest."""
    checkpoint = read_file(path, weights_only, trust_checkpoint=trust_checkpoint, verify_checksums=verify_checksums)
    if module is not None:
        load_full_model_state_dict(module, checkpoint.get("state_dict", checkpoint.get(MODEL_KEY, {})), strict=strict, source=path)
    states = checkpoint.get("optimizer_states", [])
    if optimizers and len(states) < len(optimizers):
        raise CheckpointMismatchError(f"{path} holds {len(states)} optimizer state(s), {len(optimizers)} optimizer(s) given")
    for optimizer, state in zip(optimizers, states):
        load_full_optimizer_state_dict(module, optimizer, state)
    return rest_of_file(checkpoint)


def rest_of_file(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What a single file holds besides the model, the optimizer states and our format record (loops, callbacks, ...)."""
    return {k: v for k, v in checkpoint.items() if k not in ("state_dict", MODEL_KEY, "optimizer_states", FORMAT_KEY)}
