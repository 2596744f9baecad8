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


# ------------------------------------------------------------------------ NCCL flight recorder
FR_DUMPS = ROOT / "tests" / "fixtures" / "flight_recorder"  # tests/fixtures/make_flight_recorder_dumps.py


def _torch_analyzer_missing(dumps: dict) -> list[tuple[int, str, set[int]]]:
    """Oracle: torch's own fr_trace matcher over the same entries (gloo leaves pg_config empty: given here;
    torch < 2.13's matcher parses only NCCL/XCCL names, so the entries it reads are labelled nccl)."""
    import copy

    pytest.importorskip("torch.distributed.flight_recorder", reason="torch's analyzer ships from torch 2.10 on (the "
                        "oracle only; lightning_ragged reads the dumps itself)")
    from torch.distributed.flight_recorder.components.builder import build_collectives, build_groups_memberships
    from torch.distributed.flight_recorder.components.utils import align_trace_from_beginning

    names = {e["process_group"] for d in dumps.values() for e in d["entries"]}
    ranks = str(sorted(dumps))
    pg_config = {r: {name: {"name": name, "desc": desc, "ranks": ranks} for name, desc in names} for r in dumps}
    _, groups, _, memberships, guids = build_groups_memberships(pg_config)
    entries = align_trace_from_beginning({r: copy.deepcopy(d["entries"]) for r, d in dumps.items()})
    for entry in (e for rank_entries in entries.values() for e in rank_entries):
        entry["profiling_name"] = entry["profiling_name"].replace("gloo:", "nccl:", 1)
    _, collectives, _ = build_collectives(entries, groups, memberships, guids, dumps[0]["version"])
    return [(c.collective_seq_id, c.collective_name, c.missing_ranks) for c in collectives if c.missing_ranks]


def test_flight_recorder_dump_names_the_stuck_collective_and_missing_rank():
    from lightning_ragged import TensorSpec, plan
    from lightning_ragged.observability import flight_recorder

    dumps = flight_recorder.read_dumps(FR_DUMPS)
    assert sorted(dumps) == [0, 1, 2]
    # the fixture's stuck collective is the all-gather of a 12-element DBuffer over 3 ranks: name it from that
    # layout's signatures, so the sizes the engine derives must match the ones torch's recorder wrote
    groups = flight_recorder.collective_signatures([("blocks.0", plan([TensorSpec("w", 12, 1)], 3))])
    error = flight_recorder.stall_from_dumps(dumps, groups=groups, step=3)
    assert isinstance(error, collective_errors.CollectiveTimeoutError)
    # oracle 1: torch's analyzer; oracle 2: torch's own per-group counters written in the dumps
    [(sequence, name, missing)] = _torch_analyzer_missing(dumps)
    enqueued = {r: next(iter(d["pg_status"].values()))["last_enqueued_collective"] for r, d in dumps.items()}
    assert error.missing_ranks == sorted(missing) == [r for r, n in enqueued.items() if n < max(enqueued.values())]
    assert error.arrived_ranks == [0, 1] and error.sequence == sequence == max(enqueued.values())
    assert error.collective == "all_gather" and name.endswith("all_gather")
    assert error.group == "blocks.0" and error.step == 3
    message = str(error)
    for words in ("FSDP group 'blocks.0'", "step 3", f"collective #{sequence}", "ranks [2] did not arrive",
                  "rank 2 at #6", "ranks [0, 1] were waiting"):
        assert words in message, message
    unnamed = flight_recorder.stall_from_dumps(dumps)  # without sizes -> group names: the process group
    assert "process group" in unnamed.group and "unknown step" in str(unnamed) and unnamed.missing_ranks == [2]


def test_flight_recorder_dumps_without_a_stall_and_with_a_rank_missing():
    from lightning_ragged.observability import flight_recorder

    dumps = flight_recorder.read_dumps(FR_DUMPS)
    arrived = {r: dumps[r] for r in (0, 1)}
    assert flight_recorder.stall_from_dumps(arrived) is None  # the two that dumped agree
    in_step = {r: {**d, "entries": [e for e in d["entries"] if e["collective_seq_id"] <= 6]} for r, d in dumps.items()}
    assert flight_recorder.stall_from_dumps(in_step) is None


def test_flight_recorder_names_a_rank_that_died_without_a_dump():
    """NCCL dumps carry each process group's members in ``pg_config`` (gloo's leave it empty): a member
    that wrote no dump (its process died first) is missing, and the message says it wrote none."""
    from lightning_ragged.observability import flight_recorder

    dumps = flight_recorder.read_dumps(FR_DUMPS)
    config = {"1": {"name": "1", "desc": "undefined", "ranks": "[0, 1, 2]"}}
    survivors = {r: {**dumps[r], "pg_config": config} for r in (0, 1)}
    error = flight_recorder.stall_from_dumps(survivors)
    assert error.missing_ranks == [2] and error.arrived_ranks == [0, 1]
    assert "rank 2: no dump" in str(error) and "Ranks [2] wrote no dump" in str(error)


def test_collective_signatures_name_every_engine_collective_of_a_layout():
    """The engine's all-gather, both reductions and HSDP's replica all-reduce of one DBuffer's layout."""
    from lightning_ragged import TensorSpec, plan
    from lightning_ragged.observability import flight_recorder

    layout = plan([TensorSpec("w", 12, 3), TensorSpec("b", 5, 1)], 2)
    full, segment = layout.buffer_numel, layout.segment_size
    signatures = flight_recorder.collective_signatures([("blocks.0", layout), ("blocks.1", layout)])
    assert signatures == {
        key: "blocks.0 or blocks.1"
        for key in (("all_gather", segment, full), ("reduce_scatter", full, segment), ("all_reduce", full, full),
                    ("all_reduce", segment, segment))
    }


def test_flight_recorder_loader_executes_nothing(tmp_path):
    import pickle

    from lightning_ragged.observability import flight_recorder

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bad = tmp_path / "nccl_trace_rank_0"
    bad.write_bytes(pickle.dumps({"version": "2.10", "entries": [Evil()]}))
    with pytest.raises(ValueError, match="refused, nothing executed"):
        flight_recorder.read_dumps(tmp_path)
    assert not marker.exists()
    (tmp_path / "nccl_trace_rank_0").write_bytes(pickle.dumps({"not": "a dump"}))
    with pytest.raises(ValueError, match="not a flight-recorder dump"):
        flight_recorder.load_dump(bad)


def test_configure_flight_recorder_on_the_process_environment(tmp_path, monkeypatch):
    """The strategy's call: ``os.environ`` itself (a mapping that refuses non-string keys)."""
    from lightning_ragged.observability import flight_recorder

    names = ["TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
             "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"]
    for name in names:
        monkeypatch.delenv(name, raising=False)
    applied = flight_recorder.configure_flight_recorder("nccl", tmp_path / "fr")
    assert sorted(applied) == sorted(names[:3]) and all(os.environ[name] == applied[name] for name in applied)


def test_configure_flight_recorder_sets_only_what_the_user_did_not(tmp_path):
    from lightning_ragged.observability import flight_recorder

    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "77"}
    applied = flight_recorder.configure_flight_recorder("nccl", tmp_path / "fr", environ=env)
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "77" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in applied
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "fr" / "nccl_trace_rank_")
    assert (tmp_path / "fr").is_dir()
    newer = {"TORCH_FR_DUMP_TEMP_FILE": "/elsewhere/trace_", "TORCH_FR_BUFFER_SIZE": "5"}  # torch's newer names
    assert list(flight_recorder.configure_flight_recorder("nccl", tmp_path, environ=newer)) == ["TORCH_NCCL_DUMP_ON_TIMEOUT"]
    assert flight_recorder.configure_flight_recorder("gloo", tmp_path, environ={}) == {}
    applied = flight_recorder.configure_flight_recorder("cpu:gloo,cuda:nccl", tmp_path, 10, environ={})
    assert applied["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "10"
    with pytest.raises(ValueError, match="buffer_size=0"):
        flight_recorder.configure_flight_recorder("nccl", tmp_path, 0, environ={})
