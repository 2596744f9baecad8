"""Why a checkpoint cannot be used: the ``CheckpointError`` family, and the trust decision and its message."""

from __future__ import annotations

import os
from typing import Any

from lightning_ragged.checkpoint import safe_unpickle
from lightning_ragged.engine.checks import check_flag


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


TRUST_HINT = (
    "Refused: unpickling it could run arbitrary code. If you trust whoever wrote this checkpoint, load it with "
    "trust_checkpoint=True (RaggedFSDPStrategy(trust_checkpoint=True), lightning_ragged.checkpoint.load(..., "
    "trust_checkpoint=True), python -m lightning_ragged.consolidate --trust-checkpoint); to allow only your own "
    "types, register them with torch.serialization.add_safe_globals([...])."
)


def is_trusted(trust_checkpoint: bool, weights_only: bool | None) -> bool:
    """Full unpickling only on request: ``trust_checkpoint=True`` or an explicit ``weights_only=False`` (bools
    only: ``trust_checkpoint="no"`` is a non-empty string, and read as a flag it would run the file's code)."""
    check_flag("trust_checkpoint", trust_checkpoint)
    if weights_only is not None:
        check_flag("weights_only", weights_only)
    if trust_checkpoint and weights_only:
        raise ValueError("trust_checkpoint=True contradicts weights_only=True; pass one of them")
    return bool(trust_checkpoint) or weights_only is False


def untrusted(source: Any, error: BaseException) -> UntrustedCheckpointError:
    """The refusal, naming the file and the first global that was not allowed."""
    detail = safe_unpickle.refusal_detail(error)
    return UntrustedCheckpointError(f"{source} holds objects beyond tensors and plain containers ({detail}). {TRUST_HINT}")


is_refusal = safe_unpickle.is_refusal
