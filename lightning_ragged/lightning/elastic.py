"""Elastic resize under torchrun: lose a node, restart at the smaller world size, resume resharded.

The recipe (docs/operations.md, "Elastic resize")::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2:4 --nproc-per-node=8 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 --rdzv-id=JOB train.py

    # train.py
    from lightning_ragged.lightning.elastic import newest_checkpoint, torchrun_world
    trainer = Trainer(strategy=RaggedFSDPStrategy(timeout=timedelta(minutes=5)), **torchrun_world(),
                      callbacks=[ModelCheckpoint(dirpath=CKPT, save_last=True, every_n_train_steps=200)])
    trainer.fit(model, ckpt_path=newest_checkpoint(CKPT))   # None on the first start: from scratch
    torch.distributed.destroy_process_group()                # leave cleanly: an abort at exit is a failure

What happens when a node dies: the survivors' next collective fails at once (gloo: the
dead process's sockets close; the probes raise ``PeerLostError``), their processes exit,
and the torchrun agents re-rendezvous with the nodes that are left (at least ``MIN``) and
start the workers again with the new ``WORLD_SIZE``. Every (re)start builds the Trainer
for that world size (:func:`torchrun_world`) and loads the newest complete checkpoint
(:func:`newest_checkpoint`); sharded checkpoints reshard to any world size on load, so
only the steps after the last checkpoint are redone.

``fit(ckpt_path="last")`` with ``ModelCheckpoint(save_last=True)`` finds the same
checkpoint as long as ``last.ckpt`` exists (publishing replaces it with one atomic
rename, ``atomic_dir.py``). :func:`newest_checkpoint` also works with any
``ModelCheckpoint`` naming (top-k only, no ``save_last``) and also considers the hidden
complete copies an interrupted save can leave (a version not yet linked, or the new and
old copies of a two-step publish: a file over a directory, or checkpoints written before
one-rename publishing), so a node lost in the middle of a save never sends the job back
to step 0. Every candidate is validated; an incomplete one is never chosen.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

from lightning_ragged.checkpoint import OLD_PREFIX, TMP_PREFIX, CheckpointError, inspect_checkpoint
from lightning_ragged.checkpoint.atomic_dir import VERSION_PREFIX  # link publishing's hidden, complete versions
from lightning_ragged.checkpoint.safe_unpickle import torch_load

HIDDEN_PREFIXES = (TMP_PREFIX, OLD_PREFIX, VERSION_PREFIX)

CHECKPOINT_SUFFIX = ".ckpt"


def torchrun_world(env: Optional[Mapping[str, str]] = None) -> dict[str, int]:
    """``Trainer(**torchrun_world())``: ``num_nodes`` and ``devices`` of this (re)start, as torchrun set them.

    After an elastic restart ``WORLD_SIZE`` is smaller; the Trainer must be built for it
    (Lightning refuses ``num_nodes * devices != WORLD_SIZE``). Outside torchrun: ``{}``.
    """
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env or "LOCAL_WORLD_SIZE" not in env:
        return {}
    world, local = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    if local < 1 or world % local:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}")
    if shared_store_breaks_restarts(env) and int(env.get("RANK", "0")) == 0:
        disabled = env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "") not in ("", "0")
        warnings.warn(SHARED_STORE_WARNING + (STATIC_RENDEZVOUS_HINT if disabled else ""), stacklevel=2)
    return {"num_nodes": world // local, "devices": local}


SHARED_STORE_WARNING = (
    "torchrun shares its agent's TCPStore with the workers (TORCHELASTIC_USE_AGENT_STORE=True) and may restart "
    "them (--max-restarts > 0): the store outlives a restart, so the restarted workers can read the dead round's "
    "gloo/NCCL addresses and fail to connect ('Connection refused'; pytorch/pytorch#135712). Start torchrun with "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and the c10d rendezvous (--rdzv-backend=c10d, or --standalone on one "
    "node; docs/operations.md, 'Elastic resize')."
)
STATIC_RENDEZVOUS_HINT = (
    " TORCH_DISABLE_SHARE_RDZV_TCP_STORE is set, yet the store is shared: this is torchrun's static rendezvous (no "
    "--rdzv-backend given), which ignores the variable; add --rdzv-backend=c10d or --standalone."
)


def shared_store_breaks_restarts(env: Optional[Mapping[str, str]] = None) -> bool:
    """True under torchrun with the agent's store shared with the workers and restarts allowed."""
    env = os.environ if env is None else env
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return shared and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0


def restart_count(env: Optional[Mapping[str, str]] = None) -> int:
    """How many times torchrun restarted the workers so far (``TORCHELASTIC_RESTART_COUNT``; 0 outside it)."""
    env = os.environ if env is None else env
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _is_sharded_directory(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file() and (path / "meta.pt").is_file()


def _resumable(path: Path) -> Optional[bool]:
    """Whether ``path`` validates and holds optimizer state; ``None`` if it does not validate.

    A sharded directory is validated (complete, untruncated); a checkpoint file must be
    non-empty, and is read weights-only and memory-mapped (the pickle, not the tensors) for
    an ``"optimizer_states"`` entry: a file that cannot be read so counts as holding it.
    """
    if path.is_dir():
        try:
            return inspect_checkpoint(path).optimizer_count > 0
        except (CheckpointError, OSError, RuntimeError, ValueError):
            return None
    try:
        if not (path.is_file() and path.stat().st_size > 0):
            return None
    except OSError:
        return None
    try:
        checkpoint = torch_load(path, map_location="cpu", mmap=True)
    except Exception:  # a legacy or trusted-only file: Lightning's loader decides, with its own error
        return True
    return not isinstance(checkpoint, Mapping) or bool(checkpoint.get("optimizer_states"))


def _preference(entry: Path) -> tuple[bool, bool]:
    return entry.name.startswith("."), entry.is_symlink()


def checkpoint_candidates(dirpath: Union[str, os.PathLike]) -> list[Path]:
    """The checkpoints in ``dirpath`` (not recursive), newest first: what :func:`newest_checkpoint` chooses from.

    Visible entries: sharded checkpoint directories (any name) and ``*.ckpt`` files
    (symlinks, ours or ``save_last="link"``, count once, as their target). Hidden
    directories an interrupted save can leave: ``.ragged-partial-*`` and ``.ragged-old-*``
    (a two-step publish; with one-rename publishing the partial one may also hold the
    previous checkpoint, which is then older) and ``.ragged-data-*`` versions not yet
    linked. Only directories with DCP's ``.metadata`` and ``meta.pt`` are listed;
    :func:`newest_checkpoint` validates them (half-deleted or unfinished ones fail).
    Ordered by modification time: when the checkpoint was completed (its last entries,
    ``meta.pt`` and the checksums, were written into it; renames do not change it).
    """
    root = Path(dirpath)
    if not root.is_dir():
        return []
    found: dict[str, Path] = {}
    for entry in root.iterdir():
        name = entry.name
        hidden = name.startswith(".")
        if hidden and not name.startswith(HIDDEN_PREFIXES):
            continue
        if hidden and not _is_sharded_directory(entry):
            continue
        if not hidden and not (_is_sharded_directory(entry) or (name.endswith(CHECKPOINT_SUFFIX) and entry.is_file())):
            continue
        try:
            real = os.path.realpath(entry)
        except OSError:
            continue
        # one entry per checkpoint: a visible name over a hidden one, a real one over a link
        if real not in found or _preference(entry) < _preference(found[real]):
            found[real] = entry
    dated = []
    for real, entry in found.items():
        try:
            dated.append((os.stat(real).st_mtime_ns, entry))
        except OSError:
            continue
    return [entry for _, entry in sorted(dated, key=lambda item: item[0], reverse=True)]


def newest_checkpoint(dirpath: Union[str, os.PathLike]) -> Optional[str]:
    """The newest complete checkpoint in ``dirpath`` (``None`` if there is none): pass it as ``fit(ckpt_path=...)``.

    Call it on every rank at every (re)start. Ranks may see the directory differently (an NFS
    attribute cache, a node-local path): every rank resumes from rank 0's choice, ``None``
    included (:func:`resume_from_rank_zero`). A candidate that does not validate is skipped
    for the next older one, so a damaged newest checkpoint costs steps, not the job. A
    weights-only checkpoint (``ModelCheckpoint(save_weights_only=True)``, kept for evaluation
    beside the full ones) is chosen only when no full one validates: resuming from it would
    restart the optimizers and schedulers from scratch.
    """
    weights_only = None
    for candidate in checkpoint_candidates(dirpath):
        resumable = _resumable(candidate)
        if resumable:
            return str(candidate)
        if resumable is False and weights_only is None:
            weights_only = str(candidate)
    return weights_only


def resume_from_rank_zero(trainer: Any, broadcast: Callable[[Any], Any]) -> None:
    """Make every rank of ``trainer`` resume from rank 0's checkpoint path (``None``: from scratch, on all).

    Lightning loads a checkpoint only on ranks whose ``ckpt_path`` is set (``_CheckpointConnector
    .resume_start``): a rank that got ``None`` (its ``newest_checkpoint`` saw no checkpoint yet, or
    Lightning's hpc scan under SLURM found none) skipped the load's collectives while the others
    were in them, and the job hung. ``broadcast`` (the strategy's) runs on every rank at that point,
    one collective per restore; this Trainer's connector only, no class is patched.
    """
    connector = trainer._checkpoint_connector
    resume_start = type(connector).resume_start.__get__(connector)

    def agreed(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> None:
        return resume_start(broadcast(checkpoint_path), *args, **kwargs)

    connector.resume_start = agreed
