"""``python -m lightning_ragged.plan``: a thin entry; the CLI is ``lightning_ragged.cli.plan``.

``lightning_ragged.plan`` is the planner *function* (``from lightning_ragged import plan``);
this file only exists so that ``python -m lightning_ragged.plan`` runs the CLI (``-m`` finds
the file without binding it to the package). Importing it as a module would rebind
``lightning_ragged.plan`` from the function to this module, so that is refused with the two
names to use instead.
"""

import sys

if __name__ != "__main__":
    raise ImportError(
        "lightning_ragged.plan is the planner function (from lightning_ragged import plan); the plan report CLI "
        "is lightning_ragged.cli.plan (python -m lightning_ragged.plan runs it)"
    )

from lightning_ragged.cli.plan import main

sys.exit(main())
