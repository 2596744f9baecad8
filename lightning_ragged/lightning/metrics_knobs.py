"""Refuse bad ``RaggedFSDPMetrics`` arguments in its constructor, as ``knobs.py`` does the strategy's.

Without it a bad value surfaced inside ``fit``: ``monitor_port=70000`` as a bare ``OverflowError``
from rank 0's ``bind`` (the others then failed in an unrelated collective), ``heartbeat_interval=0``
as a heartbeat thread writing the store in a tight loop.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from lightning_ragged.lightning.knobs import (
    _flag,
    _int_at_least,
    _is_int,
    _message,
    _monitor_address,
    _monitor_port,
    _refuse,
    _Refused,
    _type_name,
)


def _seconds(name: str, optional: bool = False) -> Callable[[Any], None]:
    """A check that the value is a positive, finite number of seconds (or None where ``optional``)."""
    def check(value: Any) -> None:
        if value is None and optional:
            return
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            _refuse(f"must be a number of seconds, got {_type_name(value)}", f"pass e.g. {name}=30.0", TypeError)
        if not (math.isfinite(value) and value > 0):
            _refuse("must be a positive, finite number of seconds", f"pass e.g. {name}=30.0")

    return check


METRICS_CHECKS: dict[str, Callable[[Any], None]] = {
    "log_every_n_steps": _int_at_least(1, "must be a positive int or None",
                                       "pass e.g. log_every_n_steps=50, or None (the Trainer's)", optional=True),
    "per_group": _flag("per_group"),
    "count_copies_every_n_steps": _int_at_least(0, "must be an int >= 0",
                                                "pass e.g. count_copies_every_n_steps=100 (0: off)"),
    "monitor_port": _monitor_port,
    "monitor_address": _monitor_address,
    "health_timeout": _seconds("health_timeout"),
    "heartbeat_interval": _seconds("heartbeat_interval"),
    "diagnostics": _flag("diagnostics"),
    "collective_timeout": _seconds("collective_timeout", optional=True),
    "log_metrics": _flag("log_metrics"),
    "tuning": _flag("tuning"),
    "memory_budget_bytes": _int_at_least(1, "must be a positive int (bytes) or None",
                                         "pass e.g. memory_budget_bytes=80 * 2**30, or None (the device's)",
                                         optional=True),
}
"""One check per argument of ``RaggedFSDPMetrics.__init__`` (a test keeps the two in step)."""


def check_metrics_knobs(knobs: Mapping[str, Any]) -> None:
    """Raise ``TypeError``/``ValueError`` naming the first bad argument, its value and the fix."""
    for name, value in knobs.items():
        try:
            METRICS_CHECKS[name](value)
        except _Refused as refused:
            raise refused.error(_message("RaggedFSDPMetrics", name, value, refused)) from None
    timeout, interval = knobs.get("health_timeout"), knobs.get("heartbeat_interval")
    if timeout is not None and interval is not None and timeout < 2 * interval:
        raise ValueError(  # a healthy rank's last report can be one interval old: /health answered 503 "stalled"
            f"RaggedFSDPMetrics(health_timeout={timeout!r}) must be at least twice heartbeat_interval={interval!r}: "
            f"ranks report every {interval} s, so /health would call healthy ranks stalled; pass e.g. "
            f"health_timeout={2 * interval!r} or a shorter heartbeat_interval"
        )
