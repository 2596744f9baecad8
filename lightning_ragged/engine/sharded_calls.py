"""A submodule of a group called on its own while the group is sharded: a clear error instead of torch's.

Outside its group's forward a module holds this rank's 1-D shards (what the optimizer steps). A
submodule called without the module that gathers its group (a checkpointed ``lambda t: b.fc(b.ln(t))``
in the parent's forward, a reversible layer recomputing sub-layers in its backward) computes with
them: a bare shape error that differs from rank to rank, or wrong values where shapes happen to fit.
Until the model's second training forward starts (so through its first training step, forward and
backward, and any evaluation forwards before it) each such submodule checks, as it is called, that it
holds its full parameters, and otherwise names itself, its group and the fixes. Such a call is part of
the model's structure and shows in its first step; then the checks are removed and cost nothing.

Under ``torch.compile`` a check traced into a graph returns at once (no graph break, and no side effect:
an activation checkpoint's subgraph refuses any) and stays: removing a hook Dynamo traced would recompile
that graph, so where Dynamo compiled a graph since the model was sharded the checks are kept.
Compiled code is therefore not checked.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from lightning_ragged.engine.dbuffer import DBuffer
from lightning_ragged.engine.shard_group import ShardGroup


class _CallCheck:
    """The check of one submodule: its first parameter slot of ``group`` must not hold the shard when it is called."""

    def __init__(self, label: str, group: ShardGroup, gatherer: str, attr: str, dbuffer: DBuffer, param: str) -> None:
        self.label, self.group, self.gatherer = label, group, gatherer
        self.attr, self.dbuffer, self.param = attr, dbuffer, param
        self.handle: Any = None

    def __deepcopy__(self, memo: dict) -> "_CallCheck":
        return self  # a hook, shared as functions are: copying it would copy the group's buffers

    def __call__(self, module: nn.Module, _args: tuple) -> None:
        if torch.compiler.is_compiling():
            return
        shard = self.dbuffer.sharded_params[self.param]
        if module._parameters.get(self.attr) is not shard:
            return
        raise RuntimeError(
            f"module '{self.label}' was called while its FSDP group '{self.group.name}' is sharded: outside the "
            f"forward of '{self.gatherer}', which gathers that group, its parameters are this rank's 1-D shards (its "
            f"'{self.attr}' of shape {tuple(self.dbuffer.unsharded_params[self.param].shape)} is a shard of "
            f"{shard.numel():,} elements here). Call it through '{self.gatherer}' (activation checkpointing: "
            "checkpoint the module, not a function of its submodules), or make the code that calls it a method of "
            f"'{self.gatherer}' registered with lightning_ragged.register_fsdp_forward_method, or group the model so "
            "that one group's forward contains the call (fully_shard(..., group_modules=...); group_modules=() makes "
            "one group of the whole model)"
        )


class ShardedCallCheck:
    """Forward pre-hooks on the submodules that own parameters of a group but do not gather it."""

    def __init__(self, root: nn.Module, groups: list[ShardGroup]) -> None:
        names = {id(module): name or "the model" for name, module in root.named_modules(remove_duplicate=False)}
        self.checks: list[_CallCheck] = []
        seen: set[int] = set()
        for group in groups:
            if group.is_root:  # any module using a root parameter gathers the root group
                continue
            members = {id(member) for member in group.members}
            gatherer = names.get(id(group.module), group.name)
            for module, attr, dbuffer, name in group.slots:
                if id(module) in members or id(module) in seen:
                    continue
                seen.add(id(module))
                check = _CallCheck(names.get(id(module), type(module).__name__), group, gatherer, attr, dbuffer, name)
                check.handle = module.register_forward_pre_hook(check)
                self.checks.append(check)
        self.handles = [check.handle for check in self.checks]
        self._training_forwards = 0
        self._graphs_before = _graphs_compiled()

    @property
    def active(self) -> bool:
        return self._training_forwards < 2 and bool(self.checks)

    def training_forward_starts(self) -> None:
        """The root's forward starts with gradients enabled: at the second such start, remove the checks, unless
        Dynamo compiled a graph since the model was sharded (it may have traced them)."""
        self._training_forwards += 1
        if self._training_forwards == 2 and _graphs_compiled() == self._graphs_before:
            for check in self.checks:
                check.handle.remove()


def _graphs_compiled() -> int:
    """Graphs torch.compile produced in this process so far (Dynamo's own counter; never imports Dynamo)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else utils.counters["stats"]["unique_graphs"]
