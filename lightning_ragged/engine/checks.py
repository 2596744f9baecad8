"""Argument checks shared by the entry points (``fully_shard``, the full state dict functions, checkpoints)."""

from __future__ import annotations


def check_flag(name: str, value: object) -> None:
    """Refuse anything but a bool (``1``, ``"yes"`` or ``None`` would read as a flag and mean something else)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be a bool: pass {name}=True or {name}=False")


def check_optimizer_list(optimizers: object) -> None:
    """Refuse one optimizer where a list of them is taken (``save(path, model, optimizer)``)."""
    from torch.optim import Optimizer

    if isinstance(optimizers, Optimizer):
        raise TypeError(
            f"optimizers={type(optimizers).__name__}(...) must be a list of optimizers: pass [optimizer]"
        )


def check_mp_policy(mp_policy: object) -> None:
    """``mp_policy`` is None or torch's ``MixedPrecisionPolicy`` with floating-point dtypes (a dtype passed alone
    failed deep inside with "'torch.dtype' object has no attribute 'param_dtype'", an int dtype at the first
    step with "Only Tensors of floating point ... can require gradients")."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mp_policy is None:
        return
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy={mp_policy!r} must be a torch.distributed.fsdp.MixedPrecisionPolicy: pass e.g. "
                        "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)")
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(mp_policy, name)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex)):
            raise ValueError(f"mp_policy's {name}={dtype!r} must be a floating-point dtype (e.g. torch.bfloat16) or None")
