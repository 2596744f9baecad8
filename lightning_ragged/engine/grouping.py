"""Which parameters form one FSDP group, and how a group splits into DBuffers.

A group is unsharded as a whole right before its module runs. By default every block of
every stack is a group: the children of each ``nn.ModuleList``/``nn.Sequential`` that are
modules of modules (an encoder's and a decoder's layers, a vision tower beside an LM, a
UNet's down and up blocks), and a block class repeated among siblings. Without any,
modules are picked by size so that no group exceeds ``dbuffer_size``. Whatever is left
(embeddings, final norm, head, tied weights) forms the root group.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence, Type, Union

import torch
from torch import nn

from lightning_ragged.layout.errors import DBufferAlignmentError

GroupSpec = Union[Type[nn.Module], nn.Module]


@dataclass
class ParamGroupPlan:
    """The parameters of one group: ``module`` runs them (None for the root group).

    ``runs`` splits the parameters where parameters of other groups come between them
    in module order (the root's embeddings before the blocks, its head after them), so
    each run gets its own DBuffer and is reduced as soon as its own gradients are done.
    """

    name: str
    module: nn.Module | None
    runs: list[list[tuple[str, nn.Parameter]]] = field(default_factory=list)
    _last_index: int = field(default=-2, init=False, repr=False)

    def add(self, index: int, name: str, param: nn.Parameter) -> None:
        """Append the parameter that is ``index``-th in module order."""
        if self._last_index != index - 1:
            self.runs.append([])
        self.runs[-1].append((name, param))
        self._last_index = index


ParamSlot = tuple[str, nn.Module, str]
"""Where a parameter is held: (module name, module, attribute)."""


def parameter_slots(root: nn.Module) -> dict[int, list[ParamSlot]]:
    """Every (module, attribute) holding each parameter, keyed by ``id(param)`` (tied weights: several)."""
    slots: dict[int, list[ParamSlot]] = {}
    for module_name, module in root.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module_name, module, attr))
    return slots


def choose_group_modules(
    root: nn.Module, group_modules: Sequence[GroupSpec] | None, dbuffer_size: int
) -> list[tuple[str, nn.Module]]:
    """Modules (other than ``root``) whose parameters each form one group, in module order."""
    named = [(name, module) for name, module in root.named_modules() if module is not root]
    if group_modules is not None:
        classes = tuple(spec for spec in group_modules if isinstance(spec, type))
        instances = {id(spec) for spec in group_modules if isinstance(spec, nn.Module)}
        return [(name, m) for name, m in named if isinstance(m, classes) or id(m) in instances]
    blocks = stack_blocks(root)
    return blocks if blocks else _size_groups(root, dbuffer_size)


def stack_blocks(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every block of every stack, outermost stacks first, in module order.

    A block is a child with parameters and children of its own that sits in an
    ``nn.ModuleList``/``nn.Sequential``, or whose class repeats among its siblings while
    holding no such container (T5's encoder and decoder are two ``T5Stack``s: their
    layers are the blocks, not the stacks). Blocks are not searched further (a MoE
    block's experts stay in the block).
    """
    chosen: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        children = [(name, child) for name, child in module.named_children() if _has_params(child)]
        composite = [child for _, child in children if _is_composite(child)]
        container = isinstance(module, (nn.ModuleList, nn.Sequential))
        repeats = Counter(type(child) for child in composite)
        for name, child in children:
            full = f"{prefix}{name}"
            repeated = repeats[type(child)] > 1 and not _holds_stack(child)
            if _is_composite(child) and (container or repeated):
                chosen.append((full, child))
            else:
                visit(f"{full}.", child)

    visit("", root)
    return chosen


def _is_composite(module: nn.Module) -> bool:
    return any(True for _ in module.children())


def _holds_stack(module: nn.Module) -> bool:
    return any(
        isinstance(m, (nn.ModuleList, nn.Sequential)) and any(_is_composite(c) for c in m.children())
        for m in module.modules()
    )


def _size_groups(root: nn.Module, dbuffer_size: int) -> list[tuple[str, nn.Module]]:
    """Largest subtrees that fit in ``dbuffer_size``; parameters of bigger modules stay in the root."""
    if _param_bytes(root.parameters()) <= dbuffer_size:
        return []
    chosen: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}{child_name}"
            size = _param_bytes(child.parameters())
            if size == 0:
                continue
            if size <= dbuffer_size:
                chosen.append((name, child))
            else:
                visit(f"{name}.", child)

    visit("", root)
    return chosen


def plan_groups(
    root: nn.Module, group_modules: Sequence[GroupSpec] | None, dbuffer_size: int
) -> list[ParamGroupPlan]:
    """Assign every parameter to exactly one group; the root group (last) keeps the rest.

    A parameter owned by several modules (a tied weight) goes to the innermost group
    that contains all of its owners, so one all-gather serves every use of it.
    """
    _check_dbuffer_size(dbuffer_size)
    groups = [ParamGroupPlan(name, module) for name, module in choose_group_modules(root, group_modules, dbuffer_size)]
    groups.append(ParamGroupPlan("root", None))
    slots = parameter_slots(root)
    group_prefixes = [(plan.name, plan) for plan in groups[:-1]]
    for index, (param_name, param) in enumerate(root.named_parameters()):
        owners = [module_name for module_name, _, _ in slots[id(param)]]
        target = groups[-1]
        for prefix, plan in group_prefixes:
            if all(owner == prefix or owner.startswith(prefix + ".") for owner in owners):
                if target is groups[-1] or len(prefix) > len(target.name):
                    target = plan
        target.add(index, param_name, param)
    return [plan for plan in groups if plan.runs or plan.module is None]


def split_into_dbuffers(
    params: list[tuple[str, nn.Parameter]], dbuffer_size: int
) -> list[list[tuple[str, nn.Parameter]]]:
    """Consecutive runs of same-dtype parameters whose bytes fit in ``dbuffer_size``."""
    dbuffers: list[list[tuple[str, nn.Parameter]]] = []
    current: list[tuple[str, nn.Parameter]] = []
    current_bytes = 0
    for name, param in params:
        size = param.numel() * param.element_size()
        if size > dbuffer_size:
            raise DBufferAlignmentError(
                f"parameter {name!r} needs {size} bytes but dbuffer_size={dbuffer_size}; "
                f"raise dbuffer_size to at least {size} bytes"
            )
        if current and (current_bytes + size > dbuffer_size or current[0][1].dtype != param.dtype):
            dbuffers.append(current)
            current, current_bytes = [], 0
        current.append((name, param))
        current_bytes += size
    if current:
        dbuffers.append(current)
    return dbuffers


def _check_dbuffer_size(dbuffer_size: int) -> None:
    if not isinstance(dbuffer_size, int) or isinstance(dbuffer_size, bool) or dbuffer_size <= 0:
        raise DBufferAlignmentError(
            f"dbuffer_size={dbuffer_size!r} must be a positive number of bytes, e.g. 256 * 2**20 (256 MiB)"
        )


def _param_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())
