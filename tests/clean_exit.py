"""End a finished test script without interpreter teardown.

Known open problem (pytorch#190489): a process that still holds gloo process groups at
interpreter teardown sometimes aborts ("terminate called without an active exception") after
all its work is done, turning a run whose results are written into exit status -6. Scripts the
tests launch call :func:`exit_without_teardown` as their last statement; an exception before it
still fails the run.
"""

from __future__ import annotations

import os
import sys


def exit_without_teardown() -> None:
    """Flush the output streams and end the process with status 0, skipping interpreter teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
