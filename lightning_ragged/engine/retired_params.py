"""Refuse an optimizer step over parameters ``fully_shard`` replaced by its shards.

``fully_shard`` puts new parameters (views into each rank's DBuffer segment) in the modules. An
optimizer built before it (a common slip when porting a training loop) still holds the original
parameters: they never get a gradient again, so every step silently trains nothing (as under FSDP2).
The originals are marked here, and one process-wide optimizer step pre-hook refuses such a step,
naming a parameter and the fix. It looks at an optimizer again only when its parameter count changes
(``add_param_group``), so a step costs one sum over its groups.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

_NAME = "_ragged_replaced_as"
_checked: "weakref.WeakKeyDictionary[Optimizer, int]" = weakref.WeakKeyDictionary()
_installed = False


def retire(params: Iterable[tuple[str, nn.Parameter]]) -> None:
    """Mark the original parameters ``fully_shard`` took out of the modules (``name`` is the one it sharded)."""
    global _installed
    for name, param in params:
        setattr(param, _NAME, name)
    if not _installed:
        register_optimizer_step_pre_hook(_refuse_retired)
        _installed = True


def _refuse_retired(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _checked.get(optimizer) == count:
        return
    retired = [getattr(p, _NAME) for group in optimizer.param_groups for p in group["params"] if hasattr(p, _NAME)]
    if retired:
        raise ValueError(
            f"{type(optimizer).__name__} holds {len(retired)} parameters that lightning_ragged.fully_shard replaced "
            f"by its shards (e.g. {retired[0]!r}): they get no gradient, so this step would train nothing. Build "
            "the optimizer after fully_shard, from model.parameters() (or pass both to fabric.setup)"
        )
    _checked[optimizer] = count
