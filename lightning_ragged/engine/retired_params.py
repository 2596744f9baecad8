"""The original parameters ``fully_shard`` replaced by its shards: their gradient hooks carried over, their optimizers refused.

``fully_shard`` puts new parameters (views into each rank's DBuffer segment) in the modules. A
gradient hook the user registered on an original (``p.register_hook(fn)``: masking the rows of an
embedding, scaling) moves to the full parameter autograd computes with, so it runs on each rank's local
gradient before the reduction, as under DDP (FSDP2 drops it); a ``register_post_accumulate_grad_hook``
one moves to the shard, where it runs with the reduced gradient (``sharded_grad.py``), as one registered
after sharding. An optimizer built before ``fully_shard`` (a common slip when porting a training loop)
still holds the originals: they never get a gradient again, so every step silently trains nothing (as
under FSDP2). The originals are marked, and one process-wide optimizer step pre-hook refuses such a
step, naming a parameter and the fix. It looks at an optimizer again only when its parameter count
changes (``add_param_group``), so a step costs one sum over its groups.
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


def retire(replaced: Iterable[tuple[str, nn.Parameter, nn.Parameter, nn.Parameter]]) -> None:
    """Mark each original parameter ``fully_shard`` took out of the modules and carry its gradient hooks over.

    ``replaced``: ``(name, original, full, shard)``, the full parameter being the one forward computes with.
    """
    global _installed
    for name, original, full, shard in replaced:
        setattr(original, _NAME, name)
        for hook in (getattr(original, "_backward_hooks", None) or {}).values():
            full.register_hook(hook)
        for hook in (getattr(original, "_post_accumulate_grad_hooks", None) or {}).values():
            shard.register_post_accumulate_grad_hook(hook)
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
