"""``strategy="ragged_fsdp"`` under a real Slurm: training, a settings mismatch, and SIGUSR1 preemption.

Needs a Slurm controller and a node with 4 CPUs (``.ci/slurm_up.sh`` starts one on loopback;
``.ci/run`` calls it). Without Slurm the tests skip with the reason; under ``CI=true`` they fail.

Every job runs ``srun python tests/slurm_job.py`` in a 1-node, 2-tasks-per-node allocation. The
jobs of this file are submitted together and driven by one polling loop (Slurm runs two at a
time on the 4 CPUs); every wait has a deadline and every job still alive at the end is cancelled.

* (a) an uninterrupted run: ``SLURMEnvironment`` detected, 2 ranks, the loss falls; it is also
  the reference of (c);
* (b) ``devices=3`` in that allocation: the ``srun`` step fails right away with a message
  naming the setting and the fix;
* (c) ``TRIALS`` preemptions: ``scancel --signal=USR1`` (delivered to the tasks of every step,
  where Lightning's handler lives; ``--signal=B:USR1`` would reach only the batch shell) once
  the job reports a step drawn at random; nothing in the job waits to make the timing
  convenient. The ranks agree at a batch end, save the hpc checkpoint and requeue the job; the
  test lifts Slurm's requeue hold (``scontrol update JobId=J StartTime=now``), and the resumed
  run's final parameters must equal the reference's bit for bit.

``RAGGED_SLURM_SEED`` fixes the random steps (shown in failures and, with ``-s``, in a summary).

``test_two_node_training_under_slurm`` needs partition "two" (``.ci/slurm_up.sh --two-nodes``:
nodes n1 and n2, one slurmd in each of two network namespaces joined through veths): one
2-node x 1-task job, ``RaggedFSDPStrategy`` with ``num_nodes=2, devices=1`` and
``GLOO_SOCKET_IFNAME`` set to each namespace's veth, trained plainly and with HSDP
(``replicate_degree="node"``), one after the other in one ``srun`` step: the ranks run on
different nodes and the loss falls. It runs after the jobs above (its own deadline); without
the partition it skips (fails under CI=true).

``test_deferred_requeue_with_fake_slurm`` needs no Slurm (SLURM variables and a fake
``scontrol``): a signal to one rank only, a failing requeue (training goes on), then a
successful one (SIGTERM absorbed, exit status 0).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Iterator, Optional

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
JOB_SCRIPT = REPO / "tests" / "slurm_job.py"
# Every process start (torch + Lightning imports) costs ~7 s of CPU on 2 cores, more than 100 steps do:
# the runs are short and the trials few; each CI run draws new signal steps.
MAX_STEPS = 100
TRIALS = 1
SIGNAL_STEPS = (5, MAX_STEPS - 25)  # the step after which SIGUSR1 is sent is drawn from this range
TOTAL_DEADLINE_S = 300.0  # every job of the file; a healthy run takes 1-2 minutes on 2 cores
REQUEUE_DEADLINE_S = 90.0  # from the signal until the job is pending again (a deadlock ends here)
POLL_S = 0.05
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# Variables of the submitting process that must not reach the jobs (each job picks its own port).
LEAKY_ENV = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"}
# One mismatch in the real allocation (a job step of its own); every kind is also checked in process with
# srun's variables (tests/test_strategy.py::test_mismatched_slurm_allocation_fails_clearly).
MISMATCHES = ((["--devices", "3"], "`devices=3`", "`--ntasks-per-node=2`", "HINT: Set `devices=2`"),)


# ------------------------------------------------------------------------------- Slurm access
def _slurm_missing() -> Optional[str]:
    """Why these tests cannot run here, or ``None``."""
    tools = [tool for tool in ("sbatch", "srun", "scontrol", "scancel", "sinfo") if shutil.which(tool) is None]
    if tools:
        return f"Slurm client tools not found: {', '.join(tools)} (as root: .ci/slurm_up.sh)"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10)
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%t %c"], capture_output=True, text=True, timeout=10).stdout
    except subprocess.TimeoutExpired:
        return "the Slurm controller did not answer within 10 s"
    if "is UP" not in ping.stdout:
        return f"no Slurm controller answers (`scontrol ping`: {(ping.stdout + ping.stderr).strip()!r}); run .ci/slurm_up.sh"
    fields = nodes.split()
    cpus = [int(c) for s, c in zip(fields[::2], fields[1::2]) if s.rstrip("*~#$@") in ("idle", "mix", "alloc")]
    if not cpus or max(cpus) < 4:
        return f"no Slurm node with 4 CPUs is up (sinfo: {nodes.strip()!r}); run .ci/slurm_up.sh"
    return None


@pytest.fixture(scope="module")
def slurm() -> None:
    """Skip without a usable Slurm, with the reason; under ``CI=true``, fail instead."""
    reason = _slurm_missing()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but Slurm is not usable: {reason}")
    pytest.skip(reason)


def _scontrol_jobs() -> dict[str, dict[str, str]]:
    """``scontrol -o show job``: every job the controller knows, one call."""
    out = subprocess.run(["scontrol", "-o", "show", "job"], capture_output=True, text=True, timeout=30).stdout
    jobs = {}
    for line in out.splitlines():
        info = dict(re.findall(r"(\w+)=(\S*)", line))
        if "JobId" in info:
            jobs[info["JobId"]] = info
    return jobs


@dataclass
class Job:
    """One submitted job and what the driver saw of it."""

    name: str
    out: Path
    steps: list[list[str]] = field(default_factory=lambda: [[]])  # extra arguments of each `srun` step
    signal_at: Optional[int] = None  # a preemption trial: SIGUSR1 once the job reports this step
    id: str = ""
    phase: str = "queued"  # queued -> [signalled -> released ->] done, or failed
    state: str = ""
    info: dict[str, str] = field(default_factory=dict)
    error: str = ""
    events: dict[str, float] = field(default_factory=dict)

    def submit(self, env: dict[str, str]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        srun = f"srun {sys.executable} {JOB_SCRIPT} --out {self.out} --max-steps {MAX_STEPS}"
        cmd = [
            "sbatch", "--parsable", "--job-name", f"ragged-{self.name}", "--nodes=1", "--ntasks-per-node=2",
            "--cpus-per-task=1", "--output", str(self.out / "slurm-%j.out"), "--open-mode=append",
            f"--chdir={REPO}", "--export=ALL", "--wrap", "; ".join(f"{srun} {' '.join(a)}" for a in self.steps),
        ]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed ({result.returncode}): {result.stderr.strip()}")
        self.id = result.stdout.strip().split(";")[0]
        self.events["submitted"] = time.monotonic()

    @property
    def log(self) -> str:
        path = self.out / f"slurm-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def last_step(self) -> int:
        steps = re.findall(r"PROGRESS step=(\d+)", self.log)
        return int(steps[-1]) if steps else 0

    def records(self, restart: int = 0) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.out.glob(f"requeue-r*-run{restart}.json"))]

    def result(self) -> dict:
        path = self.out / "result.json"
        assert path.exists(), f"no result.json: the run did not reach max_steps\n{self.describe()}"
        return json.loads(path.read_text())

    def fail(self, message: str) -> None:
        self.phase, self.error = "failed", message

    def describe(self) -> str:
        tail = "\n".join(line for line in self.log.splitlines() if "PROGRESS" not in line)
        tail = "\n".join(tail.splitlines()[-30:])
        return (
            f"[{self.name}: job {self.id}, {self.phase}, state {self.state}, last step {self.last_step()}] "
            f"{self.error}\n--- job output without PROGRESS lines (tail) ---\n{tail}"
        )


def _command_fails(job: Job, *cmd: str) -> bool:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        job.fail(f"`{' '.join(cmd)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result.returncode != 0


def _advance(job: Job, info: Optional[dict[str, str]], now: float) -> None:
    """One look at a job: move it through its phases (never waits)."""
    if info is None:
        job.fail("the controller no longer knows the job")
        return
    job.info, job.state = info, info.get("JobState", "")
    restarts = int(info.get("Restarts", "0") or 0)
    if job.signal_at is None or job.phase == "released":
        if job.state in FINISHED:
            job.phase = "done"
            job.events["done"] = now
        return
    if job.phase == "queued":
        if job.state in FINISHED:
            job.fail(f"ended ({job.state}) before step {job.signal_at}, where SIGUSR1 was due")
        elif job.state == "RUNNING" and job.last_step() >= job.signal_at:
            if _command_fails(job, "scancel", "--signal=USR1", job.id):
                return
            job.phase, job.events["signalled"] = "signalled", now
    elif job.phase == "signalled":
        if job.state == "PENDING" and restarts >= 1:
            # A requeued job is held ~120 s (Reason=BeginTime); release it.
            if _command_fails(job, "scontrol", "update", f"JobId={job.id}", "StartTime=now"):
                return
            job.phase, job.events["released"] = "released", now
        elif job.state in FINISHED:
            job.fail(f"ended ({job.state}) after SIGUSR1 instead of being requeued")
        elif now - job.events["signalled"] > REQUEUE_DEADLINE_S:
            job.fail(f"not requeued within {REQUEUE_DEADLINE_S:.0f} s of SIGUSR1 (a deadlock in the save?)")


def _drive(jobs: list[Job], deadline_s: float) -> None:
    start = time.monotonic()
    active = [job for job in jobs if job.phase not in ("done", "failed")]
    while active:
        now = time.monotonic()
        if now - start > deadline_s:
            for job in active:
                job.fail(f"still {job.phase} ({job.state}) when the file's deadline of {deadline_s:.0f} s passed")
            break
        known = _scontrol_jobs()
        for job in active:
            _advance(job, known.get(job.id), now)
        active = [job for job in active if job.phase not in ("done", "failed")]
        time.sleep(POLL_S)


@dataclass
class Campaign:
    seed: int
    reference: Job
    mismatch: Job
    trials: list[Job]
    seconds: float


@pytest.fixture(scope="module")
def campaign(slurm: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Campaign]:
    seed = int(os.environ.get("RAGGED_SLURM_SEED", time.time_ns() % 2**31))
    rng = random.Random(seed)
    root = tmp_path_factory.mktemp("slurm")
    reference = Job("reference", root / "reference")
    mismatch = Job("mismatch", root / "mismatch", steps=[args for args, *_ in MISMATCHES])
    trials = [Job(f"trial{i}", root / f"trial{i}", signal_at=rng.randint(*SIGNAL_STEPS)) for i in range(TRIALS)]
    jobs = [mismatch, reference, *trials]
    env = {k: v for k, v in os.environ.items() if k not in LEAKY_ENV and not k.startswith("SLURM_")}
    start = time.monotonic()
    try:
        for job in jobs:
            job.submit(env)
        _drive(jobs, TOTAL_DEADLINE_S)
        yield Campaign(seed, reference, mismatch, trials, time.monotonic() - start)
    finally:
        for job in jobs:  # nothing outlives the tests
            if job.id and job.phase != "done":
                subprocess.run(["scancel", job.id], capture_output=True, timeout=30)


# ------------------------------------------------------------------------------------- tests
FAKE_SCONTROL = """#!/bin/sh
# Stands in for Slurm's scontrol: logs the call; the first requeue fails, the next one "requeues"
# the job by sending SIGTERM to its tasks, as slurmd does when a running job is requeued.
echo "$@" >> "{log}"
[ "$(wc -l < "{log}")" -ge 2 ] || exit 1
kill -TERM $(cat "{pids}")
"""


def test_a_stuck_scontrol_is_a_failed_requeue(tmp_path: Path, monkeypatch) -> None:
    # Before: rank 0 waited for scontrol without a limit while the other ranks waited in the broadcast of
    # its answer, until the process-group timeout
    from lightning_ragged.lightning import preemption

    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\nsleep 60\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setattr(preemption, "SCONTROL_TIMEOUT_S", 0.5)
    assert preemption._requeue_job() is False


def test_deferred_requeue_with_fake_slurm(tmp_path: Path) -> None:
    """No Slurm needed: SLURM variables, a fake ``scontrol``, SIGUSR1 sent to *one* rank at a time.

    The first signal (rank 1 only) is agreed on by both ranks at a batch end and saved; the
    requeue fails, so training goes on (as with Lightning). The second (rank 0 only) is saved
    again; the requeue "succeeds" (SIGTERM to both tasks, absorbed) and both ranks exit with 0.
    """
    fake_bin, out = tmp_path / "bin", tmp_path / "out"
    fake_bin.mkdir()
    out.mkdir()
    log, pids = tmp_path / "scontrol.log", tmp_path / "pids"
    scontrol = fake_bin / "scontrol"
    scontrol.write_text(FAKE_SCONTROL.format(log=log, pids=pids))
    scontrol.chmod(0o755)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if k not in LEAKY_ENV and not k.startswith("SLURM_")}
    base.update(
        PATH=f"{fake_bin}{os.pathsep}{base.get('PATH', '')}", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_JOB_NAME="ragged-fake",
        SLURM_JOB_ID="4711", SLURM_NODELIST="localhost",
    )  # fmt: skip
    cmd = [sys.executable, str(JOB_SCRIPT), "--out", str(out), "--max-steps", "2000", "--sigterm-wait", "30"]
    stdout = tmp_path / "rank0.out"
    procs = []
    with open(stdout, "w") as rank0_out:
        for rank in range(2):
            env = dict(base, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NODEID="0")
            procs.append(subprocess.Popen(cmd, env=env, stdout=rank0_out if rank == 0 else subprocess.DEVNULL,
                                          stderr=subprocess.STDOUT, cwd=REPO))  # fmt: skip
        pids.write_text(" ".join(str(p.pid) for p in procs))
        try:
            deadline = time.monotonic() + 120

            def wait_for(condition, what: str) -> None:
                while not condition():
                    codes = [p.poll() for p in procs]
                    assert None in codes, f"the ranks exited ({codes}) while waiting for {what}:\n{stdout.read_text()[-3000:]}"
                    assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{stdout.read_text()[-3000:]}"
                    time.sleep(POLL_S)

            def step() -> int:
                steps = re.findall(r"PROGRESS step=(\d+)", stdout.read_text())
                return int(steps[-1]) if steps else 0

            wait_for(lambda: step() >= 10, "step 10")
            procs[1].send_signal(signal.SIGUSR1)  # rank 1 only
            wait_for(lambda: log.exists() and (out / "root" / "hpc_ckpt_1.ckpt").is_dir(), "the first save")
            first_save = step()
            wait_for(lambda: step() >= first_save + 5, "training to go on after the failed requeue")
            procs[0].send_signal(signal.SIGUSR1)  # rank 0 only
            codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    text = stdout.read_text()
    assert codes == [0, 0], f"exit codes {codes}\n{text[-3000:]}"
    assert log.read_text().split("\n")[:2] == ["requeue 4711", "requeue 4711"], log.read_text()
    assert (out / "root" / "hpc_ckpt_2.ckpt").is_dir(), sorted(p.name for p in (out / "root").iterdir())
    assert "SLURM requeue failed; training goes on" in text
    records = [json.loads((out / f"requeue-r{rank}-run0.json").read_text()) for rank in range(2)]
    assert [r["signal_step"] is not None for r in records] == [True, True]  # rank 1: the first signal
    assert records[0]["saved_step"] == records[1]["saved_step"] > first_save
    assert all(r["requeued"] and r["sigterm_after_requeue"] and r["requeue_attempts"] == 2 for r in records), records
    assert not (out / "final.pt").exists()  # the requeued run did not run past its stop


def test_training_run_under_slurm(campaign: Campaign) -> None:
    job = campaign.reference
    assert job.phase == "done" and job.state == "COMPLETED", job.describe()
    result = job.result()
    assert result["environment"] == "SLURMEnvironment", result["environment"]
    assert result["world_size"] == 2 and result["global_step"] == MAX_STEPS and result["restart"] == 0
    assert result["requeue_callback"], "the strategy did not attach the deferred SLURM requeue"
    assert "SLURM auto-requeueing enabled" in job.log
    losses = result["losses"]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.5 * first, f"the loss did not fall: first 10 steps {first:.4f}, last 10 {last:.4f}"


def test_mismatch_fails_fast(campaign: Campaign) -> None:
    job = campaign.mismatch
    assert job.phase == "done", job.describe()
    assert job.state == "FAILED", f"expected FAILED\n{job.describe()}"
    log = job.log
    assert log.count("RaggedFSDPStrategy: the Trainer settings do not match the cluster allocation") >= len(MISMATCHES), \
        job.describe()
    for _, *phrases in MISMATCHES:
        for phrase in phrases:
            assert phrase in log, f"{phrase!r} missing from the error\n{job.describe()}"
    assert "PROGRESS" not in log and "Initializing distributed" not in log, "a mismatched run started training"


def test_preemption_requeue_resume_is_bit_exact(campaign: Campaign) -> None:
    reference = campaign.reference
    assert reference.phase == "done" and reference.state == "COMPLETED", reference.describe()
    expected = torch.load(reference.out / "final.pt", weights_only=True)
    summary, failures = [], []
    for job in campaign.trials:
        try:
            assert job.phase == "done" and job.state == "COMPLETED", job.describe()
            assert int(job.info.get("Restarts", 0)) == 1, f"Restarts={job.info.get('Restarts')}\n{job.describe()}"
            records = job.records(restart=0)
            assert len(records) == 2, f"requeue records of {len(records)} ranks\n{job.describe()}"
            saved = {r["saved_step"] for r in records}
            assert len(saved) == 1 and all(r["requeued"] for r in records), f"{records}\n{job.describe()}"
            # exited cleanly: Slurm's SIGTERM came while the ranks waited for it, and was absorbed
            assert all(r["sigterm_after_requeue"] for r in records), f"{records}\n{job.describe()}"
            (saved_step,) = saved
            assert job.signal_at <= saved_step < MAX_STEPS, f"saved at {saved_step}\n{job.describe()}"
            result = job.result()
            assert result["restart"] == 1 and result["global_step"] == MAX_STEPS, result
            actual = torch.load(job.out / "final.pt", weights_only=True)
            assert actual.keys() == expected.keys()
            differ = [k for k in expected if not torch.equal(actual[k], expected[k])]
            assert not differ, f"the resumed run's parameters differ from the uninterrupted run's: {differ[:5]}"
            landed = ", ".join(f"rank {r['rank']} at step {r['signal_step']} in {r['signal_where']}" for r in records)
            summary.append(
                f"{job.name}: USR1 sent after step {job.signal_at}; landed {landed}; all ranks saved at step "
                f"{saved_step}; requeued {job.events['released'] - job.events['signalled']:.1f} s after the signal; "
                f"resumed to step {MAX_STEPS}: {len(expected)} tensors bit-exact"
            )
        except AssertionError as error:
            failures.append(f"{job.name} (signal after step {job.signal_at}): {error}")
    print(f"\nRAGGED_SLURM_SEED={campaign.seed}; all jobs of the file took {campaign.seconds:.0f} s")
    print("\n".join(summary))
    assert not failures, f"RAGGED_SLURM_SEED={campaign.seed}\n" + "\n\n".join(failures)


# ------------------------------------------------------------------------------- two nodes
# `.ci/slurm_up.sh --two-nodes`: partition "two", nodes n1 and n2, one slurmd in each of two network
# namespaces (veth rs-n1 at 10.213.0.1, rs-n2 at 10.213.0.2). The node names resolve nowhere, so
# the job sets MASTER_ADDR to n1's address, and each task binds gloo to its namespace's veth.
TWO_NODE_PARTITION = "two"
TWO_NODE_MASTER_ADDR = "10.213.0.1"
TWO_NODE_STEPS = 100
TWO_NODE_DEADLINE_S = 120.0  # the whole job (two 100-step runs in one process start take ~30 s)
TWO_NODE_RUNS = {"fsdp": "1", "hsdp": "node"}  # --replicate-degree of each srun step


def _two_nodes_missing() -> Optional[str]:
    try:
        nodes = subprocess.run(["sinfo", "-h", "-N", "-p", TWO_NODE_PARTITION, "-o", "%N %t"],
                               capture_output=True, text=True, timeout=10).stdout  # fmt: skip
    except subprocess.TimeoutExpired:
        return "the Slurm controller did not answer within 10 s"
    up = {name for name, state in (line.split() for line in nodes.splitlines() if line.strip())
          if state.rstrip("*~#$@") in ("idle", "mix", "alloc")}  # fmt: skip
    if up != {"n1", "n2"}:
        return (f"partition {TWO_NODE_PARTITION!r} does not have nodes n1 and n2 up (sinfo: {nodes.strip()!r}); "
                "run .ci/slurm_up.sh --two-nodes")  # fmt: skip
    return None


@pytest.fixture(scope="module")
def two_node_job(slurm: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    reason = _two_nodes_missing()
    if reason is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but the two-node Slurm partition is not usable: {reason}")
        pytest.skip(reason)
    job = Job("two-nodes", tmp_path_factory.mktemp("slurm-two"))
    job.out.mkdir(parents=True, exist_ok=True)
    degrees = " ".join(f"--replicate-degree {degree}" for degree in TWO_NODE_RUNS.values())
    task = (f"GLOO_SOCKET_IFNAME=rs-$SLURMD_NODENAME exec {sys.executable} {JOB_SCRIPT} --out {job.out} "
            f"--num-nodes 2 --devices 1 --max-steps {TWO_NODE_STEPS} {degrees}")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in LEAKY_ENV and not k.startswith("SLURM_")}
    cmd = [
        "sbatch", "--parsable", "--job-name", "ragged-two-nodes", "-p", TWO_NODE_PARTITION, "--nodes=2",
        "--ntasks-per-node=1", "--cpus-per-task=1", "--no-requeue", "--output", str(job.out / "slurm-%j.out"),
        f"--chdir={REPO}", "--export=ALL", "--wrap", f"export MASTER_ADDR={TWO_NODE_MASTER_ADDR}; srun bash -c '{task}'",
    ]  # fmt: skip
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
        assert result.returncode == 0, f"sbatch failed ({result.returncode}): {result.stderr.strip()}"
        job.id = result.stdout.strip().split(";")[0]
        job.events["submitted"] = time.monotonic()
        _drive([job], TWO_NODE_DEADLINE_S)
        yield job
    finally:
        if job.id and job.phase != "done":
            subprocess.run(["scancel", job.id], capture_output=True, timeout=30)


@pytest.mark.parametrize("run", list(TWO_NODE_RUNS))
def test_two_node_training_under_slurm(two_node_job: Job, run: str) -> None:
    """2 nodes x 1 task (``num_nodes=2, devices=1``), each node its own network namespace: the
    ranks sit on different nodes, the loss falls; ``hsdp``: ``replicate_degree="node"`` gives 2
    replicas of 1 shard."""
    job = two_node_job
    assert job.phase == "done" and job.state == "COMPLETED", job.describe()
    assert sorted(job.info.get("NodeList", "").replace("n[1-2]", "n1,n2").split(",")) == ["n1", "n2"], job.info
    path = job.out / f"degree-{TWO_NODE_RUNS[run]}" / "result.json"
    assert path.exists(), f"no {run}/result.json\n{job.describe()}"
    result = json.loads(path.read_text())
    assert result["environment"] == "SLURMEnvironment", result["environment"]
    assert result["world_size"] == 2 and result["num_nodes"] == 2 and result["global_step"] == TWO_NODE_STEPS
    assert sorted(result["nodes"]) == ["n1", "n2"], f"ranks on nodes {result['nodes']}"
    expected = (2, 1) if run == "hsdp" else (1, 2)
    assert (result["replicate_size"], result["shard_size"]) == expected, result
    losses = result["losses"]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.5 * first, f"the loss did not fall: first 10 steps {first:.4f}, last 10 {last:.4f}"
