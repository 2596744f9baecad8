"""AdamW with both moments stored as block-wise 8-bit codes, on ragged shards.

State per parameter (local shard): ``exp_avg_codes``/``exp_avg_sq_codes`` (uint8, one per
local element) and ``exp_avg_scales``/``exp_avg_sq_scales`` (fp32, one per block of
``block_size`` elements). Blocks are counted from the *parameter's* start, not the shard's,
so when every shard boundary falls on a block boundary the codes, scales and parameters
are bit-for-bit the same at any world size. A boundary inside a block raises
``RaggedShard boundary violation:``; shard with
``shard_granularity=lightning_ragged.optim.block_granularity(block_size)`` (or "matrix").

Per step (fp32 math, like bitsandbytes/torchao): dequantize → ``torch.optim.AdamW``'s own
step on the fp32 moments (its functional ``torch.optim.adamw.adamw``, single-tensor:
``m = β1·m + (1−β1)·g``, ``v = β2·v + (1−β2)·g²``, ``p ← p·(1 − lr·wd) − lr·(m/bc1)/(√v/√bc2 + eps)``)
→ requantize.

Why not torchao's ``AdamW8bit`` (checked, torchao 0.18 with torch 2.13 CPU): it runs, but its
step is ``torch.compile``d (23 s for the first step of one tensor on this CPU), it keeps fp32
moments for tensors under 4096 elements or whose size is not a multiple of the block size
(most local shards), and it counts blocks from the local tensor's start.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.optim.adamw import adamw

from lightning_ragged.optim.named_state import RaggedOptimizer
from lightning_ragged.optim.quantization import dequantize_blockwise, quantize_blockwise
from lightning_ragged.optim.shards import local_flat


def block_granularity(block_size: int = 256) -> Callable[[str, torch.Tensor], int]:
    """A ``shard_granularity`` for ``fully_shard`` that keeps every block of ``block_size`` elements whole."""

    def granularity(name: str, param: torch.Tensor) -> int:
        return block_size

    return granularity


class AdamW8bit(RaggedOptimizer):
    """AdamW (decoupled weight decay, bias correction) with 8-bit block-wise moments; see the module doc."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        block_size: int = 256,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=block_size)
        _check_values(defaults, "")
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group`` (the constructor's groups come through here too), refusing a shard
        cut inside a block when it is added (Lightning's ``BaseFinetuning`` adds groups mid-run)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_values(group, f"param group {len(self.param_groups) - 1}'s ")
            for param in group["params"]:
                self.shard(param).require_blocks(
                    group["block_size"], f"AdamW8bit (8-bit moments quantized in blocks of {group['block_size']})"
                )
        except ValueError:
            self.param_groups.pop()  # a refused group leaves the optimizer as it was
            for param in group["params"]:
                self._param_names.pop(id(param), None)
            raise

    def state_layout(self, param: torch.Tensor) -> dict[str, str]:
        block = f"blocks:{self.group_of(param)['block_size']}"
        return {
            "step": "scalar",
            "exp_avg_codes": "flat",
            "exp_avg_sq_codes": "flat",
            "exp_avg_scales": block,
            "exp_avg_sq_scales": block,
        }

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self.evaluate_closure(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            block = group["block_size"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                flat = local_flat(param)
                grad = local_flat(param.grad).float()
                state = self.state[param]
                if not state:
                    zeros = torch.zeros_like(grad)
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg_codes"], state["exp_avg_scales"] = quantize_blockwise(zeros, block, signed=True)
                    state["exp_avg_sq_codes"], state["exp_avg_sq_scales"] = quantize_blockwise(zeros, block, signed=False)
                exp_avg = dequantize_blockwise(state["exp_avg_codes"], state["exp_avg_scales"], block, signed=True)
                exp_avg_sq = dequantize_blockwise(state["exp_avg_sq_codes"], state["exp_avg_sq_scales"], block, signed=False)
                adamw(
                    [flat], [grad], [exp_avg], [exp_avg_sq], [], [state["step"]], foreach=False, amsgrad=False,
                    beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=False,
                )
                state["exp_avg_codes"], state["exp_avg_scales"] = quantize_blockwise(exp_avg, block, signed=True)
                state["exp_avg_sq_codes"], state["exp_avg_sq_scales"] = quantize_blockwise(exp_avg_sq, block, signed=False)
        return loss



def _check_values(group: dict[str, Any], where: str) -> None:
    """The defaults' and each group's hyperparameters (a group's ``block_size=0`` divided by zero at the first
    step, ``betas=(0.9,)`` failed there to unpack)."""
    lr, eps, betas, block_size = group["lr"], group["eps"], group["betas"], group["block_size"]
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {where}lr={lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {where}eps={eps}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= beta < 1.0 for beta in betas)):
        raise ValueError(f"Invalid betas: {where}betas={betas!r} must be two numbers in [0, 1)")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{where}block_size={block_size!r} must be a positive int")
