"""The original parameters ``fully_shard`` replaced by its shards: their gradient hooks carried over, their optimizers refused.

``fully_shard`` puts new parameters (views into each rank's DBuffer segment) in the modules. A
gradient hook the user registered on an original (``p.register_hook(fn)``: masking the rows of an
embedding, scaling) moves to the full parameter autograd computes with, so it runs on each rank's local
gradient before the reduction, as under DDP (FSDP2 drops it); a ``register_post_accumulate_grad_hook``
one moves to the shard, where it runs with the reduced gradient (``sharded_grad.py``), as one registered
after sharding. An optimizer built before ``fully_shard`` (a common slip when porting a training loop)
still holds the originals: they never get a gradient again, so every step silently trains nothing (as
under FSDP2). The originals are marked, and a check before optimizer steps (``optimizer_checks.py``)
refuses such a step, naming a parameter and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.optim import Optimizer

from lightning_ragged.engine.optimizer_checks import check_before_steps

_NAME = "_ragged_replaced_as"


def retire(replaced: Iterable[tuple[str, nn.Parameter, nn.Parameter, nn.Parameter]]) -> None:
    """Mark each original parameter ``fully_shard`` took out of the modules and carry its gradient hooks over.

    ``replaced``: ``(name, original, full, shard)``, the full parameter being the one forward computes with.
    """
    for name, original, full, shard in replaced:
        setattr(original, _NAME, name)
        if original.is_meta:  # a construction recorded on the meta device is bound to it (``init_record.py``)
            shard.ragged_meta_original = original
        for hook in (getattr(original, "_backward_hooks", None) or {}).values():
            full.register_hook(hook)
        for hook in (getattr(original, "_post_accumulate_grad_hooks", None) or {}).values():
            shard.register_post_accumulate_grad_hook(hook)
    check_before_steps(_refuse_retired)


def _refuse_retired(optimizer: Optimizer) -> None:
    retired = [getattr(p, _NAME) for group in optimizer.param_groups for p in group["params"] if hasattr(p, _NAME)]
    if retired:
        raise ValueError(
            f"{type(optimizer).__name__} holds {len(retired)} parameters that lightning_ragged.fully_shard replaced "
            f"by its shards (e.g. {retired[0]!r}): they get no gradient, so this step would train nothing. Build "
            "the optimizer after fully_shard, from model.parameters() (or pass both to fabric.setup)"
        )
