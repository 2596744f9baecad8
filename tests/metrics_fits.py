"""The metrics callback's Lightning fits, in one 2-process start-up: ``python tests/metrics_fits.py OUT_DIR PORT``.

Lightning's launcher re-runs this script for rank 1; both ranks then run, one after the other,
``observability_fit`` (the endpoint on PORT; ``OUT_DIR/observability.json``), ``tuning_fit``'s
three fits (``OUT_DIR/tuning.json``) and ``resume_metrics_fit``'s two (``OUT_DIR/resume.json``). One start-up instead of two: each costs ~7 s of CPU here.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import observability_fit, resume_metrics_fit, tuning_fit  # noqa: E402
from tests.clean_exit import exit_without_teardown  # noqa: E402

if __name__ == "__main__":
    out = Path(sys.argv[1])
    observability_fit.main(out / "observability.json", int(sys.argv[2]))
    tuning_fit.main(out / "tuning.json")
    resume_metrics_fit.main(out / "resume.json", int(sys.argv[2]))
    exit_without_teardown()
