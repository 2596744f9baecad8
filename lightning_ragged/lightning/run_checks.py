"""What the strategy checks about a Trainer run before it shards: clear errors instead of silent surprises.

- A module sharded by an earlier run keeps that run's layout, dtypes and hooks (its shards are
  the parameters now); a later run with other sharding settings (``precision``, the knobs,
  ``sync_batchnorm``) cannot apply them, so it is refused, naming each setting that changed.
- Lightning's ``StochasticWeightAveraging`` copies the module into ``torch.optim.swa_utils.AveragedModel``
  before it is sharded and then averages full tensors into 1-D shards; Lightning refuses SWA for its
  own sharded strategies, and so does this one (``WeightAveraging`` and its EMA average the shards
  instead: ``weight_averaging.py``). ``ModelPruning`` masks whole tensors: refused too.
- ``Trainer(sync_batchnorm=True)``: the BatchNorm layers become torch's ``SyncBatchNorm`` before
  sharding (as Lightning's DDP and FSDP strategies do), which runs on accelerators only, so on CPU
  a model with BatchNorm layers is refused up front rather than at the first forward.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import lightning.pytorch as pl

from lightning_ragged.engine.runtime import get_state

SETTINGS_ATTRIBUTE = "_ragged_fsdp_settings"


def describe(value: Any) -> str:
    """A setting as text: callables by their qualified name (a lambda re-created in the same place compares equal),
    dataclasses (``MixedPrecisionPolicy``, ``Float8AllGather``) and containers by their parts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{f.name}={describe(getattr(value, f.name))}" for f in dataclasses.fields(value))
        return f"{type(value).__name__}({fields})"
    if isinstance(value, functools.partial):
        return f"partial({describe(value.func)}, {describe(list(value.args))}, {describe(value.keywords)})"
    if callable(value) and not isinstance(value, type):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(describe(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key!r}: {describe(item)}" for key, item in value.items()) + "}"
    return repr(value)


def remember_settings(model: nn.Module, settings: Mapping[str, str]) -> None:
    """Record on the sharded module how this run sharded it."""
    model.__dict__[SETTINGS_ATTRIBUTE] = dict(settings)


def check_reused_module(model: nn.Module, settings: Mapping[str, str]) -> None:
    """A module sharded by an earlier run: refuse this run's settings where they differ from that run's."""
    _refuse_unsharded_parameters(model)
    before = model.__dict__.get(SETTINGS_ATTRIBUTE)
    if before is None:  # sharded outside the strategy (fully_shard by hand): nothing recorded to compare
        return
    changed = [f"{key} was {before.get(key, '(unset)')}, now {value}" for key, value in settings.items()
               if before.get(key) != value]
    if changed:
        raise ValueError(
            "RaggedFSDPStrategy: this module was sharded by an earlier Trainer run with other settings ("
            + "; ".join(changed) + "). Its parameters are that run's shards (layout, dtypes, hooks) and cannot "
            "take new ones. Use the same strategy and precision settings as that run, or pass a fresh, unsharded "
            "module (rebuild it and resume with fit(ckpt_path=...) or load its consolidated weights)."
        )


def _refuse_unsharded_parameters(model: nn.Module) -> None:
    """A module sharded earlier holds only shards: a parameter set since (a head or block replaced between two
    fits) would train whole on every rank with its gradient never averaged, the ranks drifting apart silently."""
    state = get_state(model)
    sharded = {id(p) for group in state.all_groups for dbuffer in group.dbuffers
               for params in (dbuffer.sharded_params, dbuffer.unsharded_params) for p in params.values()}
    added = [name for name, param in model.named_parameters() if id(param) not in sharded]
    if added:
        raise ValueError(
            "RaggedFSDPStrategy: this module was sharded by an earlier run, and parameters set since are not sharded "
            f"({', '.join(added[:5])}{f', ... {len(added)} in all' if len(added) > 5 else ''}): they would train "
            "on each rank alone, their gradients never averaged. Replace modules before the first run, or "
            "build a fresh module with the new parts, load the trained weights into it (a checkpoint with "
            "fit(ckpt_path=...) and strict=False, or lightning_ragged.full_state_dict of this one) and fit that."
        )


def refuse_unsupported_callbacks(trainer: "pl.Trainer") -> None:
    """Lightning callbacks that rewrite parameters as full tensors: refused by name, with what to use instead."""
    from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging

    for callback in trainer.callbacks:
        if isinstance(callback, StochasticWeightAveraging):
            raise ValueError(
                "RaggedFSDPStrategy does not support the StochasticWeightAveraging callback: it keeps an unsharded "
                "torch.optim.swa_utils.AveragedModel copy of the module and averages its full tensors into this "
                "strategy's 1-D shards (Lightning refuses SWA for its sharded strategies too). Use Lightning's "
                "WeightAveraging callback (e.g. WeightAveraging(avg_fn=get_swa_avg_fn()) for SWA's equal-weight "
                "average, or EMAWeightAveraging): under this strategy it averages each rank's shards."
            )
        if isinstance(callback, ModelPruning):
            raise ValueError(
                "RaggedFSDPStrategy does not support the ModelPruning callback: torch.nn.utils.prune replaces each "
                "pruned weight by weight_orig * mask, a mask ranked over the whole tensor, while under this strategy "
                "a module's weight is this rank's 1-D shard between steps. Prune the unsharded model before it is "
                "sharded (torch.nn.utils.prune in configure_model: the mask is kept and pruned weights stay zero, as "
                "under DDP), or the consolidated weights after training."
            )


def apply_sync_batchnorm(layer_sync: Any, model: nn.Module, device: torch.device) -> nn.Module:
    """``Trainer(sync_batchnorm=True)``: torch's SyncBatchNorm in place of BatchNorm, before sharding; CPU refused."""
    if layer_sync is None:
        return model
    batchnorms = [name for name, module in model.named_modules() if isinstance(module, _BatchNorm)]
    if batchnorms and device.type == "cpu":
        raise ValueError(
            f"Trainer(sync_batchnorm=True) with RaggedFSDPStrategy on CPU: torch's SyncBatchNorm, which would replace "
            f"{', '.join(batchnorms[:3])}{', ...' if len(batchnorms) > 3 else ''}, runs on accelerators only (CUDA "
            "and others), not on CPU. Remove sync_batchnorm=True on CPU (each rank then normalizes with its own "
            "batch statistics, as DDP without it), or train on GPUs."
        )
    return layer_sync.apply(model)
