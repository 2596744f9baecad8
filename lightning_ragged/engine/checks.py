"""Argument checks shared by the engine's entry points (``fully_shard``, the full state dict functions)."""

from __future__ import annotations


def check_flag(name: str, value: object) -> None:
    """Refuse anything but a bool (``1``, ``"yes"`` or ``None`` would read as a flag and mean something else)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be a bool: pass {name}=True or {name}=False")
