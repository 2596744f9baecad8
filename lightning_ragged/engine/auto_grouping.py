"""``planning="auto"``: describe a model's groups for the auto-planner, and apply its choice.

:func:`describe_groups` turns the engine's groups (``grouping.plan_groups``) into the
auto-planner's :class:`~lightning_ragged.layout.auto.GroupKind` list: identical groups
described once, with their count and member names (the plan CLI describes a
``config.json`` model with it too, so both see one definition). :func:`auto_groups` runs
:func:`~lightning_ragged.layout.auto.auto_plan` on it and returns the groups it chose as
``group_modules`` entries (lists of consecutive sibling blocks) for ``fully_shard``.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_ragged.engine.grouping import GroupSpec, ParamGroupPlan, plan_groups
from lightning_ragged.layout.auto import AutoPlan, GroupKind, auto_plan
from lightning_ragged.layout.granularity import GranularityPolicy

Run = list[tuple[str, Any]]


def describe_groups(
    group_plans: Sequence[ParamGroupPlan],
    split_run: Callable[[str, Run], Run] | None = None,
    experts: str | None = None,
) -> list[GroupKind]:
    """The distinct groups of ``group_plans`` (blocks first, the root last), each with its count and members.

    Two groups are the same kind when they sit in the same stack and hold the same tensors
    (names relative to the group's module, shapes, dtypes) in the same runs. ``split_run(prefix,
    run)`` may rewrite a kind's runs (e.g. one tensor per expert); ``experts`` labels MoE kinds.
    """
    kinds: dict[tuple, GroupKind] = {}
    members: dict[tuple, list[str]] = {}
    for group in group_plans:
        prefix = "" if group.module is None else f"{group.name}."
        runs = [[(param_name.removeprefix(prefix), param) for param_name, param in run] for run in group.runs]
        signature = tuple(tuple((n, tuple(p.shape), p.dtype) for n, p in run) for run in runs)
        key = (_stack_of(group.name), signature)
        if key not in kinds:
            if split_run is not None:
                runs = [split_run(prefix, run) for run in runs]
            kinds[key] = GroupKind(key[0], 0, [[(n, tuple(p.shape)) for n, p in run] for run in runs])
            members[key] = []
        kinds[key].count += 1
        members[key].append(group.name)
    return [_label(kind, members[key], kinds, experts) for key, kind in kinds.items()]


def auto_groups(
    module: nn.Module,
    group_modules: Sequence[GroupSpec] | None,
    *,
    world_size: int,
    replicate_degree: int | None,
    memory_budget_bytes: int,
    granularity: GranularityPolicy,
    block_rows: int,
    alignment: int,
    algorithm: str,
    param_dtype: torch.dtype | None,
    dbuffer_size: int,
    reduce_dtype: torch.dtype | None = None,
) -> tuple[AutoPlan, list[list[nn.Module]]]:
    """Plan ``module``'s one-block groups with the auto-planner; return the plan and the groups it chose.

    ``world_size`` counts every rank (shard ranks times ``replicate_degree``); ``fully_shard``
    fixes the replicate degree to its caller's process groups, ``None`` lets the planner choose it.
    """
    plans = plan_groups(module, group_modules, dbuffer_size)
    master = next((p for p in module.parameters()), None)
    master_bytes = master.element_size() if master is not None else 4
    param_bytes = torch.empty((), dtype=param_dtype).element_size() if param_dtype is not None else master_bytes
    reduce_bytes = torch.empty((), dtype=reduce_dtype).element_size() if reduce_dtype is not None else param_bytes
    chosen = auto_plan(
        describe_groups(plans), world_size, granularity, memory_budget_bytes, block_rows=block_rows,
        alignment=alignment, algorithm=algorithm, master_bytes=master_bytes, param_bytes=param_bytes,
        replicate_degree=replicate_degree, reduce_bytes=reduce_bytes,
    )
    by_name = dict(module.named_modules())
    groups = [
        [by_name[name] for name in names]
        for group in chosen.groups if group.kind != "root"
        for names in group.members
    ]
    return chosen, groups


def _stack_of(group_name: str) -> str:
    """"model.layers.7" -> "layers": the stack a block belongs to ("root" stays "root")."""
    return re.sub(r"\.\d+$", "", group_name).rpartition(".")[2]


def _label(kind: GroupKind, names: list[str], kinds: dict[tuple, GroupKind], experts: str | None) -> GroupKind:
    """Name a group kind by its stack, with its block indices where the stack has several kinds."""
    label = kind.name
    if sum(other.name == kind.name for other in kinds.values()) > 1:
        ends = [name.rpartition(".")[2] for name in names]
        first, last = ends[0], ends[-1]
        contiguous = all(e.isdigit() for e in ends) and ends == [str(i) for i in range(int(first), int(last) + 1)]
        label += f" {first}-{last}" if contiguous and len(ends) > 1 else f" {','.join(ends)}"
    if any(".experts." in f".{name}" for name, _ in kind.shapes):
        label += f" (MoE, experts {experts or 'fused'})"
    return GroupKind(label, kind.count, kind.runs, list(names))
