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
