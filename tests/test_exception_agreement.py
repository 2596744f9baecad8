"""An exception on one rank while the others train: no collective save started alone, every process exits.

Without the agreement (``lightning_ragged/lightning/exception_agreement.py``) the failing rank's
``OnExceptionCheckpoint`` enters the sharded save's collectives while the other rank waits in the
step's all-gather: both hang until the process-group timeout (Lightning #6430). The case where every
rank raises, and the checkpoint is written, is in ``tests/lightning_runs.py`` (``main_run``).
"""

from __future__ import annotations

import subprocess
import sys

import torch

from lightning_ragged.checkpoint import consolidate, inspect_checkpoint
from tests.test_strategy import ROOT, _clean_env

HANG_S = 300  # a hang would last the process-group timeout; the job itself takes ~AGREEMENT_S + start-up


def _job_log(tmp_path, *mode: str) -> tuple[int, str]:
    """Run ``tests/exception_job.py`` in ``mode``: its exit code and its output."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "exception_job.py"), str(tmp_path), *mode],
                          env=_clean_env(OMP_NUM_THREADS="1"), cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG_S)
    return proc.returncode, proc.stdout + proc.stderr


def test_one_rank_failing_alone_exits_without_a_half_save(tmp_path) -> None:
    returncode, log = _job_log(tmp_path)
    assert returncode != 0, log[-3000:]
    assert "boom: a failure on rank 1 only" in log, log[-3000:]  # the real error is shown, not hidden by a hang
    assert "[rank 1] RaggedFSDPStrategy: RuntimeError on this rank, but not every rank" in log, log[-3000:]
    # rank 0 then fails in its all-gather (PeerLostError) or is killed first by Lightning's launcher, which stops the
    # job once a child process exits with an error: either way it exits, which is what is asserted above
    assert not (tmp_path / "on_exception").exists() or not any((tmp_path / "on_exception").iterdir())
    periodic = sorted((tmp_path / "periodic").iterdir())  # the checkpoints of the completed steps stay valid
    assert [p.name for p in periodic] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"], periodic
    assert inspect_checkpoint(periodic[-1]).meta["global_step"] == 2


def test_one_rank_failing_alone_with_nothing_to_save_exits_without_waiting(tmp_path) -> None:
    # No on_exception hook saves (ModelCheckpoint's default): before, the failing rank still waited the agreement's
    # bounded time (60 s by default, AGREEMENT_S here) for the others before exiting; DDP exits at once
    returncode, log = _job_log(tmp_path, "no-saver")
    assert returncode != 0, log[-3000:]
    assert "boom: a failure on rank 1 only" in log, log[-3000:]
    assert "not every rank is handling an exception" not in log, log[-3000:]  # nobody waited for an agreement
    periodic = sorted((tmp_path / "periodic").iterdir())
    assert [p.name for p in periodic] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"], periodic


def test_sigterm_on_one_rank_mid_step_stops_every_rank_at_the_same_batch(tmp_path) -> None:
    # Before (Lightning's handler): rank 1 broadcast inside the handler while rank 0 was in the step's
    # all-gather; both waited the whole timeout, then OnExceptionCheckpoint failed on the broken group
    # (CheckpointPeerLostError) and nothing was written. Now both stop after that step and it is saved.
    _, log = _job_log(tmp_path, "sigterm")
    for rank in (0, 1):
        assert f"[rank {rank}] stopped at step 3: SIGTERMException" in log, log[-3000:]
    assert "Timed out" not in log and "not every rank" not in log, log[-3000:]
    saved = tmp_path / "on_exception" / "on_exception.ckpt"
    assert inspect_checkpoint(saved).meta["global_step"] == 3
    # the oracle: the same step saved by ModelCheckpoint on the normal path
    ours, periodic = (consolidate(path, tmp_path / f"{name}.pt") for name, path in
                      (("ours", saved), ("periodic", tmp_path / "periodic" / "epoch=0-step=3.ckpt")))
    ours, periodic = (torch.load(path, weights_only=True)["state_dict"] for path in (ours, periodic))
    assert ours.keys() == periodic.keys()
    assert all(torch.equal(ours[key], periodic[key]) for key in ours)


def test_ranks_out_of_step_after_a_failed_collective_skip_the_exception_save(tmp_path) -> None:
    # Every rank raised, but in different collectives (a barrier only rank 1 called): before, the agreement
    # passed and OnExceptionCheckpoint's first collective paired with a stale one, failing after the save
    # timeout with a misleading "CheckpointPeerLostError ... a network fault between live ranks"
    returncode, log = _job_log(tmp_path, "out-of-step")
    assert returncode != 0, log[-3000:]
    for rank, error in ((0, "CollectiveTimeoutError: collective all_gather"), (1, "RuntimeError: [")):
        assert f"[rank {rank}] RaggedFSDPStrategy: a collective failed on ranks [0, 1] (here: {error}" in log, log[-3000:]
    assert "CheckpointPeerLostError" not in log, log[-3000:]
    assert not (tmp_path / "on_exception").exists() or not any((tmp_path / "on_exception").iterdir())
    periodic = sorted((tmp_path / "periodic").iterdir())  # the checkpoints of the completed steps stay valid
    assert [p.name for p in periodic] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"], periodic
