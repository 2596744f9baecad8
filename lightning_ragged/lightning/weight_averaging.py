"""Lightning's ``WeightAveraging`` / ``EMAWeightAveraging`` callbacks over this strategy's shards.

The callback builds ``torch.optim.swa_utils.AveragedModel(pl_module)`` in its ``setup``, before
the strategy shards the module: a full copy, which it would then average with 1-D shards.
An average is elementwise, so the average of each shard is the shard of the average: the
strategy keeps the callback from copying the module, and after sharding gives it an
``AveragedModel`` of :class:`ShardCopies` instead,
one tensor per parameter and buffer of the sharded module, in its order (the callback pairs
them by position: ``update_parameters``, ``_swap_models``, ``_copy_average_to_current``). It
costs 1/W of the parameters per rank, where DDP's costs all of them. Its state dict has the
module's keys, sharded tensors as DTensors of this rank's boxes (as the strategy's own model
state), so the callback's checkpoint layout (the average under ``state_dict``, the trained
weights under ``current_model_state``) is written and resumed by the strategy's checkpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from lightning_ragged.checkpoint.dcp import shard_as_dtensor
from lightning_ragged.engine.state_dict import sharded_params
from lightning_ragged.engine.torch_state_dict import local_part

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ShardCopies(nn.Module):
    """This rank's part of every parameter and buffer of a sharded module, under the module's state-dict keys.

    Built at rest (the module's parameters are its shards), as copies of them. ``state_dict`` gives sharded keys as DTensors of this
    rank's boxes; ``load_state_dict`` takes those, StateShards of this layout or full tensors.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        sharded = sharded_params(module)
        names: dict[int, str] = {}
        for index, param in enumerate(module.parameters()):
            names[id(param)] = f"param_{index}"
            self.register_parameter(names[id(param)], nn.Parameter(param.detach().clone(), requires_grad=False))
        for index, buffer in enumerate(module.buffers()):
            names[id(buffer)] = f"buffer_{index}"
            self.register_buffer(names[id(buffer)], buffer.detach().clone())
        self._keys: dict[str, tuple[str, Any]] = {}
        """state-dict key -> (the local tensor's attribute, its RaggedShard or None)."""
        self._extra: dict[str, Any] = {}
        """Non-tensor entries (``get_extra_state``), as they were: not averaged."""
        for key, value in module.state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor) and id(value) in names:
                self._keys[key] = (names[id(value)], sharded[key].param.ragged_shard if key in sharded else None)
            else:
                self._extra[key] = value

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        for key, (attr, shard) in self._keys.items():
            tensor = getattr(self, attr)
            tensor = tensor if keep_vars else tensor.detach()
            if shard is None:
                destination[prefix + key] = tensor
                continue
            wrapped = shard_as_dtensor(tensor, shard)
            if wrapped is not None:  # a rank holding none of it leaves the key out, as the model's state does
                destination[prefix + key] = wrapped
        for key, value in self._extra.items():
            destination[prefix + key] = value

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        with torch.no_grad():
            for key, (attr, shard) in self._keys.items():
                if prefix + key not in state_dict:
                    if shard is None or shard.local_numel > 0:
                        missing_keys.append(prefix + key)
                    continue
                value, tensor = state_dict[prefix + key], getattr(self, attr)
                tensor.copy_(value if shard is None else local_part(value, shard, key).reshape(tensor.shape))
        for key in self._extra:
            if prefix + key in state_dict:
                self._extra[key] = state_dict[prefix + key]
        if strict:
            known = {prefix + key for key in (*self._keys, *self._extra)}
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in known)


class ShardAveragedModel(AveragedModel):
    """``AveragedModel`` of a sharded module's :class:`ShardCopies`; averaging checks the module is at rest.

    Also for plain ``fully_shard`` and Fabric users (``lightning_ragged.ShardAveragedModel``), where
    ``AveragedModel(model)`` fails (a sharded module refuses ``deepcopy``)::

        ema = ShardAveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
        ...  # after each optimizer.step():
        ema.update_parameters(model)
        ema.swap(model)  # evaluate on the average; swap(model) again to go back

    ``fabric.save(path, {"model": model, "optimizer": opt, "ema": ema})`` writes it sharded beside
    the model and ``fabric.load`` restores it in place, from any layout.
    """

    def __init__(self, module: nn.Module, device: Any = None, **kwargs: Any) -> None:
        super().__init__(nn.Module(), device=device, **kwargs)  # not a deepcopy: the shards' RaggedShards stay shared
        copies = ShardCopies(module)
        self.module = copies if device is None else copies.to(device)
        self._shards = list(module.parameters())

    def update_parameters(self, model: nn.Module) -> None:
        self._check_at_rest(model)
        super().update_parameters(model)

    def _check_at_rest(self, model: nn.Module) -> None:
        if any(a is not b for a, b in zip(model.parameters(), self._shards)):
            raise RuntimeError(
                "ShardAveragedModel (WeightAveraging under RaggedFSDPStrategy) averages the module's shards, but its "
                "parameters are not the shards now (full parameters kept between steps, e.g. set_reshard_after_backward(False), or the "
                "module was re-sharded): keep the default resharding while averaging weights"
            )

    def swap(self, model: nn.Module) -> None:
        """Exchange the average with ``model``'s parameters (and buffers, with ``use_buffers``) in place, as
        Lightning's callback does around validation; a second call swaps back."""
        self._check_at_rest(model)
        ours = [*self.module.parameters(), *(self.module.buffers() if self.use_buffers else ())]
        theirs = [*model.parameters(), *(model.buffers() if self.use_buffers else ())]
        with torch.no_grad():
            for average, current in zip(ours, theirs, strict=True):
                held = average.detach().clone()
                average.copy_(current.detach())
                current.detach().copy_(held)


def _weight_averaging_callbacks(trainer: "pl.Trainer") -> list[Any]:
    try:
        from lightning.pytorch.callbacks import WeightAveraging  # Lightning >= 2.5
    except ImportError:
        return []
    return [callback for callback in trainer.callbacks if isinstance(callback, WeightAveraging)]


def defer_full_copies(trainer: "pl.Trainer") -> None:
    """Before the callbacks' ``setup``: a ``WeightAveraging`` callback no longer deep-copies the whole module
    for ``fit`` (a full copy on every rank; a sharded module refuses ``deepcopy``); :func:`average_shards`
    gives it its average once the module is sharded. Its other stages run as Lightning wrote them."""
    for callback in _weight_averaging_callbacks(trainer):
        if "setup" in callback.__dict__:  # deferred by an earlier run
            continue
        original = callback.setup

        def setup(trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str, original: Any = original) -> None:
            if stage != "fit" or not getattr(trainer.strategy, "averages_shards", False):  # e.g. reused with DDP
                original(trainer, pl_module, stage)

        callback.setup = setup


def average_shards(trainer: "pl.Trainer", module: nn.Module) -> None:
    """Give every ``WeightAveraging`` callback an average of ``module``'s shards (``fit``, once it is sharded)."""
    for callback in _weight_averaging_callbacks(trainer):
        callback._average_model = ShardAveragedModel(
            module, device=callback._device, use_buffers=callback._use_buffers, **callback._kwargs
        )
