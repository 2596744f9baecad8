"""The tensors inside a module's inputs and outputs, dataclasses included.

The engine finds the tensors a sharded module takes and returns (to hook the backward, to
cast) with torch's pytree, which enters only registered containers (tuple, list, dict,
namedtuple, OrderedDict, and types such as transformers' ``ModelOutput`` that register
themselves). A user's own ``@dataclass`` is a leaf there, so its tensors would be missed and
the backward would reach a resharded block (FSDP2 enters dataclasses). Here an unregistered
dataclass instance is entered field by field. A container whose tensors are all kept is returned
as it is (the caller sees what the module writes into it); otherwise a shallow copy gets the new
tensors, set as attributes: no ``__init__``/``__post_init__`` runs again (``dataclasses.replace``
would need every ``InitVar``), frozen and slotted dataclasses included.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


_MISSING = object()


def _entered_fields(value: Any) -> list[tuple[str, Any]]:
    """The set fields of an unregistered dataclass instance, in declaration order; else none."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return []
    fields = ((field.name, getattr(value, field.name, _MISSING)) for field in dataclasses.fields(value))
    return [(name, field) for name, field in fields if field is not _MISSING]  # init=False, never assigned: none


def _shallow_copy(value: Any) -> Any:
    """A new instance with ``value``'s attributes, made without ``__init__`` or the pickle protocol
    (``copy.copy`` would honour ``__getstate__``/``__copy__``)."""
    copied = object.__new__(type(value))
    if hasattr(value, "__dict__"):
        copied.__dict__.update(value.__dict__)
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                object.__setattr__(copied, slot, getattr(value, slot))
    return copied


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``fn(t)``; every container whose tensors all came back
    the same objects is ``tree``'s own (lists, dicts and dataclasses a module may write into stay shared)."""
    leaves, spec = tree_flatten(tree)
    mapped = [_map_leaf(fn, leaf) for leaf in leaves]
    if all(new is old for new, old in zip(mapped, leaves)):
        return tree
    return tree_unflatten(mapped, spec)


def _map_leaf(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    changed = {}
    for name, field in _entered_fields(value):
        mapped = map_tensors(fn, field)
        if mapped is not field:
            changed[name] = mapped
    if not changed:
        return value
    copied = _shallow_copy(value)
    for name, mapped in changed.items():
        object.__setattr__(copied, name, mapped)  # frozen dataclasses too; a custom __setattr__ is bypassed
    return copied


def tensors_requiring_grad(tree: Any) -> list[torch.Tensor]:
    """The tensors in ``tree`` that require a gradient, in ``map_tensors``'s order (nothing is rebuilt)."""
    found: list[torch.Tensor] = []
    for value in tree_flatten(tree)[0]:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                found.append(value)
        else:
            for _name, field in _entered_fields(value):
                found += tensors_requiring_grad(field)
    return found


def replace_tensors_requiring_grad(tree: Any, replacements: list[torch.Tensor]) -> Any:
    """``tree`` with its tensors requiring a gradient replaced, in order, by ``replacements``."""
    remaining = iter(replacements)
    return map_tensors(lambda t: next(remaining) if t.requires_grad else t, tree)
