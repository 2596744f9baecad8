"""``load``: validate a checkpoint (directory or single file), then load a model and its optimizers in place."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from lightning_ragged.checkpoint.errors import CheckpointMismatchError
from lightning_ragged.checkpoint.model_state import load_sharded_model_state_dict
from lightning_ragged.checkpoint.optimizer_state import load_sharded_optimizer_state_dict
from lightning_ragged.checkpoint.reader import check_model_matches, inspect_checkpoint
from lightning_ragged.checkpoint.single_file import load_file
from lightning_ragged.engine.checks import check_flag, check_optimizer_list
from lightning_ragged.engine.state_dict_checks import expected_model_shapes

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
    check_flag("strict", strict)
    check_flag("verify_checksums", verify_checksums)
    check_optimizer_list(optimizers)
    if Path(path).is_file():
        return load_file(
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
    return info.rest()
