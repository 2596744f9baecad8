"""Lightning's ``ModelSummary`` with global parameter counts for a sharded model.

Lightning counts ``p.numel()`` per parameter. FSDP2's parameters are DTensors, whose
``numel()`` is the global count; the engine's parameters are plain 1-D shards (views into
the DBuffer), so the summary showed this rank's share (e.g. 17.1 K of 34.1 K) and a "params
size" from it. :class:`RaggedModelSummary` counts each shard's ``ragged_shard.numel`` (the
unsharded parameter) instead, in the table, "Trainable/Non-trainable/Total params" and the
size estimate, and adds a "Params per Device" column (this rank's shard elements), as
Lightning's DeepSpeed ZeRO-3 summary does.

Lightning's ``ModelSummary`` callback picks its summary class in ``_summary``; there is no
strategy hook, so the strategy points the callbacks' ``_summary`` at this class in ``setup``
(:func:`use_global_parameter_counts`; the callback's class and checkpoint state key are unchanged).
"""

from __future__ import annotations

import types
from collections import OrderedDict
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary.model_summary import (
    NOT_APPLICABLE,
    LayerSummary,
    ModelSummary,
    _tensor_has_shape,
    get_human_readable_count,
)
from torch import nn

import lightning.pytorch as pl


def global_numel(param: torch.Tensor) -> int:
    """Elements of the unsharded parameter (a shard's ``ragged_shard.numel``; ``numel()`` otherwise)."""
    shard = getattr(param, "ragged_shard", None)
    return int(shard.numel) if shard is not None else param.numel()


def _count(params: Any, per_device: bool = False) -> int:
    return sum(
        (p.numel() if per_device else global_numel(p)) if not _tensor_has_shape(p) else 0 for p in params
    )


class RaggedLayerSummary(LayerSummary):
    @property
    def num_parameters(self) -> int:
        return _count(self._module.parameters())

    @property
    def parameters_per_device(self) -> int:
        return _count(self._module.parameters(), per_device=True)


class RaggedModelSummary(ModelSummary):
    """``ModelSummary`` of a model sharded by lightning_ragged: global counts, plus a per-device column."""

    def summarize(self) -> dict[str, LayerSummary]:  # type: ignore[override]
        summary = OrderedDict((name, RaggedLayerSummary(module)) for name, module in self.named_modules)
        if self._model.example_input_array is not None:
            self._forward_example_input()
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for key in [k for k in summary if k.count(".") >= self._max_depth]:
                del summary[key]
        return summary  # type: ignore[return-value]

    @property
    def total_parameters(self) -> int:
        return _count(self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        return _count(p for p in self._model.parameters() if p.requires_grad)

    @property
    def parameters_per_device(self) -> list[int]:
        return [layer.parameters_per_device for layer in self._layer_summary.values()]  # type: ignore[attr-defined]

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        arrays = super()._get_summary_data()
        per_device = list(map(get_human_readable_count, self.parameters_per_device))
        rows = len(dict(arrays)["Name"])
        per_device += [NOT_APPLICABLE] * (rows - len(per_device))  # the "other params" row
        position = [name for name, _ in arrays].index("Params") + 1
        arrays.insert(position, ("Params per Device", per_device))
        return arrays


def is_ragged_sharded(module: nn.Module) -> bool:
    return module.__dict__.get("_ragged_fsdp_state") is not None


def _ragged_summary(callback: ModelSummaryCallback, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Any:
    if is_ragged_sharded(pl_module):
        return RaggedModelSummary(pl_module, max_depth=callback._max_depth)
    return type(callback)._summary(callback, trainer, pl_module)


def use_global_parameter_counts(trainer: "pl.Trainer") -> None:
    """Make the Trainer's ``ModelSummary`` / ``RichModelSummary`` callbacks report global counts."""
    for callback in trainer.callbacks:
        if isinstance(callback, ModelSummaryCallback) and "_summary" not in callback.__dict__:
            callback._summary = types.MethodType(_ragged_summary, callback)  # type: ignore[method-assign]
