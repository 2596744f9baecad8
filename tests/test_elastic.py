"""Elastic resize for real: 3 torchrun agents ("nodes"), one SIGKILLed mid-run, training goes on at world 2.

``torchrun --nnodes=2:3 --nproc-per-node=1 --max-restarts=3`` three times on one c10d
rendezvous endpoint (127.0.0.1, a free port), running ``tests/elastic_job.py`` (the recipe of
docs/operations.md, "Elastic resize"). After the checkpoint of step 4 is written and step 5
is done, one node (its agent and its worker) is SIGKILLed. The survivors must fail fast
with ``PeerLostError`` naming the dead rank, their agents must restart them at world size
2, and the restart must resume from that checkpoint, resharded from 3 ranks to 2.

Oracles, each independent of the elastic machinery:

* the checkpoint the restart loaded is copied aside (by the restarted rank 0, before
  ``fit``), consolidated here into one ordinary file and a *direct* world-2 resume from
  that file runs (``--oracle``: no kill, no agents restarting, the full-file load path
  instead of the DCP resharding one). The restarted run's per-rank losses and final
  parameters must equal the direct resume's: the elastic path added nothing and lost
  nothing beyond the last checkpoint (the second scenario's checkpoint holds the same
  training state, compared tensor by tensor, so it reuses the first's direct resume);
* the first loss after the restart, on each rank, must equal the loss of a plain,
  unsharded ``TinyGPT`` loaded with the consolidated weights on the batch that rank
  recorded: the restart really started from the checkpoint's weights.

Node choice: the c10d rendezvous store lives in the first agent (torchrun's own single
point of failure, documented); the node killed is the last one started, whatever rank its
worker got (rank 0 also hosts the workers' TCPStore: the agents run with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, see docs/operations.md). Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_ragged.checkpoint import consolidate, inspect_checkpoint
from lightning_ragged.lightning.elastic import checkpoint_candidates, newest_checkpoint, restart_count, torchrun_world

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "elastic_job.py"
sys.path.insert(0, str(ROOT))
from tests.elastic_job import CHECKPOINT_STEP, GATE_STEP, MAX_STEPS  # noqa: E402

READY_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 120.0
RDZV_CONF = "join_timeout=150,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3,close_timeout=10"


# ------------------------------------------------------------------------------ helpers
def test_torchrun_world_and_restart_count_from_the_environment():
    assert torchrun_world({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2"}) == {"num_nodes": 3, "devices": 2}
    assert torchrun_world({}) == {}
    with pytest.raises(ValueError, match="not a multiple"):
        torchrun_world({"WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "2"})
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2 and restart_count({}) == 0
    shared = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True",
              "TORCHELASTIC_MAX_RESTARTS": "3", "RANK": "0"}
    with pytest.warns(UserWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and the c10d rendezvous") as caught:
        torchrun_world(shared)
    assert "static rendezvous" not in str(caught[0].message)
    # the variable set and the store still shared: the static rendezvous (measured: restarts fail to connect with
    # the variable set; --standalone or --rdzv-backend=c10d restart fine). Before, the warning said to set it
    with pytest.warns(UserWarning, match="static rendezvous .* add --rdzv-backend=c10d or --standalone"):
        torchrun_world({**shared, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchrun_world({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"})
        torchrun_world({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"})


def test_a_per_node_device_count_torchrun_did_not_start_is_refused_before_launch(monkeypatch) -> None:
    """``torchrun --nproc-per-node 2`` on one node with ``Trainer(devices=1, num_nodes=2)``: the product matches the
    world (what Lightning checks), the node does not. Before: a bare ``IndexError`` in ``root_device`` at setup (DDP
    the same); now the Trainer's constructor names both counts and the fix."""
    import lightning.pytorch as pl

    from lightning_ragged import RaggedFSDPStrategy

    for key, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"devices=1 per node, but torchrun started 2 processes on this node .*"
                                         r"Trainer\(devices=2, num_nodes=1\)"):
        pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=RaggedFSDPStrategy(), logger=False)


def _save_plain_checkpoint(path: Path, step: int) -> None:
    from lightning_ragged.checkpoint import save

    save(path, torch.nn.Linear(3, 2), extra={"global_step": step})


def test_newest_checkpoint_finds_hidden_complete_copies(tmp_path):
    """What an interrupted save can leave: no ``last.ckpt`` (a two-step publish killed between its renames), an
    unfinished copy, a half-deleted one, a hidden version not yet linked; the newest complete one is chosen."""
    from lightning_ragged.checkpoint import OLD_PREFIX, TMP_PREFIX
    from lightning_ragged.checkpoint.atomic_dir import hidden_sibling
    from lightning_ragged.lightning.elastic import VERSION_PREFIX

    assert newest_checkpoint(tmp_path) is None and newest_checkpoint(tmp_path / "absent") is None
    last = tmp_path / "last.ckpt"
    _save_plain_checkpoint(last, 2)
    assert newest_checkpoint(tmp_path) == str(last)
    (tmp_path / "last.ckpt.link").symlink_to(last)  # a link counts once
    assert checkpoint_candidates(tmp_path) == [last]
    (tmp_path / "last.ckpt.link").unlink()
    # the window: the previous checkpoint moved aside, the new complete one not yet renamed into place
    old = hidden_sibling(last, OLD_PREFIX)
    os.replace(last, old)
    time.sleep(0.01)
    new = hidden_sibling(last, TMP_PREFIX)
    _save_plain_checkpoint(tmp_path / "staging", 4)
    os.replace(tmp_path / "staging", new)
    assert not last.exists()
    assert newest_checkpoint(tmp_path) == str(new)
    assert inspect_checkpoint(newest_checkpoint(tmp_path)).meta["global_step"] == 4
    # an unfinished save (no meta.pt yet) is skipped for the previous, complete one
    (new / "meta.pt").unlink()
    assert newest_checkpoint(tmp_path) == str(old)
    # a half-deleted one does not validate either
    for data in old.glob("*.distcp"):
        data.unlink()
    assert newest_checkpoint(tmp_path) is None
    # link publishing: a complete hidden version renamed into place but not linked yet
    if VERSION_PREFIX:
        version = tmp_path / f"{VERSION_PREFIX}0123456789ab.v3"
        _save_plain_checkpoint(tmp_path / "staging", 6)
        os.replace(tmp_path / "staging", version)
        assert newest_checkpoint(tmp_path) == str(version)
        last.symlink_to(version.name)  # ... and once linked, the visible name is the one chosen
        assert checkpoint_candidates(tmp_path)[0] == last and newest_checkpoint(tmp_path) == str(last)


def _save_full_then_weights_only(directory: str) -> None:
    from lightning_ragged import fully_shard
    from lightning_ragged.checkpoint import save

    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    save(Path(directory) / "epoch=0-step=4", model, [optimizer], extra={"global_step": 4})
    time.sleep(0.01)
    save(Path(directory) / "weights-step=6", model, extra={"global_step": 6})


def test_newest_checkpoint_prefers_a_resumable_checkpoint_to_a_newer_weights_only_one(tmp_path, dist_pool):
    """``ModelCheckpoint(save_weights_only=True)`` beside full saves: the newer weights-only checkpoint
    (directory or file) would restart the optimizers from scratch, so the newest full one is chosen;
    a weights-only one only when nothing else validates."""
    dist_pool(1).run(_save_full_then_weights_only, str(tmp_path))
    full = tmp_path / "epoch=0-step=4"
    assert checkpoint_candidates(tmp_path)[0].name == "weights-step=6"
    assert newest_checkpoint(tmp_path) == str(full)
    time.sleep(0.01)  # Lightning's single files: a weights-only one lacks "optimizer_states"
    torch.save({"state_dict": {}, "global_step": 8}, tmp_path / "weights-step=8.ckpt")
    assert newest_checkpoint(tmp_path) == str(full)
    time.sleep(0.01)
    torch.save({"state_dict": {}, "optimizer_states": [{}], "global_step": 10}, tmp_path / "step=10.ckpt")
    assert newest_checkpoint(tmp_path) == str(tmp_path / "step=10.ckpt")
    for entry in (tmp_path / "step=10.ckpt", full / "meta.pt"):
        entry.unlink()  # nothing resumable left: the newest weights-only one
    assert newest_checkpoint(tmp_path) == str(tmp_path / "weights-step=8.ckpt")


# ------------------------------------------------------------------------------ the real run
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _env() -> dict:
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is part of the recipe: with the agent's shared store the
    # restarted workers read the dead round's gloo addresses and fail to connect (pytorch#135712).
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
            "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _agent(
    out: Path, port: int, name: str, nnodes: str, extra: tuple = (), nproc: int = 1, conf: str = ""
) -> subprocess.Popen:
    log = open(out / f"agent.{name}.log", "w")
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        "--max-restarts=3", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=elastic-{port}",
        f"--rdzv-conf={RDZV_CONF}{conf}", "--monitor-interval=0.2", str(JOB), str(out), *extra,
    ]
    process = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    process.log = log  # type: ignore[attr-defined]
    return process


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_until(condition, seconds: float, what: str, logs: Path) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            tails = "".join(f"\n--- {f.name} ---\n{f.read_text()[-2500:]}" for f in sorted(logs.glob("agent.*.log")))
            raise AssertionError(f"timed out waiting for {what}{tails}")
        time.sleep(0.1)


def _steps(out: Path, tag: str, rank: int) -> list[dict]:
    file = out / f"steps.{tag}.{rank}.jsonl"
    return [json.loads(line) for line in file.read_text().splitlines()] if file.exists() else []


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        process.log.close()


STORE_SERVER = (
    "import sys, time, datetime\n"
    "from torch.distributed import TCPStore\n"
    "store = TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, wait_for_workers=False,\n"
    "                 timeout=datetime.timedelta(seconds=300))\n"
    "time.sleep(float(sys.argv[2]))\n"
)


# Oracle 1 runs once per distinct checkpoint: both scenarios resume from the checkpoint of step 4 of the same
# seeded world-3 training, so when its training state (compared tensor by tensor) equals one already resumed
# directly, that direct run's losses and parameters are the oracle (one torchrun and two Lightning starts fewer).
TRAINING_STATE = ("state_dict", "optimizer_states", "lr_schedulers", "loops", "global_step", "epoch")
_DIRECT_RESUMES: list[tuple[dict, tuple[list[list[dict]], dict]]] = []


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("scenario", ["lose-rank-2", "lose-rank-0"])
def test_node_loss_restarts_at_world_2_and_resumes_resharded(tmp_path, scenario):
    """``lose-rank-2``: plain torchrun, the first agent hosts the c10d rendezvous store, the last node is lost.

    ``lose-rank-0``: the rendezvous store runs outside the nodes (``--rdzv-conf is_host=false``
    on every agent, a TCPStore server of its own: the production layout) and the node of
    worker rank 0, which also hosts the workers' TCPStore, is lost.
    """
    out = tmp_path
    started = time.monotonic()
    port = _free_port()
    agents: dict[str, subprocess.Popen] = {}
    conf = ""
    if scenario == "lose-rank-0":
        log = open(out / "agent.store.log", "w")
        agents["store"] = subprocess.Popen([sys.executable, "-c", STORE_SERVER, str(port), str(RUN_TIMEOUT_S * 2)],
                                           env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        agents["store"].log = log  # type: ignore[attr-defined]
        conf = ",is_host=false"
    try:
        agents["a"] = _agent(out, port, "a", "2:3", conf=conf)
        # the store is up: agent "a" hosts it (lose-rank-2) or the server process does (lose-rank-0)
        _wait_until(lambda: _listening(port) or any(a.poll() is not None for a in agents.values()), 30,
                    "the rendezvous store", out)
        agents["b"] = _agent(out, port, "b", "2:3", conf=conf)
        agents["c"] = _agent(out, port, "c", "2:3", conf=conf)
        nodes = ("a", "b", "c")
        ready = [out / f"ready.{rank}.json" for rank in range(3)]
        _wait_until(lambda: all(p.exists() for p in ready) or any(agents[n].poll() is not None for n in nodes),
                    READY_TIMEOUT_S, "3 workers at the gate", out)
        assert all(p.exists() for p in ready), "an agent exited before its worker reached the gate"
        workers = {json.loads(p.read_text())["rank"]: json.loads(p.read_text()) for p in ready}
        assert all(w["world"] == 3 for w in workers.values())
        node_of = {rank: next(n for n in nodes if agents[n].pid == w["agent"]) for rank, w in workers.items()}
        # the node to lose. Never the host of the c10d rendezvous store ("a" in lose-rank-2): that is
        # torchrun's single point of failure (documented); anything else may go.
        if scenario == "lose-rank-2":
            name = "c"
            victim = next(rank for rank, n in node_of.items() if n == name)
        else:
            victim = 0
            name = node_of[0]
        assert inspect_checkpoint(out / "ckpt" / "last.ckpt").meta["global_step"] == CHECKPOINT_STEP
        os.kill(workers[victim]["pid"], signal.SIGKILL)  # the whole node: its worker and its agent
        os.killpg(agents[name].pid, signal.SIGKILL)
        agents[name].wait(timeout=10)
        _wait_until(lambda: _gone(workers[victim]["pid"]), 10, "the victim's worker to die", out)
        killed_at = time.time()
        (out / "go").write_text("")
        survivors = [n for n in nodes if n != name]
        _wait_until(lambda: all(agents[n].poll() is not None for n in survivors), RUN_TIMEOUT_S,
                    "the survivors to finish", out)
        elastic_seconds = time.monotonic() - started
        logs = "".join(f"\n--- {n} ---\n{(out / f'agent.{n}.log').read_text()[-3000:]}" for n in survivors)
        assert all(agents[n].returncode == 0 for n in survivors), logs

        # ---- fail fast: the survivors named the lost rank within seconds of the kill
        gated = workers[next(r for r in workers if r != victim)]["tag"]  # the fresh start at world 3
        errors = [json.loads((out / f"error.{gated}.{rank}.json").read_text()) for rank in workers if rank != victim]
        for error in errors:
            assert error["type"] == "PeerLostError", error["traceback"]
            assert error["lost_ranks"] == [victim] and f"rank {victim}'s connection closed" in error["message"]
            if victim == 0:
                assert "Rank 0, which hosts the rendezvous store" in error["message"]
            assert error["time"] - killed_at < 15
        before = [_steps(out, gated, rank) for rank in workers if rank != victim]
        assert all([r["step"] for r in steps] == list(range(GATE_STEP)) for steps in before)  # 0..4, then killed
        # ---- the next start: world 2, from the checkpoint of step 4 (written at world 3: resharded 3 -> 2)
        starts = sorted((json.loads(f.read_text()) for f in out.glob("start.*.json")), key=lambda r: r["time"])
        assert starts, logs
        resumed = starts[0]
        assert resumed["world"] == 2 and resumed["path"] == str(out / "ckpt" / "last.ckpt")  # what "last" finds
        assert inspect_checkpoint(resumed["copy"]).meta["global_step"] == CHECKPOINT_STEP
        assert inspect_checkpoint(resumed["copy"]).format["world_size"] == 3
        tag = resumed["tag"]
        after = [_steps(out, tag, rank) for rank in range(2)]
        for steps in after:
            assert [r["step"] for r in steps] == list(range(CHECKPOINT_STEP, MAX_STEPS)), steps
            assert all(r["world"] == 2 for r in steps)
        final = torch.load(out / f"final.{tag}.pt", weights_only=True)
        assert final["global_step"] == MAX_STEPS and final["world"] == 2
        # a later start (an agent counting a finished worker as failed) must not train again
        for later in starts[1:]:
            assert inspect_checkpoint(later["copy"]).meta["global_step"] == MAX_STEPS, later
        if starts[1:]:
            print(f"{scenario}: {len(starts) - 1} extra start(s) after the job finished: {[r['tag'] for r in starts]}")

        # ---- oracle 1: a direct world-2 resume from the same checkpoint, consolidated into one file
        # (torchrun --nnodes=1 with two processes: the same world size and ranks, nothing killed)
        consolidated = consolidate(resumed["copy"], out / "oracle-input.ckpt")
        checkpoint = torch.load(consolidated, weights_only=False)
        training_state = {key: checkpoint[key] for key in TRAINING_STATE}
        direct_run = next((run for state, run in _DIRECT_RESUMES if _equal(state, training_state)), None)
        reused = direct_run is not None
        if direct_run is None:
            agents["oracle"] = _agent(out, _free_port(), "oracle", "1", ("--oracle", str(consolidated)), nproc=2)
            _wait_until(lambda: agents["oracle"].poll() is not None, RUN_TIMEOUT_S, "the oracle run", out)
            assert agents["oracle"].returncode == 0, (out / "agent.oracle.log").read_text()[-4000:]
            direct_run = ([_steps(out, "oracle", rank) for rank in range(2)],
                          torch.load(out / "final.oracle.pt", weights_only=True))
            _DIRECT_RESUMES.append((training_state, direct_run))
        direct_steps, direct_final = direct_run
        for rank in range(2):
            elastic = [(r["step"], r["loss"]) for r in after[rank]]
            direct = [(r["step"], r["loss"]) for r in direct_steps[rank]]
            assert elastic == direct, (rank, elastic, direct)
        assert direct_final["global_step"] == MAX_STEPS
        assert direct_final["params"].keys() == final["params"].keys()
        for key, value in final["params"].items():
            assert torch.equal(value, direct_final["params"][key]), key

        # ---- oracle 2: the first loss after the restart, from the checkpoint's weights in a plain model
        from tests.lightning_models import VOCAB, TinyGPT

        state = checkpoint["state_dict"]
        plain = TinyGPT()
        plain.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
        with torch.no_grad():
            for rank in range(2):
                tokens = torch.load(out / f"batch.{tag}.{rank}.pt", weights_only=True)
                logits = plain(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).item()
                assert loss == pytest.approx(after[rank][0]["loss"], rel=1e-5, abs=1e-6), rank
        print(f"{scenario}: lost rank {victim} (node {name}); elastic run {elastic_seconds:.1f} s, "
              f"total {time.monotonic() - started:.1f} s; direct resume {'reused' if reused else 'run'}")
    finally:
        _stop(list(agents.values()))
        for pid in [int(p.name) for p in (out / "pids").glob("*")] if (out / "pids").exists() else []:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
