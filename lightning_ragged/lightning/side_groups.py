"""Gloo groups over the whole world beside the default group, one per purpose and default group.

The exception agreement (a bounded ``monitored_barrier``) and the signal flags (CPU integers under
NCCL) need collectives on CPU tensors with timeouts of their own. ``new_group`` is collective, so each
is built the first time at a point every rank reaches (the strategy's setup) and reused after; a
re-initialized default group is another object and gets new ones (the old object is held, so its
``id`` never names another group).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

_GROUPS: dict[tuple[str, int], tuple[Any, dist.ProcessGroup]] = {}


def gloo_group(purpose: str, timeout: Optional[timedelta]) -> dist.ProcessGroup:
    """The gloo group for ``purpose`` over the default group's ranks (built with ``timeout`` the first time)."""
    default = dist.distributed_c10d._get_default_group()
    key = (purpose, id(default))
    if key not in _GROUPS:
        _GROUPS[key] = (default, dist.new_group(backend="gloo", **({"timeout": timeout} if timeout else {})))
    return _GROUPS[key][1]
