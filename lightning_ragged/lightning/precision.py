"""Precision glue between Lightning's precision plugins and the ragged FSDP engine.

The Trainer builds an ordinary precision plugin from ``precision=...``; the strategy
swaps it for the matching subclass below. The subclasses change two things:

* clipping uses the sharded, globally all-reduced norm (``grad_clip.py``) instead of
  ``torch.nn.utils.clip_grad_norm_`` on local shards (which would clip by a local norm);
* ``mp_policy()`` tells the engine how to cast: ``"bf16-mixed"`` (``"16-mixed"``) all-gathers
  and computes in bf16 (fp16) and reduces gradients in fp32, while the shards (optimizer's
  master weights) stay fp32 — the DBuffer casts once per flat buffer, not per parameter.
  Lightning's autocast stays on for the ops that want fp32 (softmax, norms, losses).

``"16-mixed"`` keeps Lightning's loss scaling with torch's ``ShardedGradScaler`` in place of
the plugin's ``GradScaler`` (``sharding.sharded_scaler``): its inf/NaN flag is all-reduced, so
every rank skips the same steps.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import Optimizer

from lightning_ragged.engine.grad_clip import clip_grad_norm_, clip_grad_value_, clip_target
from lightning_ragged.lightning.knobs import unsupported_precision
from lightning_ragged.lightning.sharding import mp_policy_for, sharded_scaler


class _RaggedClipping:
    """Clip with the global norm over the shards; remembers the sharded module (set by the strategy)."""

    sharded_module: Optional[nn.Module] = None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_norm_(self._clip_target(optimizer), clip_val)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_value_(self._clip_target(optimizer), clip_val)

    def _clip_target(self, optimizer: Optimizer) -> Any:
        return clip_target(self.sharded_module, self.main_params(optimizer))  # type: ignore[attr-defined]

    def mp_policy(self) -> Optional[MixedPrecisionPolicy]:
        return None


class RaggedPrecision(_RaggedClipping, Precision):
    """``"32-true"``."""


class RaggedDoublePrecision(_RaggedClipping, DoublePrecision):
    """``"64-true"``: the module is converted to float64 before sharding."""


class RaggedHalfPrecision(_RaggedClipping, HalfPrecision):
    """``"bf16-true"`` / ``"16-true"``: the module (and so the shards) is converted before sharding."""


class RaggedMixedPrecision(_RaggedClipping, MixedPrecision):
    """``"bf16-mixed"`` / ``"16-mixed"``: bf16 / fp16 all-gather and compute, fp32 gradient reduction and master
    shards; fp16 with a ``ShardedGradScaler``."""

    def mp_policy(self) -> Optional[MixedPrecisionPolicy]:
        return mp_policy_for(self.precision)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The scaler's state also under Lightning's own plugin's key, which DDP's and any other strategy's
        ``MixedPrecision`` restores from (Lightning files it under the plugin's class name)."""
        state = self.state_dict()
        if state:
            checkpoint[MixedPrecision.__qualname__] = state

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of another strategy (DDP's ``MixedPrecision``, FSDP's ``FSDPPrecision``) holds the scaler's
        state under its plugin's name; ours, when present, is loaded after this by Lightning and wins."""
        for key in (MixedPrecision.__qualname__, "FSDPPrecision"):
            if key in checkpoint and type(self).__qualname__ not in checkpoint:
                self.load_state_dict(checkpoint[key])
                return


def to_ragged_precision(plugin: Optional[Precision], strategy_name: str = "RaggedFSDPStrategy") -> Optional[Precision]:
    """The ragged-aware counterpart of a Lightning precision plugin (or a clear error)."""
    if plugin is None or isinstance(plugin, _RaggedClipping):
        return plugin
    precision = getattr(plugin, "precision", None)
    if type(plugin) is Precision:
        return RaggedPrecision()
    if type(plugin) is DoublePrecision:
        return RaggedDoublePrecision()
    if type(plugin) is HalfPrecision:
        return RaggedHalfPrecision(plugin.precision)
    if type(plugin) is MixedPrecision and precision in ("bf16-mixed", "16-mixed"):
        return RaggedMixedPrecision(precision, plugin.device, sharded_scaler(plugin.scaler, plugin.device))
    raise unsupported_precision(strategy_name, type(plugin).__name__, precision)
