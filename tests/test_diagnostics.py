"""A lost peer is named as one: ``PeerLostError`` says whose connection closed and when, never "did not finish within".

Real processes: 3 gloo ranks (``tests/diagnostics_job.py``) block in an all-gather while
the test SIGKILLs the rank they wait for; the survivors' errors are read back. Killing rank
0 also kills the TCPStore it hosts, and the message must say so. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_ragged.engine import collective_errors
ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "diagnostics_job.py"
WORLD = 3
START_TIMEOUT_S = 60.0
RESULT_TIMEOUT_S = 30.0


# ------------------------------------------------------------------------ classification
GLOO_RESET = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:9876: Connection reset by "
    "peer. This is typically caused by a remote worker hanging or bugs in the application."
)
GLOO_CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:948. This "
    "is typically caused by a remote worker crashing."
)
GLOO_TIMEOUT = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 2000ms for recv"


@pytest.mark.parametrize("text", [GLOO_RESET, GLOO_CLOSED, "Write error: Broken pipe", "NCCL error: ncclRemoteError"])
def test_connection_errors_are_peer_loss_not_timeouts(text):
    assert collective_errors.is_peer_lost(RuntimeError(text))
    assert not collective_errors.is_timeout(RuntimeError(text))


def test_a_real_timeout_is_still_a_timeout():
    assert collective_errors.is_timeout(RuntimeError(GLOO_TIMEOUT))
    assert not collective_errors.is_peer_lost(RuntimeError(GLOO_TIMEOUT))
    assert issubclass(collective_errors.PeerLostError, collective_errors.CollectiveTimeoutError)  # old handlers still catch it


# ------------------------------------------------------------------------ real processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(paths: list[Path], seconds: float, processes: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + seconds
    while not all(path.exists() for path in paths):
        dead = [p.args[2] for p in processes if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise AssertionError(f"ranks did not get ready (exited early: ranks {dead}); waited for {paths}")
        time.sleep(0.05)


def _kill_mid_collective(tmp_path: Path, victim: int) -> tuple[dict[int, dict], float]:
    """Start ``WORLD`` ranks, SIGKILL ``victim`` while the others wait for it in an all-gather; their results."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    logs = [open(tmp_path / f"rank{rank}.log", "w") for rank in range(WORLD)]
    processes = [
        subprocess.Popen(
            [sys.executable, str(JOB), str(rank), str(WORLD), str(port), str(victim), str(tmp_path)],
            cwd=ROOT, env=env, stdout=logs[rank], stderr=subprocess.STDOUT,
        )
        for rank in range(WORLD)
    ]
    survivors = [rank for rank in range(WORLD) if rank != victim]
    try:
        _wait_for([tmp_path / "victim.ready"] + [tmp_path / f"entering.{r}" for r in survivors], START_TIMEOUT_S,
                  processes)
        time.sleep(1.0)  # the survivors are now blocked in the all-gather the victim never joins
        killed_at = time.time()
        processes[victim].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        for rank in survivors:
            processes[rank].wait(timeout=max(0.1, deadline - time.monotonic()))
        results = {}
        for rank in survivors:
            file = tmp_path / f"result.{rank}.json"
            assert file.exists(), f"rank {rank} wrote no result:\n{(tmp_path / f'rank{rank}.log').read_text()[-3000:]}"
            results[rank] = json.loads(file.read_text())
        return results, killed_at
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
        for log in logs:
            log.close()


def _check_common(result: dict, killed_at: float) -> None:
    assert result["type"] == "PeerLostError", result.get("traceback") or result
    message = result["message"]
    assert "connection closed" in message and "peer lost" in message
    assert "did not finish within" not in message and "this is not a timeout" in message
    assert result["collective"] == "all_gather" and result["step"] == 1
    # named within the grace period (5 s) of the kill, not after the 60 s timeout
    assert result["raised_at"] - killed_at < 15, result["raised_at"] - killed_at
    assert result["failed_at"] >= killed_at - 0.5


def test_killed_peer_is_named_by_the_survivors(tmp_path):
    results, killed_at = _kill_mid_collective(tmp_path, victim=2)
    for rank, result in results.items():
        _check_common(result, killed_at)
        assert result["lost_ranks"] == [2] and result["arrived_ranks"] == [0, 1] and not result["store_lost"]
        assert "rank 2's connection closed" in result["message"], result["message"]
        assert "Rank 2 did not answer within 5 s" in result["message"] and "ranks [0, 1] are alive" in result["message"]


def test_killed_store_host_is_named(tmp_path):
    results, killed_at = _kill_mid_collective(tmp_path, victim=0)
    for rank, result in results.items():
        _check_common(result, killed_at)
        assert result["store_lost"] and result["lost_ranks"] == [0]
        message = result["message"]
        assert "rank 0's connection closed" in message, message
        assert "Rank 0, which hosts the rendezvous store (TCPStore 127.0.0.1:" in message and "is gone" in message
        assert "ranks [] were waiting" not in message and "unknown" not in message.split("Backend error")[0]
