"""Checks of an optimizer before its steps, run once per optimizer (again when its parameter count changes).

Process-wide ``torch.optim`` step pre-hooks (``register_optimizer_step_pre_hook``): a check raises to
refuse the step. Each optimizer is looked at again only after ``add_param_group`` changed its
parameter count, so a step costs one sum over its groups per check.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

_installed: set[Callable[[Optimizer], None]] = set()


def check_before_steps(check: Callable[[Optimizer], None]) -> None:
    """Run ``check(optimizer)`` before the steps of every optimizer (once per process per ``check``)."""
    if check in _installed:
        return
    _installed.add(check)
    seen: "weakref.WeakKeyDictionary[Optimizer, int]" = weakref.WeakKeyDictionary()

    def hook(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        count = sum(len(group["params"]) for group in optimizer.param_groups)
        if seen.get(optimizer) != count:
            check(optimizer)
            seen[optimizer] = count

    register_optimizer_step_pre_hook(hook)
