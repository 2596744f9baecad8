"""The tensors inside a module's inputs and outputs, dataclasses included.

The engine finds the tensors a sharded module takes and returns (to hook the backward, to
cast) with torch's pytree, which enters only registered containers (tuple, list, dict,
namedtuple, OrderedDict, and types such as transformers' ``ModelOutput`` that register
themselves). A user's own ``@dataclass`` is a leaf there, so its tensors would be missed and
the backward would reach a resharded block (FSDP2 enters dataclasses). Here an unregistered
dataclass instance is entered field by field. One whose tensors are all kept is returned as it
is (the caller sees what the module does to it); otherwise a shallow copy gets the new tensors,
set as attributes: no ``__init__``/``__post_init__`` runs again (``dataclasses.replace`` would
need every ``InitVar``), frozen dataclasses included.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map


def _entered_fields(value: Any) -> list[str]:
    """The fields of an unregistered dataclass instance; else none."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [field.name for field in dataclasses.fields(value)]
    return []


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``fn(t)``."""

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        changed = {}
        for name in _entered_fields(value):
            field = getattr(value, name)
            mapped = map_tensors(fn, field)
            if mapped is not field:
                changed[name] = mapped
        if not changed:
            return value
        copied = copy.copy(value)
        for name, mapped in changed.items():
            object.__setattr__(copied, name, mapped)  # frozen dataclasses too
        return copied

    return tree_map(leaf, tree)


def tensors_requiring_grad(tree: Any) -> list[torch.Tensor]:
    """The tensors in ``tree`` that require a gradient, in ``map_tensors``'s order (nothing is rebuilt)."""
    found: list[torch.Tensor] = []
    for value in tree_flatten(tree)[0]:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                found.append(value)
        else:
            for name in _entered_fields(value):
                found += tensors_requiring_grad(getattr(value, name))
    return found


def replace_tensors_requiring_grad(tree: Any, replacements: list[torch.Tensor]) -> Any:
    """``tree`` with its tensors requiring a gradient replaced, in order, by ``replacements``."""
    remaining = iter(replacements)
    return map_tensors(lambda t: next(remaining) if t.requires_grad else t, tree)
