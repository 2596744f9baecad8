"""Sharded checkpoints: torch.distributed.checkpoint with ragged shards, atomic publish, validation, consolidation."""

from lightning_ragged.checkpoint.core import *  # noqa: F401,F403  (temporary during the split)
from lightning_ragged.checkpoint.core import _hidden_sibling  # noqa: F401
