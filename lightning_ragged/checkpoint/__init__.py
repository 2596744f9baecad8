"""Sharded checkpoints: ragged shards as DCP chunks, atomic publish, validation, consolidation.

``format.py`` the on-disk format · ``errors.py`` what can be wrong · ``dcp.py`` shards as
DTensors · ``model_state.py`` / ``optimizer_state.py`` (+ ``zero_dim.py``) state dicts both
ways · ``atomic_dir.py`` one-rename publishing · ``writer.py`` saving (sync/async) ·
``reader.py`` validation and inspection · ``loading.py`` / ``single_file.py`` loading ·
``consolidation.py`` one ordinary file · ``hf_export.py`` Hugging Face safetensors · ``checksums.py``, ``safe_unpickle.py``,
``timeout.py`` integrity, trust and named save timeouts.
"""

from lightning_ragged.checkpoint.atomic_dir import OLD_PREFIX, TMP_PREFIX, partial_path, remove_checkpoint
from lightning_ragged.checkpoint.consolidation import consolidate
from lightning_ragged.checkpoint.hf_export import export_hf
from lightning_ragged.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointVersionError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    MissingCheckpointError,
    UntrustedCheckpointError,
)
from lightning_ragged.checkpoint.format import FORMAT_KEY, FORMAT_VERSION, META_FILENAME
from lightning_ragged.checkpoint.loading import load
from lightning_ragged.checkpoint.model_state import sharded_model_state_dict
from lightning_ragged.checkpoint.optimizer_state import NamedStateOptimizer, sharded_optimizer_state_dict
from lightning_ragged.checkpoint.reader import CheckpointInfo, inspect_checkpoint, is_sharded_checkpoint
from lightning_ragged.checkpoint.timeout import CheckpointPeerLostError, CheckpointTimeoutError
from lightning_ragged.checkpoint.writer import CheckpointWriter, save, wait_for_pending_save

__all__ = [
    "FORMAT_KEY",
    "FORMAT_VERSION",
    "META_FILENAME",
    "OLD_PREFIX",
    "TMP_PREFIX",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CheckpointPeerLostError",
    "CheckpointTimeoutError",
    "CheckpointVersionError",
    "CheckpointWriter",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "MissingCheckpointError",
    "NamedStateOptimizer",
    "UntrustedCheckpointError",
    "consolidate",
    "export_hf",
    "inspect_checkpoint",
    "is_sharded_checkpoint",
    "load",
    "partial_path",
    "remove_checkpoint",
    "save",
    "sharded_model_state_dict",
    "sharded_optimizer_state_dict",
    "wait_for_pending_save",
]
