"""``FullyShardedDataParallel``: the wrapper-class spelling of ``fully_shard``.

For code written in the ``model = FSDP(model)`` style. Parameter names gain the
``module.`` prefix, as with DDP; ``fully_shard`` keeps names unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from lightning_ragged.engine.api import fully_shard, get_state, no_sync
from lightning_ragged.engine.state_dict import full_state_dict


class FullyShardedDataParallel(nn.Module):
    """Wraps ``module`` and shards it in place with ``fully_shard(module, **kwargs)``."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.module = fully_shard(module, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no collective) for the backward passes inside."""
        with no_sync(self.module):
            yield

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors of the wrapped module, keyed without the ``module.`` prefix."""
        return full_state_dict(self.module)

    def reshard(self) -> None:
        """Free every unsharded buffer."""
        get_state(self.module).reshard()
