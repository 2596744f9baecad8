"""Two 2-process CPU fits for the metrics callback across a resume (``tests/metrics_fits.py`` runs them).

The first trains 2 optimizer steps of 3 accumulated micro-batches and saves; the second resumes from that
checkpoint to step 5 with a validation after step 4 whose batches take longer than ``health_timeout``, and a
checkpoint save after step 3 that takes longer than it too. Rank 0 writes the logged per-step counts of both fits
and ``/health`` as seen at the validation's last batch and at the end of the save's dump.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from tests.models import make_batches
from tests.observability_fit import LM, MemoryLogger
from lightning_ragged.lightning.callbacks import RaggedFSDPMetrics

ACCUMULATE = 3
HEALTH_TIMEOUT = 1.0
VAL_BATCH_S = 0.5  # 3 validation batches: 1.5 s without a training step, more than HEALTH_TIMEOUT
SAVE_S = 1.5  # a checkpoint save (its dump, on every rank) longer than HEALTH_TIMEOUT
SAVE_AFTER = 3
HANG_S = 3.0  # every rank idle after the save: 3x HEALTH_TIMEOUT, so ranks leaving the save apart still read stalled


class SlowValidation(LM):
    def validation_step(self, batch, batch_idx):
        time.sleep(VAL_BATCH_S)


class ProbeHealth(pl.Callback):
    def __init__(self, port: int, save_to: Path) -> None:
        self.port, self.save_to, self.seen, self.seen_saving = port, save_to, None, None
        self.saved, self.seen_after_save = False, None

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.global_rank == 0 and batch_idx == 2:
            time.sleep(0.3)  # rank 1's heartbeat (every 0.1 s) publishes its validation progress
            self.seen = self._health()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.port is not None and trainer.global_step == SAVE_AFTER and not self.saved:
            self.saved = True
            trainer.save_checkpoint(self.save_to)
            time.sleep(HANG_S)  # a hang right after the save (a data loader, a collective) is a stall again
            if trainer.global_rank == 0:
                self.seen_after_save = self._health()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # after RaggedFSDPMetrics' (its order)
        if self.port is not None:
            time.sleep(SAVE_S)
            if trainer.global_rank == 0:
                self.seen_saving = self._health()

    def _health(self) -> dict:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:  # 503: stalled
            return json.loads(error.read())


def _fit(root: Path, max_steps: int, data, ckpt_path=None, port=None) -> tuple[pl.Trainer, MemoryLogger, ProbeHealth]:
    logger, probe = MemoryLogger(), ProbeHealth(port, root / "during_fit.ckpt")
    metrics = RaggedFSDPMetrics(monitor_port=port, heartbeat_interval=0.1, health_timeout=HEALTH_TIMEOUT)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ragged_fsdp", max_steps=max_steps, default_root_dir=root,
        accumulate_grad_batches=ACCUMULATE, log_every_n_steps=1, logger=logger, callbacks=[metrics, probe],
        val_check_interval=4 * ACCUMULATE, limit_val_batches=3, num_sanity_val_steps=0,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(SlowValidation(), DataLoader(data, batch_size=2), DataLoader(data[:12], batch_size=2),
                ckpt_path=ckpt_path)
    return trainer, logger, probe


def _per_step(logger: MemoryLogger) -> list:
    return [[step, m["ragged_fsdp/all_gathers"], m["ragged_fsdp/reduces"]] for step, m in logger.records
            if "ragged_fsdp/all_gathers" in m]


def main(out: Path, port: int) -> None:
    data = make_batches(1, 5 * ACCUMULATE * 2 * 2)[0]  # 5 steps x 3 micro-batches x 2 ranks x 2 sequences
    root = out.parent / "resume_fit"
    first, first_log, _ = _fit(root, 2, data)
    first.save_checkpoint(root / "step2.ckpt")
    second, second_log, probe = _fit(root, 5, data, ckpt_path=root / "step2.ckpt", port=port)
    if second.global_rank == 0:
        out.write_text(json.dumps(dict(first=_per_step(first_log), resumed=_per_step(second_log), health=probe.seen,
                                       health_saving=probe.seen_saving, health_after_save=probe.seen_after_save)))
