"""The training script of the elastic-resize test (``tests/test_elastic.py``), run by torchrun.

``torchrun ... tests/elastic_job.py OUT_DIR [--oracle CKPT]``. The recipe of
docs/operations.md ("Elastic resize"): the Trainer is built for this (re)start's world size
(``torchrun_world()``) and ``fit`` resumes from ``newest_checkpoint(OUT_DIR/ckpt)``;
``ModelCheckpoint(save_last=True, every_n_train_steps=EVERY)`` writes the sharded checkpoints.

Test instrumentation only (files under OUT_DIR, never read by the recipe). Every start has a
tag, ``fresh-<id>`` (no checkpoint yet) or ``resumed-<id>``, ``<id>`` the same on all its ranks:

* ``steps.<tag>.<rank>.jsonl``: per optimizer step, the global step before it, the world
  size and the rank-local loss; ``batch.<tag>.<rank>.pt``: the first batch of a resumed start;
* a fresh start at world 3 only: at the start of step ``GATE_STEP`` (the newest checkpoint
  is the one of step ``CHECKPOINT_STEP``; one step of work after it will be lost) every rank
  writes ``ready.<rank>.json`` (its pid and its agent's) and waits (bounded) for ``go``: the
  test SIGKILLs one node (agent and worker) in that pause, then writes ``go``;
* ``start.<id>.json`` (rank 0, resumed starts): the checkpoint chosen and a copy of it
  (``resumed_from.<id>``) for the test's oracle; ``error.<tag>.<rank>.json``: the exception
  that ended a worker; ``final.<tag>.pt`` (rank 0): the full parameters at the end;
* ``--oracle CKPT``: the same training resumed directly from CKPT (no kill, no checkpoints
  written), tag ``oracle``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import lightning.pytorch as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from lightning_ragged import full_state_dict  # noqa: E402
from lightning_ragged.lightning.elastic import newest_checkpoint, restart_count, torchrun_world  # noqa: E402
from lightning_ragged.lightning.strategy import RaggedFSDPStrategy  # noqa: E402
from tests.lightning_models import LitTinyGPT, token_loader  # noqa: E402

MAX_STEPS = 8
EVERY = 2
GATE_STEP = 5
"""First start: every rank pauses before optimizer step 5 (steps 0-4 done, checkpoint of step 4 written)."""
CHECKPOINT_STEP = 4
SAMPLES = 48
BATCH = 2  # per rank
GATE_TIMEOUT_S = 150.0
TIMEOUT = timedelta(seconds=60)


def _write_json(path: Path, value: dict) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(value))
    os.replace(part, path)


class Record(Callback):
    def __init__(self, out: Path, tag: str, gate: bool) -> None:
        self.out = out
        self.tag = tag
        self.gate = gate
        self.first = True
        self.step_before = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        rank = trainer.global_rank
        self.step_before = trainer.global_step
        if self.first and not self.tag.startswith("fresh"):  # a resumed start's (or the oracle's) first batch
            torch.save(batch[0].clone(), self.out / f"batch.{self.tag}.{rank}.pt")
        self.first = False
        if self.gate and trainer.global_step == GATE_STEP and trainer.world_size == 3:
            _write_json(self.out / f"ready.{rank}.json", {"rank": rank, "pid": os.getpid(), "agent": os.getppid(),
                                                        "world": trainer.world_size, "tag": self.tag})
            deadline = time.monotonic() + GATE_TIMEOUT_S
            while not (self.out / "go").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("the test never said go")
                time.sleep(0.05)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = {"step": self.step_before, "world": trainer.world_size, "loss": pl_module.losses[-1],
                  "time": time.time()}
        with open(self.out / f"steps.{self.tag}.{trainer.global_rank}.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")


def main() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    faulthandler.enable(all_threads=True)  # an abort (SIGABRT) prints every thread's stack to the log
    out = Path(sys.argv[1])
    (out / "pids").mkdir(exist_ok=True)
    (out / "pids" / str(os.getpid())).write_text("")  # the test kills what is left if it fails
    oracle = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--oracle" else None
    ckpt_dir = out / "ckpt"
    rank = int(os.environ["RANK"])
    # One id per start, the same on every rank of it: the port of the store rank 0 hosts (fresh each
    # rendezvous round with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). TORCHELASTIC_RESTART_COUNT is no such
    # id: a restart for a membership change (another agent's workers failed first) keeps it.
    start = os.environ.get("MASTER_PORT", "0")
    if oracle:
        resume, tag = oracle, "oracle"
        callbacks = [Record(out, tag, gate=False)]
    else:
        resume = newest_checkpoint(ckpt_dir)  # the recipe: None on the first start
        tag = f"fresh-{start}" if resume is None else f"resumed-{start}"
        if rank == 0 and resume is not None:
            copy = out / f"resumed_from.{start}"
            shutil.copytree(resume, copy) if Path(resume).is_dir() else shutil.copy2(resume, copy)
            _write_json(out / f"start.{start}.json", {
                "path": resume, "copy": str(copy), "world": int(os.environ["WORLD_SIZE"]), "time": time.time(),
                "restart_count": restart_count(), "tag": tag,
            })
        callbacks = [
            Record(out, tag, gate=resume is None),
            ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0, every_n_train_steps=EVERY),
        ]
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy=RaggedFSDPStrategy(timeout=TIMEOUT),
        accelerator="cpu",
        **torchrun_world(),
        max_steps=MAX_STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        enable_checkpointing=not oracle,
        callbacks=callbacks,
    )
    model = LitTinyGPT(lr=0.5)
    try:
        trainer.fit(model, token_loader(SAMPLES, BATCH), ckpt_path=resume)
    except BaseException as error:  # recorded for the test, then re-raised: the agent sees a failed worker
        _write_json(out / f"error.{tag}.{rank}.json", {
            "type": type(error).__name__, "message": str(error), "time": time.time(),
            "lost_ranks": getattr(error, "lost_ranks", None), "traceback": traceback.format_exc()[-4000:],
        })
        raise
    params = full_state_dict(model)
    if rank == 0:
        torch.save({"params": params, "global_step": trainer.global_step, "world": trainer.world_size},
                   out / f"final.{tag}.pt")
    # the recipe: leave together and tear the process group down, or a rank may abort at exit
    # ("terminate called without an active exception") and its agent count the run as failed
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
