"""Values ``load_state_dict`` gives a model still on the meta device, kept until it is materialized.

``Trainer.init_module(empty_init=True)`` (``fabric.init_module``) builds the model on the meta device,
and Lightning documents it for loading a checkpoint into a large model: ``model.load_state_dict(sd)``
right after. Copying into a meta tensor is a no-op (torch only warns), and the strategy's setup then
materializes the model from its recorded construction: training started from the random
initialization, silently (DDP, which builds on the device, trains from the loaded weights).

While a construction is recorded (``init_record.recording``), every module that registers a meta
parameter or buffer is noted; afterwards each gets a ``load_state_dict`` pre-hook that keeps a
reference to the value given for each of its meta tensors (not with ``assign=True``, which puts the
values in the model itself). The strategies' sharding (``lightning/sharding.shard_module``) takes
the values of the model it shards (:func:`loaded_values`, while the model still holds its meta
tensors; other models of the same construction keep theirs) and loads them into the sharded model
after the replayed initialization, so they stand. The values are the caller's tensors, held until
then (no copy). torch's copy into each meta tensor gets a meta stand-in of the value (in the dict
``load_state_dict`` copied), so it stays a silent no-op instead of warning that the value is lost.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

_LIVE: "weakref.WeakSet[MetaLoads]" = weakref.WeakSet()
"""The constructions whose modules are still watched or hold values."""


class MetaLoads:
    """What ``load_state_dict`` gave the meta tensors of the modules one construction made."""

    def __init__(self) -> None:
        self.modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.values: dict[int, tuple[torch.Tensor, Any]] = {}  # id(meta tensor) -> (that tensor, the value)
        self._handles: dict[int, Any] = {}  # id(module) -> its pre-hook's handle

    def watch_loads(self) -> None:
        """Give every noted module the pre-hook (once the construction is over)."""
        for module in self.modules:
            self._handles[id(module)] = module._register_load_state_dict_pre_hook(self._keep, with_module=True)
        if self._handles:
            _LIVE.add(self)

    def _keep(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict, *args: Any) -> None:
        if local_metadata.get("assign_to_params_buffers"):
            return  # assign=True: the values become the module's tensors, nothing to keep
        for name, tensor in itertools.chain(module._parameters.items(), module._buffers.items()):
            key = prefix + name
            if isinstance(tensor, torch.Tensor) and tensor.is_meta and key in state_dict:
                value = state_dict[key]
                self.values[id(tensor)] = (tensor, value)
                if type(value) in (torch.Tensor, nn.Parameter) and not value.is_meta and not value.is_quantized:
                    # torch's own copy into the meta tensor is a no-op, and it would warn that the value is
                    # lost: it gets a meta stand-in (this load's copy of the dict; the caller's is untouched).
                    # Quantized values and tensor subclasses (no meta form) keep the warning.
                    state_dict[key] = torch.empty_like(value, device="meta")

    def take(self, model: nn.Module) -> dict[str, Any]:
        """The values kept for ``model``'s tensors, by its names; its modules are no longer watched."""
        for module in model.modules():
            handle = self._handles.pop(id(module), None)
            if handle is not None:
                handle.remove()
        tensors = list(itertools.chain(
            model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
        ))
        named = {name: self.values[id(tensor)][1] for name, tensor in tensors if id(tensor) in self.values}
        for _, tensor in tensors:
            self.values.pop(id(tensor), None)
        return named


def loaded_values(model: nn.Module) -> dict[str, Any]:
    """What ``load_state_dict`` gave ``model``'s meta tensors, by ``model``'s names (call before sharding it)."""
    values: dict[str, Any] = {}
    for loads in list(_LIVE):
        values.update(loads.take(model))
        if not loads._handles and not loads.values:
            _LIVE.discard(loads)
    return values


def require_same_loads(loaded: dict[str, Any]) -> None:
    """Every rank loaded the same tensors into its meta model, or a ``ValueError`` on every rank (one object
    all-gather). A load on rank 0 only (the FSDP1 habit) would leave the other ranks' shards at the replayed
    initialization: a patchwork of two models."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, len(loaded))
    if len(set(counts)) > 1:
        raise ValueError(
            f"load_state_dict gave the meta-device model {counts} tensors on ranks 0..{len(counts) - 1}: every rank "
            "must load the same state (each process loads its copy, as under DDP), or load after setup "
            "(lightning_ragged.load_full_state_dict / fit(ckpt_path=...))"
        )


@contextlib.contextmanager
def watching() -> Iterator[MetaLoads]:
    """Note the modules that register meta tensors inside the block; hook their loads after it."""
    loads = MetaLoads()

    def registered(module: nn.Module, name: str, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            loads.modules.add(module)

    handles = [register_module_parameter_registration_hook(registered), register_module_buffer_registration_hook(registered)]
    try:
        yield loads
    finally:
        for handle in handles:
            handle.remove()
        loads.watch_loads()
