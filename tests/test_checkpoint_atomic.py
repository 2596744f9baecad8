"""Crash safety of publishing a checkpoint (``atomic_dir.py``), and a frozen peer during a save.

* **A kill between every pair of filesystem steps.** A forked child trains a step, saves
  ``last.ckpt``, trains another and saves again, and ``os._exit``s right after step *i*
  of that second save (the hook ``atomic_dir.on_step``); for every *i* the parent then
  checks that Lightning's ``ckpt_path="last"`` resolution and our loader find a complete
  checkpoint -- the new one if its ``publish`` step completed, else the previous one -- and
  that resuming from it is bit-identical to the uninterrupted run. For sharded directories
  published by exchange (this filesystem) and as symlinks to versions (forced), async saves,
  single files, and the one-time migration of a real directory to a link.
* **States an older two-rename publish left** (no ``last.ckpt``, two complete hidden copies):
  the loader takes the newest complete copy, never an incomplete one, and the next save
  keeps it until it is published.
* **A frozen peer** (SIGSTOP in the middle of writing its shards) on a 2-rank gloo run with
  a 3 s timeout: the survivor raises ``CollectiveTimeoutError`` naming the checkpoint, the
  collective and the rank that did not arrive, for an async and a sync save.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_ragged as lr
from lightning_ragged import checkpoint as ck
from lightning_ragged.checkpoint import atomic_dir
from lightning_ragged.engine.collective_errors import CollectiveTimeoutError
from tests.models import lm_loss, make_batches, make_model

STEPS = 3
BATCHES = make_batches(STEPS, 4)
CRASHED = 77  # the child's exit status when the injected kill fired
CHILD_TIMEOUT_S = 60
TIMEOUT_S = 3  # the frozen-peer runs' process-group timeout


@contextlib.contextmanager
def _one_thread():
    """Same intra-op threads in the parent as in the children: reductions in the same order (bit-exact)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _fresh(seed: int = 0):
    model = make_model(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, optimizer, steps) -> None:
    for index in steps:
        lm_loss(model, BATCHES[index]).backward()
        optimizer.step()
        optimizer.zero_grad()


def _state(model, optimizer) -> dict[str, torch.Tensor]:
    state = {f"param/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for name, param in model.named_parameters():
        for key, value in optimizer.state[param].items():
            state[f"optim/{name}/{key}"] = torch.as_tensor(value).clone()
    return state


# ------------------------------------------------------------- kill between steps
KINDS = {
    "exchange": dict(),  # sharded directory, published by an atomic exchange of the two names
    "link": dict(),  # sharded directory, published as a symlink to a hidden version
    "async": dict(async_save=True),
    "full": dict(full=True),  # one ordinary file
    "migrate": dict(),  # the previous checkpoint is a real directory, the new one a link (no exchange)
}


def _child(root: Path, kind: str, crash_after: int | None, record: Path | None) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    options = KINDS[kind]
    atomic_dir.use_exchange = False if kind == "link" else None
    model, optimizer = _fresh()
    _train(model, optimizer, [0])
    ck.save(root / "last.ckpt", model, [optimizer], {"step": 1}, **options)
    ck.wait_for_pending_save()
    _train(model, optimizer, [1])
    if kind == "migrate":
        atomic_dir.use_exchange = False
    seen: list[str] = []

    def hook(name: str, path: Path) -> None:
        seen.append(name)
        if crash_after is not None and len(seen) == crash_after + 1:
            os._exit(CRASHED)  # no cleanup of any kind, as a SIGKILL or a lost node

    with atomic_dir.on_step(hook):
        ck.save(root / "last.ckpt", model, [optimizer], {"step": 2}, **options)
        ck.wait_for_pending_save()
    if record is not None:
        record.write_text(json.dumps(seen))


def _run_child(root: Path, kind: str, crash_after: int | None = None, record: Path | None = None) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            _child(root, kind, crash_after, record)
        except BaseException:
            traceback.print_exc()
            code = 3
        os._exit(code)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the {kind} save child did not finish within {CHILD_TIMEOUT_S}s")


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    with _one_thread():
        model, optimizer = _fresh()
        _train(model, optimizer, range(STEPS))
        return _state(model, optimizer)


@pytest.fixture(scope="module")
def resolve_last():
    """Lightning's own resolution of ``ckpt_path="last"`` for a ModelCheckpoint(save_last=True) in a directory."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.states import TrainerFn

    callback = ModelCheckpoint(dirpath=tempfile.mkdtemp(prefix="ragged_last_"), save_last=True)
    trainer = Trainer(callbacks=[callback], logger=False, enable_progress_bar=False, enable_model_summary=False)

    def resolve(dirpath: Path):
        callback.dirpath = str(dirpath)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "there is no last checkpoint available"
            return trainer._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", True, True)

    return resolve


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_kill_between_any_two_steps_leaves_last_resolving_to_a_complete_checkpoint(
    kind, tmp_path, reference, resolve_last
) -> None:
    record = tmp_path / "steps.json"
    (tmp_path / "record").mkdir()
    assert _run_child(tmp_path / "record", kind, record=record) == 0
    steps = json.loads(record.read_text())
    assert steps.count("publish") == 1 and steps[-1] == "remove_old", steps
    expected_kinds = {"link": "rename_version", "migrate": "retire_old", "full": "write_file"}
    if kind in expected_kinds:
        assert expected_kinds[kind] in steps, steps

    for index, name in enumerate(steps):
        root = tmp_path / f"after_{index}_{name}"
        root.mkdir()
        assert _run_child(root, kind, crash_after=index) == CRASHED, name
        published = "publish" in steps[: index + 1]
        last = root / "last.ckpt"
        where = f"{kind}: killed after step {index} ({name}); on disk: {sorted(os.listdir(root))}"

        chosen = resolve_last(root)
        if kind == "migrate" and name == "retire_old":
            # The one two-step publish (a real directory replaced without exchange): last.ckpt is absent
            # here, so Lightning finds nothing; the loader finds the new complete version.
            assert not os.path.lexists(last), where
        else:
            assert chosen is not None and Path(chosen) == last, where

        with _one_thread():
            model, optimizer = _fresh(seed=5)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                extra = ck.load(last, model, [optimizer])
            assert extra["step"] == (2 if published or name == "retire_old" else 1), where
            _train(model, optimizer, range(extra["step"], STEPS))
            resumed = _state(model, optimizer)
        assert resumed.keys() == reference.keys(), where
        different = [key for key in reference if not torch.equal(reference[key], resumed[key])]
        assert not different, f"{where}: resume differs from the uninterrupted run in {different[:5]}"

        # The next save cleans up whatever the crash left (and is itself complete).
        ck.save(last, model, [optimizer], {"step": STEPS}, **{k: v for k, v in KINDS[kind].items() if k != "async_save"})
        left = sorted(p.name for p in root.iterdir() if p.name.startswith(".") and p != atomic_dir.linked_version(last))
        assert left == [], f"{where}: left behind after the next save: {left}"
        assert ck.load(last, *_fresh_pair())["step"] == STEPS


def _fresh_pair():
    model, optimizer = _fresh(seed=6)
    return model, [optimizer]


# ------------------------------------------------------------- older crash states
def _two_checkpoints(root: Path) -> tuple[Path, Path]:
    model, optimizer = _fresh()
    ck.save(root / "one", model, [optimizer], {"step": 1})
    _train(model, optimizer, [0])
    ck.save(root / "two", model, [optimizer], {"step": 2})
    return root / "one", root / "two"


def test_an_interrupted_two_rename_publish_loads_the_newest_complete_copy(tmp_path) -> None:
    one, two = _two_checkpoints(tmp_path)
    last = tmp_path / "last.ckpt"
    # What the previous publish left when killed between its two renames: no last.ckpt,
    # the previous checkpoint moved aside, the new complete one still hidden.
    os.replace(one, atomic_dir.hidden_sibling(last, ck.OLD_PREFIX))
    os.replace(two, ck.partial_path(last))
    with pytest.warns(UserWarning, match="loading the newest complete copy"):
        assert ck.load(last, *_fresh_pair())["step"] == 2

    # An interrupted save's next save keeps that copy until it has published its own.
    model, optimizer = _fresh()
    with pytest.raises(_Crash), atomic_dir.on_step(_raise_after("write_meta")):
        ck.save(last, model, [optimizer], {"step": 3})
    assert not last.exists()
    with pytest.warns(UserWarning, match="newest complete copy"):
        assert ck.load(last, *_fresh_pair())["step"] == 2  # the adopted copy, not the unfinished save
    ck.save(last, model, [optimizer], {"step": 3})
    assert ck.load(last, *_fresh_pair())["step"] == 3
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_incomplete_hidden_copy_is_never_chosen(tmp_path) -> None:
    one, two = _two_checkpoints(tmp_path)
    last = tmp_path / "last.ckpt"
    os.replace(one, atomic_dir.hidden_sibling(last, ck.OLD_PREFIX))
    os.replace(two, ck.partial_path(last))
    (ck.partial_path(last) / ck.META_FILENAME).unlink()  # the newer copy is incomplete
    with pytest.warns(UserWarning, match="newest complete copy"):
        assert ck.load(last, *_fresh_pair())["step"] == 1
    next(atomic_dir.hidden_sibling(last, ck.OLD_PREFIX).glob("*.distcp")).unlink()  # and the older one damaged
    with pytest.raises(ck.MissingCheckpointError, match="no checkpoint at .*last.ckpt.*did not finish"):
        ck.load(last, *_fresh_pair())


def test_a_restarted_job_removes_what_crashed_saves_of_other_names_left(tmp_path, monkeypatch) -> None:
    """ModelCheckpoint names change every save, so a save killed mid-write (or a removal killed mid-rmtree)
    left a hidden copy no later save to the same name clears: the first save of the next process into the
    directory removes them, and keeps every copy that may be the only complete one."""
    model, optimizer = _fresh()
    with pytest.raises(_Crash), atomic_dir.on_step(_raise_after("write_shards")):
        ck.save(tmp_path / "epoch=0-step=1", model, [optimizer], {"step": 1})  # unfinished: no meta.pt
    with pytest.raises(_Crash), atomic_dir.on_step(_raise_after("write_checksums")):
        ck.save(tmp_path / "epoch=0-step=2", model, [optimizer], {"step": 2})  # complete, never published
    with pytest.raises(_Crash), atomic_dir.on_step(_raise_after("rename_meta")):
        ck.save(tmp_path / "epoch=0-step=5", model, [optimizer], {"step": 5})  # meta.pt, no checksums: unfinished
    with pytest.raises(_Crash), atomic_dir.on_step(_raise_after("remove_old")):
        ck.save(tmp_path / "model.pt", model, [optimizer], {"step": 6}, full=True)  # published; its source copy left
    one, two = _two_checkpoints(tmp_path)
    last = tmp_path / "last.ckpt"  # an older two-rename publish killed between its renames
    os.replace(one, atomic_dir.hidden_sibling(last, ck.OLD_PREFIX))
    os.replace(two, ck.partial_path(last))
    (ck.partial_path(last) / ck.META_FILENAME).unlink()  # ... even its unfinished new copy stays beside it
    trash = atomic_dir.hidden_sibling(tmp_path / "epoch=0-step=0", atomic_dir.TRASH_PREFIX)
    trash.mkdir()
    (trash / "__0_0.distcp").write_bytes(b"half deleted")
    (tmp_path / f"{atomic_dir.LINK_PREFIX}0123456789ab").symlink_to("absent")
    atomic_dir.file_part_path(tmp_path / "model.ckpt").write_bytes(b"torn")
    (tmp_path / ".ragged-probe-123-a").touch()
    # a "full" file over a directory on a filesystem without exchange, killed between its two renames: the new
    # file (its part) and the old directory are the two copies; the part is kept
    atomic_dir.hidden_sibling(tmp_path / "weights.ckpt", ck.OLD_PREFIX).mkdir()
    atomic_dir.file_part_path(tmp_path / "weights.ckpt").write_bytes(b"complete")
    unfinished = ck.partial_path(tmp_path / "epoch=0-step=1")
    assert (ck.partial_path(tmp_path / "model.pt") / "checksums.json").is_file() and (tmp_path / "model.pt").is_file()
    left = {p.name for p in tmp_path.iterdir()}

    ck.save(tmp_path / "epoch=0-step=3", model, [optimizer], {"step": 3})  # this process: already swept
    # what a two-step publish killed after its publish, before deleting the previous copy, leaves: that copy,
    # older than the name
    stale_old = atomic_dir.hidden_sibling(tmp_path / "epoch=0-step=3", ck.OLD_PREFIX)
    stale_old.mkdir()
    published = os.stat(tmp_path / "epoch=0-step=3").st_mtime_ns
    os.utime(stale_old, ns=(published - 10**9, published - 10**9))
    left.add(stale_old.name)
    assert left <= {p.name for p in tmp_path.iterdir()}
    monkeypatch.setattr(atomic_dir, "_swept", set())  # the restarted job
    ck.save(tmp_path / "epoch=0-step=4", model, [optimizer], {"step": 4})
    removed = {unfinished.name, trash.name, f"{atomic_dir.LINK_PREFIX}0123456789ab",
               atomic_dir.file_part_path(tmp_path / "model.ckpt").name, ".ragged-probe-123-a",
               ck.partial_path(tmp_path / "epoch=0-step=5").name, ck.partial_path(tmp_path / "model.pt").name,
               stale_old.name}
    assert {p.name for p in tmp_path.iterdir()} == (left - removed) | {"epoch=0-step=3", "epoch=0-step=4"}
    complete = ck.partial_path(tmp_path / "epoch=0-step=2")
    assert ck.load(complete, *_fresh_pair())["step"] == 2  # the complete unpublished copy is kept, loadable
    with pytest.warns(UserWarning, match="newest complete copy"):
        assert ck.load(last, *_fresh_pair())["step"] == 1  # and the old copy of the two-rename state


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_a_directory_that_holds_no_checkpoint_is_refused_not_replaced(tmp_path, full) -> None:
    """A save over the user's own directory (Lightning's ``test_save_checkpoint_path_exists``): refused before
    anything is written, its files kept (before: replaced by the checkpoint, its files deleted). An empty
    directory and an earlier checkpoint are replaced as before."""
    model, optimizer = _fresh()
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    (outputs / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="outputs is an existing directory that holds no checkpoint"):
        ck.save(outputs, model, [optimizer], {"step": 1}, full=full)
    assert [p.name for p in outputs.iterdir()] == ["notes.txt"] and [p.name for p in tmp_path.iterdir()] == ["outputs"]
    target = tmp_path / "empty"
    target.mkdir()
    for step in (1, 2):  # over an empty directory, then over the checkpoint
        ck.save(target, model, [optimizer], {"step": step}, full=full)
        assert ck.load(target, *_fresh_pair())["step"] == step


class _Crash(BaseException):
    """A crash, simulated in-process: raised from a step hook, nothing of the save runs after it."""


def _raise_after(step_name: str):
    def hook(name: str, path: Path) -> None:
        if name == step_name:
            raise _Crash(name)

    return hook


def test_link_publishing_keeps_what_users_see(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(atomic_dir, "use_exchange", False)
    model, optimizer = _fresh()
    best, last = tmp_path / "epoch=0-step=1.ckpt", tmp_path / "last.ckpt"
    ck.save(best, model, [optimizer], {"step": 1})
    ck.save(last, model, [optimizer], {"step": 1})
    assert last.is_symlink() and ck.is_sharded_checkpoint(last) and atomic_dir.linked_version(last).is_dir()
    visible = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert visible == [best.name, last.name]
    # Lightning's save_last="link": a symlink to another checkpoint; removing it leaves the target.
    ck.remove_checkpoint(last)
    os.symlink(best.name, last)
    ck.remove_checkpoint(last)
    assert ck.load(best, *_fresh_pair())["step"] == 1
    # top-k deletion: the link and its hidden version both go.
    ck.remove_checkpoint(best)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------- a frozen peer
def _frozen_peer_worker(rank: int, root: str, init_file: str, mode: str, out: str) -> None:
    """Rank 1 stops: in the middle of writing its shards ("async", "sync"), or before the save ("absent")."""
    async_save = mode == "async"
    torch.set_num_threads(1)
    # Joined under a long timeout (eight processes start at once: under load one may import torch for more than
    # TIMEOUT_S), then the group's collectives get TIMEOUT_S.
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=CHILD_TIMEOUT_S)
    )
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=TIMEOUT_S))
    model = lr.fully_shard(make_model(), shard_granularity="row")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path = Path(root) / "frozen.ckpt"
    if rank == 1 and mode == "absent":  # never reaches the save (a callback raised on it, say)
        os.kill(os.getpid(), signal.SIGSTOP)
    if rank == 1 and mode == "dead":  # its process ends before the save (killed, crashed)
        os._exit(0)
    if rank == 1:  # stop this whole process in the middle of writing its shards
        from torch.distributed.checkpoint import filesystem

        original = filesystem._write_item

        def freeze(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGSTOP)
            return original(*args, **kwargs)

        filesystem._write_item = freeze
    report: dict = {"raised": None}
    start = time.monotonic()
    try:
        ck.save(path, model, [optimizer], {"step": 7}, async_save=async_save)
        report["returned_after_s"] = time.monotonic() - start
        ck.wait_for_pending_save()
    except BaseException as error:  # noqa: BLE001 - reported to the test
        report = {
            "raised": type(error).__name__,
            "is_collective_timeout": isinstance(error, CollectiveTimeoutError),
            "lost": getattr(error, "lost_ranks", None),
            "message": str(error),
            "path": str(getattr(error, "path", "")),
            "collective": getattr(error, "collective", None),
            "missing": getattr(error, "missing_ranks", None),
            "arrived": getattr(error, "arrived_ranks", None),
            "step": getattr(error, "step", None),
            **{k: v for k, v in report.items() if k != "raised"},
        }
    report["seconds"] = time.monotonic() - start
    Path(out).write_text(json.dumps(report))
    os._exit(0)  # no teardown: the peer is stopped


@pytest.fixture(scope="module")
def frozen_peer(tmp_path_factory) -> dict[str, dict]:
    """The scenarios at once (they mostly wait): {"async": rank 0's report, "sync": ..., "absent": ..., "dead": ...}."""
    context = mp.get_context("spawn")
    runs = {}
    for name in ("async", "sync", "absent", "dead"):
        root = tmp_path_factory.mktemp(f"frozen_{name}")
        init_file = tempfile.mktemp(prefix="ragged_frozen_")
        out = root / "rank0.json"
        workers = [
            context.Process(target=_frozen_peer_worker, args=(rank, str(root), init_file, name, str(out)))
            for rank in range(2)
        ]
        for worker in workers:
            worker.start()
        runs[name] = (root, init_file, out, workers)
    reports = {}
    try:
        for name, (root, init_file, out, workers) in runs.items():
            workers[0].join(timeout=120)
            stopped = _is_stopped(workers[1].pid)
            reports[name] = {
                "report": json.loads(out.read_text()) if out.exists() else None,
                "rank0_exitcode": workers[0].exitcode,
                "peer_was_stopped": stopped,
                "root": root,
            }
    finally:
        for root, init_file, out, workers in runs.values():
            for worker in workers:
                if worker.is_alive():
                    worker.kill()  # SIGKILL ends a stopped process too
                worker.join(timeout=10)
            if os.path.exists(init_file):
                os.remove(init_file)
    return reports


def _is_stopped(pid: int | None) -> bool | None:
    """Whether the process is stopped (None: no /proc to tell)."""
    if not os.path.isdir("/proc/self"):
        return None
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError, TypeError):
        return False


@pytest.mark.parametrize("mode", ["async", "sync", "absent", "dead"])
def test_a_frozen_peer_makes_the_survivor_raise_a_collective_timeout_naming_the_checkpoint(frozen_peer, mode) -> None:
    run = frozen_peer[mode]
    report = run["report"]
    assert run["rank0_exitcode"] == 0 and report is not None, run
    if mode == "dead":  # the connection closed: named as a lost peer at once, not after the timeout
        assert report["raised"] == "CheckpointPeerLostError" and report["is_collective_timeout"], report
        assert report["lost"] == [1] and report["missing"] == [1] and report["arrived"] == [0], report
        assert report["collective"].startswith("broadcast of rank 0's path") and "peer lost" in report["message"]
        assert str(run["root"] / "frozen.ckpt") in report["message"], report
        assert not os.path.lexists(run["root"] / "frozen.ckpt")
        return
    assert run["peer_was_stopped"] is not False, "rank 1 should still be stopped (SIGSTOP), not dead"
    assert report["raised"] == "CheckpointTimeoutError" and report["is_collective_timeout"], report
    path = str(run["root"] / "frozen.ckpt")
    message = report["message"]
    assert report["path"] == path and path in message, message
    assert report["missing"] == [1] and report["arrived"] == [0], report
    assert "ranks [1] did not arrive" in message and f"within {TIMEOUT_S:g} s" in message, message
    assert report["step"] == 7 and "at step 7" in message, message
    # "absent": the first collective of a save agrees on rank 0's path; before, a raw gloo timeout came from
    # the strategy's broadcast of the path (measured under the Trainer, a callback raising on rank 1 only).
    expected = {"async": "dcp.async_save", "sync": "dcp.save", "absent": "broadcast of rank 0's path"}[mode]
    assert report["collective"].startswith(expected) and report["collective"] in message, report
    if mode == "async":  # the save itself returned at once; waiting for it raised
        assert "returned_after_s" in report, report
    assert not os.path.lexists(path), "a save that did not finish must not be published"
