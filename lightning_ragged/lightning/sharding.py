"""Sharding a user's module for a Lightning strategy, Trainer or Fabric alike.

Both strategies shard the same way: the HSDP process groups (``hsdp_groups``), then composable
activation checkpointing, the move to the device, ``fully_shard`` with the strategy's knobs and
materialization of a model built on the meta device tensor by tensor (``shard_module``). Module
classes may be named by class, dotted import path or bare class name (``resolve_classes``).
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_ragged.checkpoint.dcp import release_meshes
from lightning_ragged.engine.api import fully_shard, get_state
from lightning_ragged.engine.init_record import Recording, bind_recordings
from lightning_ragged.engine.meta_init import has_meta_tensors, materialize_meta_module
from lightning_ragged.engine.meta_loads import loaded_values, require_same_loads

ModuleSpec = Union[type, str]
"""A module class, a dotted import path ``"pkg.mod.Class"``, or a bare class name matched in the model."""

_LIVE_GROUPS: list[dist.ProcessGroup] = []
"""HSDP groups built by a run and not destroyed yet: the next run's setup destroys them (or the process's exit)."""


def hsdp_groups(
    degree: int, timeout: Optional[timedelta]
) -> tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
    """(shard group, replicate group) for HSDP of ``degree`` replicas; (None, None) for plain FSDP.

    Shard groups are ``world/degree`` consecutive ranks; replicate groups take one rank of each.
    Destroys the groups an earlier call built first (they outlive a run, so ``full_state_dict``
    and saves still work after ``fit``), and the meshes holding them.
    """
    destroy_hsdp_groups()
    if degree == 1:
        return None, None
    world = dist.get_world_size()
    shard_size = world // degree
    shard_ranks = [list(range(i * shard_size, (i + 1) * shard_size)) for i in range(degree)]
    replicate_ranks = [list(range(j, world, shard_size)) for j in range(shard_size)]
    shard_group, shard_groups = dist.new_subgroups_by_enumeration(shard_ranks, timeout=timeout)
    replicate_group, replicate_groups = dist.new_subgroups_by_enumeration(replicate_ranks, timeout=timeout)
    _LIVE_GROUPS.extend([*shard_groups, *replicate_groups])
    return shard_group, replicate_group


def destroy_hsdp_groups() -> None:
    """Destroy every HSDP group ``hsdp_groups`` built and not destroyed yet."""
    release_meshes()
    for group in _LIVE_GROUPS:
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError):  # this rank is not a member, or it is already gone
            pass
    _LIVE_GROUPS.clear()


def replicate_degree_for(replicate_degree: Union[int, str], num_nodes: int, world_size: int) -> int:
    """The HSDP degree of ``replicate_degree`` (an int or ``"node"``), checked against the world size."""
    degree = num_nodes if replicate_degree == "node" else int(replicate_degree)
    if world_size % degree:
        raise ValueError(
            f"replicate_degree={replicate_degree!r} ({degree}) must divide the world size "
            f"{world_size} (num_nodes={num_nodes} x devices={world_size // num_nodes})"
        )
    return degree


def mp_policy_for(precision: Optional[str]) -> Optional[MixedPrecisionPolicy]:
    """``"bf16-mixed"`` / ``"16-mixed"``: bf16 / fp16 all-gathers and compute, fp32 reduction and master shards;
    else none (the ``*-true`` precisions convert the module itself before sharding)."""
    if precision in ("bf16-mixed", "16-mixed"):
        dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    return None


def sharded_scaler(scaler: Any, device: str) -> Any:
    """``"16-mixed"``: torch's ``ShardedGradScaler`` with the settings of the plugin's ``GradScaler``.

    A plain ``GradScaler`` checks for inf/NaN in this rank's gradient shards only, so ranks could
    disagree on skipping a step; the sharded one all-reduces that flag over every rank (HSDP
    replicas included), as FSDP's does. One given as a ``ShardedGradScaler`` is kept.
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if scaler is None or isinstance(scaler, ShardedGradScaler):
        return scaler
    return ShardedGradScaler(
        device=device, init_scale=scaler.get_scale(), growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(), growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
    )


def shard_module(
    model: nn.Module,
    *,
    device: torch.device,
    activation_checkpointing: Sequence[ModuleSpec] = (),
    group_modules: Optional[Sequence[ModuleSpec]] = None,
    cast_root_inputs: bool = True,
    recordings: Optional[list[Recording]] = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Checkpoint the matching modules' activations, move ``model`` to ``device`` and shard it in place.

    A model with meta tensors stays where it is until ``fully_shard`` has planned it, then is
    materialized tensor by tensor (``meta_init.py``). ``cast_root_inputs=False`` leaves the root
    forward's inputs in their dtype under a mixed-precision policy (the Trainer's root is the
    LightningModule, whose inputs hold the targets too). ``recordings``: the strategy's init contexts'
    (``init_record.py``), replayed when they built the meta model, then emptied.
    """
    refuse_dtensors(model)
    on_meta = has_meta_tensors(model)
    # values load_state_dict gave the meta model (meta_loads.py), named before fully_shard replaces its tensors
    loaded = loaded_values(model) if on_meta else {}
    if on_meta:
        require_same_loads(loaded)
    program = bind_recordings(model, recordings) if on_meta and recordings else None
    for module in match_modules(model, activation_checkpointing, "activation_checkpointing"):
        from torch.distributed._composable import checkpoint

        checkpoint(module)
    if not on_meta:
        model.to(device)
    classes = resolve_classes(model, group_modules, "group_modules") if group_modules is not None else None
    fully_shard(model, group_modules=classes, device=device, **fully_shard_kwargs)
    get_state(model).cast_root_inputs = cast_root_inputs
    if on_meta:
        # layers the user sharded from meta and then loaded or initialized (load_state_dict, DCP, summon) keep that
        written = [(b, b.sharded.clone()) for g in get_state(model).all_groups if g.from_meta and not g.uninitialized
                   for b in g.dbuffers]
        materialize_meta_module(model, device, program=program)
        with torch.no_grad():
            for dbuffer, values in written:
                dbuffer.sharded.copy_(values)
    if loaded:
        model.load_state_dict(loaded, strict=False)  # after the replayed initialization: the loaded values stand
    return model


def refuse_dtensors(model: nn.Module) -> None:
    """Parameters that are DTensors were sharded by torch (``torch.distributed.fsdp.fully_shard``, tensor
    parallelism), typically in ``configure_model`` written for ``ModelParallelStrategy``: refused by name (they
    failed later as "'Parameter' object has no attribute '_local_tensor'")."""
    from torch.distributed.tensor import DTensor

    names = [name for name, param in model.named_parameters() if isinstance(param, DTensor)]
    if names:
        raise ValueError(
            f"{len(names)} parameters of {type(model).__name__} are DTensors (e.g. {names[0]!r}): torch's "
            "fully_shard (FSDP2) or tensor parallelism was applied to the model, e.g. in configure_model written for "
            "ModelParallelStrategy. The ragged_fsdp strategy shards the model itself: remove those calls, or call "
            "lightning_ragged.fully_shard in their place (FSDP2's arguments and order; no mesh needed)"
        )


def resolve_classes(model: nn.Module, specs: Sequence[ModuleSpec], knob: str) -> list[type]:
    """Classes from classes, dotted import paths, or bare class names found in ``model``."""
    classes: list[type] = []
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    for spec in specs:
        if isinstance(spec, type):
            classes.append(spec)
        elif isinstance(spec, str) and spec in by_name:
            classes.append(by_name[spec])
        elif isinstance(spec, str) and "." in spec:
            module_name, _, class_name = spec.rpartition(".")
            classes.append(getattr(importlib.import_module(module_name), class_name))
        else:
            raise ValueError(
                f"{knob}: {spec!r} is neither a module class, an import path 'pkg.module.Class', nor the name "
                f"of a module class in the model (found: {sorted(by_name)})"
            )
    return classes


def match_modules(model: nn.Module, specs: Sequence[ModuleSpec], knob: str) -> list[nn.Module]:
    """The modules of ``model`` that are instances of the classes ``specs`` name."""
    if not specs:
        return []
    classes = tuple(resolve_classes(model, specs, knob))
    return [module for module in model.modules() if isinstance(module, classes)]
