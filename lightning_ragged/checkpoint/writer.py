"""Writing a checkpoint: every rank its shards through DCP, rank 0 meta.pt last, one atomic publish.

A save goes to a hidden sibling directory (``atomic_dir.partial_path``), every rank writes
its shards, rank 0 writes ``meta.pt`` and ``checksums.json`` last and publishes the
directory with one atomic rename (``atomic_dir.publish``): a crash at any point leaves the
name holding the previous checkpoint or the new one. An asynchronous save stages one copy
of each buffer in CPU memory (pinned when the tensors are on CUDA; DCP's ``StateDictStager``,
whose buffers the next save reuses) and finishes in the background (:class:`PendingSave`); ``full=True``
streams the shards into one ordinary file (``consolidation.py``). A save's collectives that
time out raise ``CheckpointTimeoutError`` (``timeout.py``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import shutil
import threading
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.utils._pytree import tree_leaves

from lightning_ragged.checkpoint import atomic_dir, checksums, safe_unpickle
from lightning_ragged.checkpoint import timeout as checkpoint_timeout
from lightning_ragged.checkpoint.consolidation import write_full_checkpoint
from lightning_ragged.checkpoint.dcp import quiet_without_process_group
from lightning_ragged.checkpoint.errors import CheckpointError
from lightning_ragged.checkpoint.format import (
    FORMAT_KEY, FORMAT_VERSION, META_FILENAME, MODEL_KEY, MODEL_STATE_KEYS, MODEL_STATES_KEY,
)
from lightning_ragged.checkpoint.model_state import sharded_model_state_dict
from lightning_ragged.checkpoint.optimizer_state import sharded_optimizer_state_dict
from lightning_ragged.checkpoint.ranks import barrier, gather_failures, is_rank_zero, rank_zero_value, world_size
from lightning_ragged.checkpoint.reader import CheckpointInfo
from lightning_ragged.checkpoint.shard_staging import boxes_apart
from lightning_ragged.engine.checks import check_flag, check_optimizer_list
from lightning_ragged.engine.collective_errors import CollectiveTimeoutError


def _split_checkpoint(
    checkpoint: Mapping[str, Any], model_states: Iterable[str] = MODEL_STATE_KEYS
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what DCP writes: "model", "optimizer_i", the ``model_states`` keys; what goes to meta.pt: everything else)."""
    tensors: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for key, value in checkpoint.items():
        if key in ("state_dict", MODEL_KEY):
            tensors[MODEL_KEY] = value
        elif key == "optimizer_states":
            for index, state in enumerate(value):
                tensors[f"optimizer_{index}"] = state
        elif key.startswith("optimizer_") and key[len("optimizer_") :].isdigit():
            tensors[key] = value
        elif key in model_states:
            tensors[key] = value
        else:
            meta[key] = value
    return tensors, meta



def _storage_writer(path: Path, compress: bool) -> checksums.ChecksummingWriter:
    """DCP's file writer, recording a CRC-32 of every item it writes (``writer.manifest`` on rank 0)."""
    extensions = None
    if compress:
        from torch.distributed.checkpoint._extension import ZStandard

        if not ZStandard.is_available():
            raise RuntimeError(
                "checkpoint compression needs the 'zstandard' (or 'pyzstd') package: pip install zstandard"
            )
        extensions = [ZStandard()]
    return checksums.ChecksummingWriter(str(path), _extensions=extensions)


class _AlreadyStaged:
    """An ``AsyncStager`` for a state dict we staged ourselves (so :class:`PendingSave` can hold it)."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class PendingSave:
    """An asynchronous save in flight; ``wait()`` finishes it (meta.pt, rename) on rank 0.

    ``translating(label)``: a context manager that raises a timeout of the save's
    collectives as ``CheckpointTimeoutError`` (see ``checkpoint_timeout``). A failure is
    kept and raised again by every later ``wait()`` (the finish never runs twice).
    """

    def __init__(self, future: Future, finish: Any, path: Path, translating: Any = None, staged: Any = None) -> None:
        self.future = future
        self.staged = staged
        """The CPU copy of the tensors that DCP is writing (the writer reuses its buffers at the next save)."""
        self._finish = finish
        self.path = path
        self.translating = translating or (lambda label, group=None: contextlib.nullcontext())
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self._after_publish: list[Any] = []

    def after_publish(self, action: Any) -> bool:
        """Run ``action`` once this save is published (False: it already finished or failed; run it yourself).

        A failed save never runs it: deleting an older checkpoint waits for the new one to exist.
        """
        with self._lock:
            if self._done or self._error is not None:
                return False
            self._after_publish.append(action)
            return True

    def wait(self) -> None:
        with self._lock:  # the done-callback (rank 0) and the next save may both get here
            if self._error is not None:
                raise self._error
            if self._done:
                return
            try:
                with self.translating("dcp.async_save"):
                    self.future.result()
                self._finish()
            except BaseException as error:
                self._error = error
                self._after_publish.clear()
                raise
            self._done = True
            actions, self._after_publish = self._after_publish, []
        for action in actions:
            action()


class _WholeTensorsFromRankZero(DefaultSavePlanner):
    """What every rank holds whole (buffers such as BatchNorm's running statistics, which ranks update apart
    between the broadcasts before each synchronized forward) is written from rank 0, as DDP saves rank 0's
    and the next forward broadcasts them; DCP's default writes each from the least-loaded rank. Shards held
    by several ranks (HSDP's replicas) stay spread over them, as DCP spreads them."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        rank_zero = {item.index for item in all_plans[0].items if item.type == WriteItemType.TENSOR}
        others = [dataclasses.replace(plan, items=[item for item in plan.items if item.type != WriteItemType.TENSOR
                                                   or item.index not in rank_zero]) for plan in all_plans[1:]]
        return super().create_global_plan([all_plans[0], *others])


class CheckpointWriter:
    """Writes checkpoint directories (sync or async) and keeps at most one async save in flight."""

    def __init__(self, timeout: timedelta | None = None) -> None:
        self.pending: PendingSave | None = None
        self._async_group: dist.ProcessGroup | None = None
        self.timeout = timeout
        """The async save's process-group timeout; None: the default group's (the strategy's ``timeout``)."""
        self._saves = 0  # every rank counts the same saves: names a timed-out save's collectives in the store
        self._stagers: dict[bool, StateDictStager] = {}
        """Async staging into CPU memory, keyed by "tensors on CUDA"; kept so each save reuses the buffers."""

    def close(self) -> None:
        """Finish the save in flight and free the CPU staging buffers (every rank)."""
        self.wait()
        self.release_staging()

    def release_group(self) -> None:
        """Destroy the asynchronous saves' process group (no collective; the next async save, which every rank
        makes, builds another): one gloo group and its sockets per Trainer of a sweep otherwise."""
        if self._async_group is not None and dist.is_initialized():
            dist.destroy_process_group(self._async_group)
        self._async_group = None

    def release_staging(self) -> None:
        """Free the CPU staging buffers (no collective; the next async save allocates them again)."""
        for stager in self._stagers.values():
            stager.close()
        self._stagers.clear()

    def wait(self) -> None:
        """Finish the save in flight, if any (every rank; a rank's failure is raised on every rank)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            failure = _attempt(pending.wait)
            _settle(failure, pending.path, "the asynchronous save",
                    pending.translating("barrier after the asynchronous save", None))  # the default group

    def _stage(self, tensors: Any) -> Any:
        """A CPU copy of every tensor the training step will overwrite (one per shared storage).

        Staged by DCP's ``StateDictStager`` (what its ``DefaultStager`` wraps: one CPU storage per
        source storage, so a DBuffer's views share one copy), pinned with non-blocking copies when the
        tensors are on CUDA, then each of their devices synchronized; plain CPU copies otherwise. The
        stager keeps its buffers, keyed weakly by the source storages, so the next save copies into
        the same CPU memory instead of allocating it again (``close()`` frees them). Not through
        ``DefaultStager``: on torch 2.11 and 2.12 it empties that cache (and its copy table) after
        every stage, so its second stage fails.
        """
        devices = {leaf.device for leaf in tree_leaves(tensors) if _is_cuda(leaf)}
        stager = self._stagers.get(bool(devices))
        if stager is None:
            stager = self._stagers[bool(devices)] = StateDictStager(pin_memory=bool(devices), share_memory=False)
        boxes, rebuild = boxes_apart(tensors)  # not the DTensors: their copies allocate on the device first
        staged = stager.stage(boxes, non_blocking=bool(devices))
        for device in devices:  # the copies were queued on each device's current stream
            torch.cuda.synchronize(device)
        return rebuild(staged)

    def save(
        self,
        checkpoint: Mapping[str, Any],
        path: str | os.PathLike,
        *,
        compress: bool = False,
        async_save: bool = False,
        full: bool = False,
        extra_meta: Mapping[str, Any] | None = None,
        model_states: Iterable[str] = MODEL_STATE_KEYS,
    ) -> None:
        """Write ``checkpoint`` (Lightning layout or {"model", "optimizer_i", ...}) to the directory ``path``.

        With ``full=True`` the result is instead one ordinary ``torch.save`` file at ``path``
        (Lightning's single-file layout): the shards are written as above to a hidden
        directory, then rank 0 streams them tensor by tensor into the file
        (``consolidation.py``), so no rank ever holds the whole model.

        Collective. Tensors under "state_dict"/"model" and "optimizer_states"/"optimizer_i"
        go through DCP (DTensors: each rank writes its boxes; plain tensors: written
        once); everything else goes to ``meta.pt``, which rank 0 writes last before the
        directory is renamed into place. With ``async_save`` this returns once the
        shards are staged (one CPU copy of each buffer); the write and the rename finish in
        the background and the next save (or ``wait()``) waits for them.
        """
        self.wait()
        model_states = tuple(model_states)  # other states of sharded tensors (another model's, an average's)
        tensors, meta = _split_checkpoint(checkpoint, model_states)
        self._saves += 1
        sequence, saved_step = self._saves, meta.get("global_step", meta.get("step"))
        path = Path(path)

        def translating(label: str, group: dist.ProcessGroup | None = None, note: str | None = None) -> Any:
            step = saved_step if isinstance(saved_step, int) else None
            return checkpoint_timeout.translating(path, label, sequence=sequence, step=step, group=group, note=note)

        with translating("broadcast of rank 0's path"):  # a rank that never reaches the save is named here
            path = Path(rank_zero_value(str(path)))
        tmp = atomic_dir.partial_path(path)

        meta[FORMAT_KEY] = {
            "format_version": FORMAT_VERSION,
            "world_size": world_size(),
            "optimizers": sum(1 for key in tensors if key.startswith("optimizer_")),
            "has_model": MODEL_KEY in tensors,
            MODEL_STATES_KEY: [key for key in model_states if key in tensors],
            "compressed": compress,
            "checksums": checksums.MANIFEST_FILENAME,  # a directory without it is then known to be damaged
            **(extra_meta or {}),
        }
        if async_save:  # rank 0 writes it after the training goes on: the callbacks' state at this save, not then
            meta = copy.deepcopy(meta)
        # an earlier save to this path that never finished is removed; at the first save into its directory in
        # this process (no save of ours writes there yet), what crashed saves of other names left, too
        def prepare() -> None:
            atomic_dir.refuse_foreign_directory(path, (META_FILENAME, ".metadata"))  # before anything is written
            atomic_dir.remove_leftovers_once(path.parent, checksums.MANIFEST_FILENAME)
            atomic_dir.prepare_partial(path, META_FILENAME)

        failure = _attempt(prepare) if is_rank_zero() else None
        _settle(failure, path, "preparing the directory", translating("barrier before writing"))

        def finish() -> None:
            atomic_dir.step("write_shards", tmp)
            if not is_rank_zero():
                return
            atomic_dir.write_file_atomically(meta, tmp / META_FILENAME)
            manifest = _publish_checksums(writer, tmp)
            atomic_dir.step("write_checksums", tmp / checksums.MANIFEST_FILENAME)
            atomic_dir.fsync_dir(tmp)
            if not full:
                atomic_dir.publish(tmp, path)
                return
            # Our own fresh save: meta is the live objects (trusted); the shards are verified as read.
            metadata = safe_unpickle.load_dcp_metadata((tmp / ".metadata").read_bytes())
            info = CheckpointInfo(tmp, metadata, meta, manifest=manifest, trusted=True)
            part = atomic_dir.file_part_path(path)  # hidden, no digits of the name: Lightning's hpc_ckpt_<N> scan
            write_full_checkpoint(info, part)
            atomic_dir.step("write_file", part)
            checksums.remove_sidecar(path)  # never an old file's checksum next to the new file
            atomic_dir.publish(part, path)
            checksums.write_sidecar(path)
            shutil.rmtree(tmp, ignore_errors=True)

        writer = _storage_writer(tmp, compress)
        if not async_save:
            with translating("dcp.save"), quiet_without_process_group():
                dcp.save(tensors, storage_writer=writer, planner=_WholeTensorsFromRankZero())
            with translating("barrier after writing the shards"):
                barrier()  # every rank's files are complete (DCP's .metadata is written by rank 0 last)
            _settle(_attempt(finish), path, "publishing",
                    translating("barrier after publishing", note=f"Rank 0 may have published {path} already. "))
            return
        if dist.is_initialized() and self._async_group is None:
            # its own group (DCP's collectives run in a background thread), with the default group's timeout
            timeout = self.timeout or checkpoint_timeout.group_timeout()
            self._async_group = dist.new_group(backend="gloo", **({"timeout": timeout} if timeout else {}))
        staged = self._stage(tensors)
        future = dcp.async_save(
            staged, storage_writer=writer, planner=_WholeTensorsFromRankZero(), process_group=self._async_group,
            async_stager=_AlreadyStaged(),
        )
        # DCP's rank 0 finishes (writes .metadata) only after every rank's data is written,
        # so rank 0 may publish the directory as soon as its own future completes.
        group = self._async_group
        self.pending = PendingSave(
            future, finish, path, lambda label, group=group: translating(label, group=group), staged=staged
        )
        if is_rank_zero():
            pending = self.pending
            future.add_done_callback(lambda f: f.exception() is None and pending.wait())


def _attempt(action: Any) -> Exception | None:
    """Run ``action``; its error, returned (raised after every rank has learnt of it), or None."""
    try:
        action()
    except Exception as error:
        return error
    return None


def _settle(failure: Exception | None, path: Path, stage: str, translating: Any) -> None:
    """In a barrier's place: every rank learns where ``stage`` failed and raises (this rank's own error,
    else a :class:`CheckpointError` naming the ranks). A collective that failed here already (a frozen or
    lost peer) is raised at once: no collective can carry the news."""
    if isinstance(failure, CollectiveTimeoutError):
        raise failure
    with translating:
        failed = gather_failures(failure)
    if failure is not None:
        raise failure
    if failed:
        rank, text = min(failed.items())
        raise CheckpointError(
            f"checkpoint save to {path}: {stage} failed on ranks {sorted(failed)} (rank {rank}: {text[:500]}); "
            f"see that rank's traceback. Publishing is atomic: {path} holds the previous checkpoint or this one, "
            "complete"
        )


def _is_cuda(value: Any) -> bool:
    """A tensor (a DTensor by its local shards) on a CUDA device."""
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def _publish_checksums(writer: checksums.ChecksummingWriter, directory: Path) -> checksums.Manifest:
    """Rank 0, before the directory is published: ``checksums.json`` (items from DCP, ``.metadata``, meta.pt)."""
    manifest = writer.manifest
    if manifest is None:
        raise CheckpointError(f"the save to {directory} recorded no checksums (DCP's finish did not run on this rank)")
    manifest.add_file(directory, ".metadata")
    manifest.add_file(directory, META_FILENAME)
    manifest.write(directory)
    return manifest


_DEFAULT_WRITER = CheckpointWriter()


def save(
    path: str | os.PathLike,
    module: nn.Module | None = None,
    optimizers: Iterable[torch.optim.Optimizer] = (),
    extra: Mapping[str, Any] | None = None,
    *,
    compress: bool = False,
    async_save: bool = False,
    full: bool = False,
    writer: CheckpointWriter | None = None,
) -> None:
    """Save a module (and optimizers, and picklable extras) as a sharded checkpoint directory (collective).

    ``full=True`` writes one ordinary single-file checkpoint instead (see ``CheckpointWriter.save``).
    """
    for name, flag in (("compress", compress), ("async_save", async_save), ("full", full)):
        check_flag(name, flag)
    check_optimizer_list(optimizers)
    checkpoint: dict[str, Any] = dict(extra or {})
    if module is not None:
        checkpoint[MODEL_KEY] = sharded_model_state_dict(module)
    for index, optimizer in enumerate(optimizers):
        checkpoint[f"optimizer_{index}"] = sharded_optimizer_state_dict(module, optimizer)
    (writer or _DEFAULT_WRITER).save(checkpoint, path, compress=compress, async_save=async_save, full=full)


def wait_for_pending_save(writer: CheckpointWriter | None = None) -> None:
    """Finish the asynchronous save in flight of ``writer`` (default: ``save``'s), if any (every rank)."""
    (writer or _DEFAULT_WRITER).wait()
