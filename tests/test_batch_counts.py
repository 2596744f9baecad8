"""A loop with a different number of batches per rank stops at its start on every rank, with the counts.

Before (``lightning_ragged/lightning/batch_counts.py``), the rank with more batches waited in an all-gather its
peer never issued, for the whole process-group timeout, then reported "the ranks are out of step" without a cause.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.test_strategy import ROOT, _clean_env

HANG_S = 300  # a hang lasts the job's 60 s process-group timeout plus its start-up; the check answers at once


@pytest.mark.parametrize("loop", ["training", "validation"])
def test_uneven_batches_per_rank_are_refused_on_every_rank(loop: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "batch_counts_job.py"), loop],
                          env=_clean_env(OMP_NUM_THREADS="1"), cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG_S)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    message = f"UnevenBatchesError: the {loop} loop has a different number of batches per rank (rank 0: 3; rank 1: 5)"
    for rank in (0, 1):
        assert f"[rank {rank}] {message}" in log, log[-3000:]
