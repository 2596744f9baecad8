"""``python -m lightning_ragged.plan``: the plan report CLI (the code is in ``plan_cli.py``).

``lightning_ragged.plan`` is also the planner *function* (``from lightning_ragged import
plan``). Importing this module as ``lightning_ragged.plan`` makes Python bind the module
to the package attribute ``plan``, over the function; so the module is made callable and
forwards calls to :func:`lightning_ragged.planning.plan`: ``lightning_ragged.plan(specs,
world_size)`` keeps working whichever was imported first. Run as ``-m`` it only runs the
CLI (the package's ``plan`` function is untouched).
"""

from __future__ import annotations

import sys
import types

from lightning_ragged.plan_cli import main
from lightning_ragged.planning import plan as _plan


class _CallablePlanModule(types.ModuleType):
    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return _plan(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallablePlanModule
