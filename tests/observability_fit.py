"""A 2-process CPU ``Trainer.fit`` with ``RaggedFSDPMetrics`` and the monitor endpoint (``tests/metrics_fits.py`` runs it).

Rank 0 queries ``/health`` and ``/metrics`` over loopback in the middle of the fit, checks
after ``fit`` that the port is closed, and writes what it saw, the logged metrics and the
planned buffer sizes.
"""

from __future__ import annotations

import json
import socket
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.loggers.logger import Logger  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_ragged as lr  # noqa: E402
from lightning_ragged.lightning.callbacks import RaggedFSDPMetrics  # noqa: E402
from tests.models import lm_loss, make_batches, make_model  # noqa: E402

STEPS = 6
LOG_EVERY = 2
PROBE_STEP = 3
VAL_EVERY = 3  # a validation run after steps 3 and 6, inside logging windows


class MemoryLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.records.append((step, dict(metrics)))


class LM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = make_model()

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.model, batch)
        self.log("train_loss", loss)  # Lightning's own step numbering, for the callback's records to line up with
        return loss

    def validation_step(self, batch, batch_idx):  # inside fit: its all-gathers are not a step's (metrics)
        self.log("val_loss", lm_loss(self.model, batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ProbeEndpoint(pl.Callback):
    def __init__(self, port: int) -> None:
        self.port = port
        self.seen: dict = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank != 0 or trainer.global_step != PROBE_STEP:
            return
        time.sleep(0.5)  # let rank 1's heartbeat thread publish a step
        base = f"http://127.0.0.1:{self.port}"
        with urllib.request.urlopen(f"{base}/health", timeout=10) as response:
            self.seen["health_status"] = response.status
            self.seen["health"] = json.loads(response.read())
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
            self.seen["metrics_status"] = response.status
            self.seen["metrics_content_type"] = response.headers["Content-Type"]
            self.seen["metrics"] = response.read().decode()


def main(out: Path, port: int) -> None:
    data = make_batches(1, STEPS * 2 * 2)[0]  # 2 ranks x 2 sequences per step
    logger = MemoryLogger()
    probe = ProbeEndpoint(port)
    metrics = RaggedFSDPMetrics(monitor_port=port, heartbeat_interval=0.1, health_timeout=30)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ragged_fsdp",
        max_steps=STEPS,
        val_check_interval=VAL_EVERY,  # plus Lightning's sanity check before the first step
        log_every_n_steps=LOG_EVERY,
        logger=logger,
        callbacks=[metrics, probe],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = LM()
    trainer.fit(module, DataLoader(data, batch_size=2), DataLoader(data[:4], batch_size=2))
    if trainer.global_rank != 0:
        return
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        after = "still open"
    except OSError as error:
        after = f"closed: {type(error).__name__}"
    state = lr.get_state(trainer.strategy.model)
    buffers = [
        dict(
            # metrics label a group's DBuffers "name#i" when it has several (the root has two)
            group=group.name if len(group.dbuffers) == 1 else f"{group.name}#{index}",
            root=group.is_root,
            bytes=dbuffer.layout.buffer_numel * dbuffer.unsharded.element_size(),
            segment_size=dbuffer.layout.segment_size,
            padding_ratio=dbuffer.layout.padding_ratio,
        )
        for group in state.all_groups
        for index, dbuffer in enumerate(group.dbuffers)
    ]
    records = [(step, {k: v for k, v in m.items() if k.startswith("ragged_fsdp/")}) for step, m in logger.records]
    records = [(step, values) for step, values in records if values]  # not the validation's own records
    validations = sum("val_loss" in m for _, m in logger.records)
    loss_steps = [step for step, m in logger.records if "train_loss" in m]
    out.write_text(json.dumps(dict(seen=probe.seen, after_fit=after, buffers=buffers, records=records,
                                   validations=validations, loss_steps=loss_steps)))
