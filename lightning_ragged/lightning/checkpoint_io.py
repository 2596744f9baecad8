"""The strategy's checkpoint IO: what ``RaggedFSDPStrategy`` does for checkpoints, over ``lightning_ragged.checkpoint``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_ragged.checkpoint import checksums
from lightning_ragged.checkpoint.atomic_dir import remove_checkpoint
from lightning_ragged.checkpoint.errors import CheckpointMismatchError
from lightning_ragged.checkpoint.format import MODEL_KEY, MODEL_STATE_KEYS, MODEL_STATES_KEY
from lightning_ragged.checkpoint.model_state import (
    load_full_model_state_dict,
    load_model_state_copy,
    load_sharded_model_state_dict,
    sharded_model_state_dict,
)
from lightning_ragged.checkpoint.optimizer_state import (
    load_full_optimizer_state_dict,
    load_sharded_optimizer_state_dict,
    sharded_optimizer_state_dict,
)
from lightning_ragged.checkpoint.ranks import rank_zero_warn
from lightning_ragged.checkpoint.reader import check_model_matches, inspect_checkpoint
from lightning_ragged.checkpoint.single_file import read_file, rest_of_file
from lightning_ragged.checkpoint.writer import CheckpointWriter
from lightning_ragged.engine.checks import check_flag
from lightning_ragged.engine.state_dict_checks import expected_model_shapes


class LightningCheckpointIO:
    """What ``RaggedFSDPStrategy`` does for checkpoints; the strategy only delegates here.

    * ``state_dict()`` / ``optimizer_state()``: DTensor views of the shards (no gather).
    * ``save()``: a sharded directory (``state_dict_type="sharded"``) or one ordinary file
      (``"full"``), atomically, optionally Zstandard-compressed and/or asynchronous.
    * ``load()``: validates, loads the model and (when fitting) the optimizers in place
      at the current layout, and returns the rest for Lightning (loops, callbacks,
      schedulers). A weights-only checkpoint resumes the weights and warns that the
      optimizer state is absent. Ordinary single-file checkpoints load too.
    * ``remove()``: directories, files and ``save_last="link"`` symlinks.
    """

    def __init__(
        self,
        state_dict_type: str = "sharded",
        compress: bool = False,
        async_save: bool = False,
        *,
        trust_checkpoint: bool = False,
        verify_checksums: bool = True,
    ) -> None:
        for name, flag in (("compress", compress), ("async_save", async_save), ("trust_checkpoint", trust_checkpoint),
                           ("verify_checksums", verify_checksums)):
            check_flag(name, flag)
        self.state_dict_type = state_dict_type
        self.compress = compress
        self.async_save = async_save
        self.trust_checkpoint = trust_checkpoint  # full unpickling of meta.pt / .metadata / .ckpt: only for files you trust
        self.verify_checksums = verify_checksums
        self.writer = CheckpointWriter()

    def adopt(self, io: Any, owner: str) -> None:
        """A Lightning ``CheckpointIO`` plugin given to the strategy (``plugins=[...]``, ``checkpoint_io=``).

        ``AsyncCheckpointIO`` (over torch's own IO) turns on background saves, as ``async_checkpoint=True``;
        torch's default IO changes nothing. Any other is refused rather than ignored: this strategy writes
        sharded DCP directories itself (every rank its own shards), not one ``torch.save`` file through a plugin.
        """
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        base = io.checkpoint_io if isinstance(io, AsyncCheckpointIO) else io
        if base is not None and type(base) is not TorchCheckpointIO:
            raise ValueError(
                f"{owner} does not take the {type(base).__name__} checkpoint plugin: it writes its checkpoints itself "
                "(sharded torch.distributed.checkpoint directories, or one file with state_dict_type='full'). Remove "
                "the plugin; for background saves pass async_checkpoint=True (or plugins=[AsyncCheckpointIO()])."
            )
        if isinstance(io, AsyncCheckpointIO):
            self.async_save = True

    def state_dict(self, module: nn.Module) -> dict[str, Any]:
        return sharded_model_state_dict(module)

    def optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return sharded_optimizer_state_dict(module, optimizer)

    def save(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None,
        model_states: Sequence[str] = MODEL_STATE_KEYS,
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "RaggedFSDPStrategy.save_checkpoint(..., storage_options=...) is not supported: checkpoints are "
                "written with torch.distributed.checkpoint, not a CheckpointIO plugin"
            )
        self.writer.save(
            checkpoint,
            path,
            compress=self.compress,
            async_save=self.async_save,
            full=self.state_dict_type == "full",
            model_states=model_states,
        )

    def load(
        self,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        path: str | os.PathLike,
        *,
        fitting: bool,
        with_model_states: bool = False,
        strict: bool = True,
        weights_only: bool | None = None,
        before_optimizers: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Load the model's and the optimizers' states in place; return the rest for Lightning.
        ``before_optimizers(rest)`` runs where the optimizer states load (fitting, also when the file has none).
        ``with_model_states`` (a ``WeightAveraging`` callback holds an average): also return the model's other saved
        states (``current_model_state``) and ``state_dict`` (the shards just loaded), which its ``on_load_checkpoint``
        reads, also from a checkpoint saved without averaging."""
        self.writer.wait()
        path = Path(path)
        trust = {"trust_checkpoint": self.trust_checkpoint, "verify_checksums": self.verify_checksums}
        if path.is_file():
            checkpoint = read_file(path, weights_only, **trust)
            state_dict = checkpoint.get("state_dict", checkpoint.get(MODEL_KEY, {}))
            load_full_model_state_dict(module, state_dict, strict=strict, source=path)
            states = list(checkpoint.get("optimizer_states", []))
            rest = rest_of_file(checkpoint)
            model_states = [key for key in MODEL_STATE_KEYS if key in rest]
            optimizer_count = len(states)
            load_optimizers = lambda: [  # noqa: E731
                load_full_optimizer_state_dict(module, optimizer, state) for optimizer, state in zip(optimizers, states)
            ]
        else:
            info = inspect_checkpoint(path, weights_only=weights_only, **trust)
            check_model_matches(info, expected_model_shapes(module), strict=strict)
            load_sharded_model_state_dict(module, info, strict=strict)
            rest = info.rest()
            saved_states = info.format.get(MODEL_STATES_KEY, [])  # a Fabric save may hold an EMA's too: not ours
            model_states = [key for key in MODEL_STATE_KEYS if key in saved_states] if with_model_states else []
            for key in model_states:
                rest[key] = load_model_state_copy(module, info, key, strict=strict)
            optimizer_count = info.optimizer_count
            load_optimizers = lambda: [  # noqa: E731
                load_sharded_optimizer_state_dict(module, optimizer, info, f"optimizer_{i}")
                for i, optimizer in enumerate(optimizers)
            ]
        if with_model_states:
            # WeightAveraging's on_load_checkpoint reads the average from "state_dict": the shards just loaded
            rest["state_dict"] = module.state_dict()
        if fitting and optimizers:
            if before_optimizers is not None:
                before_optimizers(rest)
            if optimizer_count == 0:
                rank_zero_warn(
                    f"{path} was saved with weights only (e.g. ModelCheckpoint(save_weights_only=True)): the model "
                    "weights are restored, but the optimizer and LR-scheduler states are absent, so the optimizers "
                    "start fresh."
                )
                rest.setdefault("lr_schedulers", [])
            elif optimizer_count != len(optimizers):
                raise CheckpointMismatchError(
                    f"{path} holds {optimizer_count} optimizer state(s) but the LightningModule configures "
                    f"{len(optimizers)} optimizer(s)"
                )
            else:
                load_optimizers()
        return rest

    def remove(self, path: str | os.PathLike) -> None:
        """Rank 0 only (Lightning calls it on every rank and filters).

        With an asynchronous save in flight, ``path`` is deleted once that save is published (never
        before: a crash in between would leave no checkpoint), without waiting for it here: top-k
        deletes the previous checkpoint after every save, and waiting undid every async save's overlap.
        The save of ``path`` itself is waited for first.
        """
        pending = self.writer.pending
        if pending is not None:
            if os.path.realpath(pending.path) == os.path.realpath(path):
                pending.wait()  # never delete a checkpoint that is still being published
            elif pending.after_publish(lambda: _remove(path)):
                return
        _remove(path)

    def teardown(self) -> None:
        pending, self.writer.pending = self.writer.pending, None
        if pending is not None:
            pending.wait()
        self.writer.release_staging()
        self.writer.release_group()


def _remove(path: str | os.PathLike) -> None:
    checksums.remove_sidecar(path)  # a single file's checksum goes with it (a symlink's target keeps its own)
    remove_checkpoint(path)
