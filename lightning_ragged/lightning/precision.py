"""Precision glue between Lightning's precision plugins and the ragged FSDP engine.

The Trainer builds an ordinary precision plugin from ``precision=...``; the strategy
swaps it for the matching subclass below. The subclasses change two things:

* clipping uses the sharded, globally all-reduced norm (``grad_clip.py``) instead of
  ``torch.nn.utils.clip_grad_norm_`` on local shards (which would clip by a local norm);
* ``mp_policy()`` tells the engine how to cast: ``"bf16-mixed"`` all-gathers and computes
  in bf16 and reduces gradients in fp32, while the shards (optimizer's master weights)
  stay fp32 — the DBuffer casts once per flat buffer, not per parameter. Lightning's
  autocast stays on for the ops that want fp32 (softmax, norms, losses).

``"16-mixed"`` (fp16 AMP with a gradient scaler) is refused: it needs a sharded grad
scaler whose found-inf flag is all-reduced, which is not implemented.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.optim import Optimizer

from lightning_ragged.engine.grad_clip import clip_grad_norm_, clip_grad_value_

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true", "16-true", "64-true")


class _RaggedClipping:
    """Clip with the global norm over the shards; remembers the sharded module (set by the strategy)."""

    sharded_module: Optional[nn.Module] = None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_norm_(self._clip_target(optimizer), clip_val)

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_value_(self._clip_target(optimizer), clip_val)

    def _clip_target(self, optimizer: Optimizer) -> Any:
        """The module (one flat op per DBuffer) where that clips exactly ``optimizer``'s gradients, else its
        parameters. The module's flat buffers hold every gradient of the module, frozen parameters' too:
        after ``toggle_optimizer`` the other optimizer's parameters keep last step's gradients, which
        clipping this optimizer must neither count nor scale (as DDP's clipping of its parameters)."""
        params = list(self.main_params(optimizer))  # type: ignore[attr-defined]
        module = self.sharded_module
        if module is not None:
            ids = {id(p) for p in params}
            in_module = {id(p) for p in module.parameters()}
            with_grad = {id(p) for p in module.parameters() if p.grad is not None}
            if with_grad <= ids <= in_module:
                return module
        return params

    def mp_policy(self) -> Optional[MixedPrecisionPolicy]:
        return None


class RaggedPrecision(_RaggedClipping, Precision):
    """``"32-true"``."""


class RaggedDoublePrecision(_RaggedClipping, DoublePrecision):
    """``"64-true"``: the module is converted to float64 before sharding."""


class RaggedHalfPrecision(_RaggedClipping, HalfPrecision):
    """``"bf16-true"`` / ``"16-true"``: the module (and so the shards) is converted before sharding."""


class RaggedMixedPrecision(_RaggedClipping, MixedPrecision):
    """``"bf16-mixed"``: bf16 all-gather and compute, fp32 gradient reduction and master shards."""

    def mp_policy(self) -> Optional[MixedPrecisionPolicy]:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


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
    if type(plugin) is MixedPrecision and precision == "bf16-mixed":
        return RaggedMixedPrecision("bf16-mixed", plugin.device)
    if precision == "16-mixed":
        raise ValueError(
            f"{strategy_name} does not support `precision='16-mixed'`: fp16 AMP needs a gradient scaler whose "
            "inf/NaN check is all-reduced over the shards, which is not implemented. Use `precision='bf16-mixed'` "
            "(same memory and speed, no scaler needed), `'bf16-true'` or `'32-true'`."
        )
    raise ValueError(
        f"{strategy_name} does not support the precision plugin {type(plugin).__name__}"
        f"{f' (precision={precision!r})' if precision else ''}. Choose `precision=` among {', '.join(SUPPORTED_PRECISION)}."
    )
