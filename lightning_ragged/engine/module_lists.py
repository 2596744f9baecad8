"""FSDP2's ``fully_shard([module, ...])``: the modules of one call that become one group.

torchtitan shards ``[model.norm, model.output]`` together (one all-gather for the two, kept for the
backward that starts right after), and a tied embedding and head must share one group. The modules
may sit anywhere in the model and run in any order; ``forward_hooks.py`` runs such a group, and the
model's own ``fully_shard`` call adopts it (``api.py``).
"""

from __future__ import annotations

from typing import Any

from torch import nn


class ListedModules(nn.ModuleList):
    """The modules of one ``fully_shard([...])`` call held together while it shards them; never part of the model
    (the modules stay where they are), and the call's state keeps it only as the owner of their buffers."""


def listed_modules(
    module: Any, group_modules: Any, blocks_per_group: int, planning: Any
) -> list[nn.Module] | None:
    """The modules of FSDP2's ``fully_shard([...])`` (None for one module), checked."""
    if isinstance(module, nn.Module):
        return None
    listed = list(module) if isinstance(module, (list, tuple)) else None
    if not listed or not all(isinstance(m, nn.Module) for m in listed):
        raise TypeError(
            f"fully_shard takes an nn.Module or a non-empty list of them (FSDP2's fully_shard([model.norm, "
            f"model.output])), not {module!r}"
        )
    if len({id(m) for m in listed}) < len(listed):
        raise ValueError(f"fully_shard({[type(m).__name__ for m in listed]}): a module is listed twice; list each once")
    nested = [(type(inner).__name__, type(outer).__name__) for outer in listed for inner in listed
              if inner is not outer and any(inner is m for m in outer.modules())]
    if nested:
        raise ValueError(
            f"fully_shard([...]): {nested[0][0]} is inside {nested[0][1]}, also listed; list modules that do not "
            "contain each other (the outer one's group already holds the inner one's parameters)"
        )
    if group_modules is not None or blocks_per_group != 1 or planning is not None:
        raise ValueError(
            "group_modules, blocks_per_group and planning choose groups inside one module: a list given to "
            "fully_shard is one group already"
        )
    return listed
