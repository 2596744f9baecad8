"""Which ``fully_shard`` call sharded each parameter: one owner per parameter.

A parameter shared by modules sharded in separate calls (a weight tied across blocks in FSDP2's
call pattern) would become two independent shards, untied without a word; FSDP2 refuses it, and
so does ``fully_shard``. The registry holds, weakly and by identity, the parameters a call was
given and the shard objects it made (a submodule shared by two blocks holds the first's shards).
"""

from __future__ import annotations

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

_SHARDED: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Every parameter some ``fully_shard`` call sharded, and where (a parameter is owned by one DBuffer)."""


def refuse_sharded_twice(module: nn.Module, taken: set[int], label: str) -> list[nn.Parameter]:
    """The parameters of ``module`` this call shards (all but those in ``taken``: adopted from earlier calls).

    Refuses one an earlier ``fully_shard`` call sharded: sharded twice, it would become two
    independent copies, untied silently. FSDP2 refuses it too.
    """
    params = [p for p in module.parameters() if id(p) not in taken]
    names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    for param in params:
        where = _SHARDED.get(param)
        if where is not None:
            raise ValueError(
                f"parameter {names.get(id(param), '?')!r} of {label} is shared with a parameter "
                f"already sharded by another fully_shard call ({where}); sharding it again would untie them. "
                "Shard the modules that share it in one fully_shard call (their common parent: a tied parameter "
                "then goes to the group that contains all its users), or untie it"
            )
    return params


def claim(label: str, params: list[nn.Parameter]) -> None:
    """Record that the ``fully_shard`` call on ``label`` (a module's class, or a list of them) sharded ``params``."""
    for param in params:
        _SHARDED[param] = f"the call on {label}"
