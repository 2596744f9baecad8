"""Values ``load_state_dict`` gives a model still on the meta device, kept until it is materialized.

``Trainer.init_module(empty_init=True)`` (``fabric.init_module``) builds the model on the meta device,
and Lightning documents it for loading a checkpoint into a large model: ``model.load_state_dict(sd)``
right after. Copying into a meta tensor is a no-op (torch only warns), and the strategy's setup then
materializes the model from its recorded construction: training started from the random
initialization, silently (DDP, which builds on the device, trains from the loaded weights).

While a construction is recorded (``init_record.recording``), every module that registers a meta
parameter or buffer is noted; afterwards each gets a ``load_state_dict`` pre-hook that keeps a
reference to the value given for each of its meta tensors. The strategies' sharding
(``lightning/sharding.shard_module``) names them while the model still holds its meta tensors
(``MetaLoads.named``) and loads them into the sharded model after the replayed initialization, so
the loaded values stand. The values are the caller's tensors, held until then (no copy).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)


class MetaLoads:
    """What ``load_state_dict`` gave the meta tensors of the modules one construction made."""

    def __init__(self) -> None:
        self.modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.values: dict[int, tuple[torch.Tensor, Any]] = {}  # id(meta tensor) -> (that tensor, the value)
        self._handles: list[Any] = []

    def watch_loads(self) -> None:
        """Give every noted module the pre-hook (once the construction is over)."""
        for module in self.modules:
            self._handles.append(module._register_load_state_dict_pre_hook(self._keep, with_module=True))

    def _keep(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name, tensor in itertools.chain(module._parameters.items(), module._buffers.items()):
            key = prefix + name
            if isinstance(tensor, torch.Tensor) and tensor.is_meta and key in state_dict:
                self.values[id(tensor)] = (tensor, state_dict[key])

    def named(self, model: nn.Module) -> dict[str, Any]:
        """The kept values by ``model``'s names (call while it still holds its meta tensors); stops watching."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        tensors = itertools.chain(
            model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
        )
        named = {name: self.values[id(tensor)][1] for name, tensor in tensors if id(tensor) in self.values}
        self.values.clear()
        return named


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
