"""A small 2-task training job for tests/test_slurm.py, launched by ``srun`` inside ``sbatch``.

    srun python tests/slurm_job.py --out DIR [--devices 2] [--num-nodes 1] [--max-steps 200]
                                   [--replicate-degree {1,2,...,node} [--replicate-degree ...]]

``Trainer(strategy="ragged_fsdp", accelerator="cpu", devices=2, num_nodes=1)`` under Lightning's
``SLURMEnvironment`` (detected from srun's variables; auto-requeue on SIGUSR1 is its default).
With ``--replicate-degree`` the strategy is ``RaggedFSDPStrategy(replicate_degree=...)`` instead
of the registered name (the two-node test: ``--num-nodes 2 --devices 1``, plain and HSDP, one
after the other in the same processes, each in ``OUT/degree-<value>``).
The model has several FSDP groups (all-gathers and reductions all through the step, so a
signal lands inside different collectives on different ranks) and dropout (random ops whose
RNG state must survive a requeue). The data of step ``s`` on rank ``r`` is drawn from a
generator seeded with ``(s, r)``: the data position resumes with the step, independently of
the loader (a plain DataLoader restarts its epoch on a mid-epoch resume).

Rank 0 prints ``PROGRESS step=<n>`` after every optimizer step (the test sends SIGUSR1 once it
sees a chosen step). When the run reaches ``max_steps``, rank 0 writes ``final.pt`` (full
parameters) and ``result.json``; every rank writes ``requeue-r<rank>-run<restart>.json``
(where the signal landed, where the ranks agreed and saved) whenever a signal arrived.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

START = time.monotonic()

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import lightning.pytorch as L
import lightning_ragged as lr
from lightning_ragged.lightning.preemption import SLURMRequeue

WIDTH, DEPTH, BATCH = 128, 6, 32


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.drop = nn.Dropout(0.1)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(F.gelu(self.up(self.norm(x)))))


class Regression(L.LightningModule):
    """Learn ``tanh(x @ T)`` for a fixed random ``T``; a fresh batch per (step, rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, WIDTH)
        self.teacher = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(1)) / WIDTH**0.5
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        seed = 1_000_003 * (self.global_step + 1) + self.global_rank
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(seed))
        loss = F.mse_loss(self(x), torch.tanh(x @ self.teacher))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):  # type: ignore[override]
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.01 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(range(1_000_000), batch_size=1)  # indices only; one epoch is longer than the run


class Progress(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the HSDP groups (gone once fit returns); replicate_group is None without HSDP
        replicate = getattr(trainer.strategy, "replicate_process_group", None)
        shard = getattr(trainer.strategy, "shard_process_group", None)
        pl_module.group_sizes = {  # type: ignore[assignment]
            "replicate_size": dist.get_world_size(replicate) if replicate is not None else 1,
            "shard_size": dist.get_world_size(shard) if shard is not None else trainer.world_size,
        }

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.is_global_zero:
            print(f"PROGRESS step={trainer.global_step} t={time.monotonic() - START:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--replicate-degree", action="append", default=None,
                        help="RaggedFSDPStrategy(replicate_degree=...); given twice: two runs, in OUT/degree-<value>")
    parser.add_argument("--sigterm-wait", type=float, default=None, help="SLURMRequeue(sigterm_wait_s=...)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        if args.replicate_degree is None:
            train(args, Path(args.out), "ragged_fsdp")
        for degree in args.replicate_degree or ():  # one process start for every run (the imports cost most)
            strategy = lr.RaggedFSDPStrategy(replicate_degree=degree if degree == "node" else int(degree))
            out = Path(args.out) / f"degree-{degree}" if len(args.replicate_degree) > 1 else Path(args.out)
            out.mkdir(exist_ok=True)
            train(args, out, strategy)
    finally:
        if dist.is_initialized():  # a gloo group left to the interpreter's exit may abort the process
            dist.destroy_process_group()


def train(args: argparse.Namespace, out: Path, strategy: object) -> None:
    """One fit; a later one in the same process reuses the process group Lightning initialized."""
    L.seed_everything(0, verbose=False)
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=args.max_steps,
        default_root_dir=out / "root",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Progress()] + ([SLURMRequeue(sigterm_wait_s=args.sigterm_wait)] if args.sigterm_wait else []),
    )
    environment = type(trainer.strategy.cluster_environment).__name__
    model = Regression()
    try:
        trainer.fit(model)  # resumes from default_root_dir/hpc_ckpt_<n>.ckpt after a requeue
        if trainer.global_step >= args.max_steps:
            write_result(trainer, model, out, environment, restart)
    finally:
        requeue = next((cb for cb in trainer.callbacks if isinstance(cb, SLURMRequeue)), None)
        if requeue is not None and (requeue.requested or requeue.requeue_attempts):
            record = {
                "rank": trainer.global_rank,
                "restart": restart,
                "signal_step": requeue.signal_step,
                "requeue_attempts": requeue.requeue_attempts,
                "signal_where": requeue.signal_where,
                "saved_step": requeue.saved_step,
                "saved_path": requeue.saved_path,
                "requeued": requeue.requeued,
                "sigterm_after_requeue": requeue.sigterm_after_requeue,
                "exit_s": round(time.monotonic() - START, 2),
            }
            (out / f"requeue-r{trainer.global_rank}-run{restart}.json").write_text(json.dumps(record))


def write_result(trainer: L.Trainer, model: Regression, out: Path, environment: str, restart: int) -> None:
    full = lr.full_state_dict(model)  # collective, every rank
    nodes: list = [None] * trainer.world_size
    dist.all_gather_object(nodes, os.environ.get("SLURMD_NODENAME"))
    if trainer.is_global_zero:
        torch.save(full, out / "final.pt")
        result = {
            "environment": environment,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "restart": restart,
            "losses": model.losses,
            "nodes": nodes,
            "num_nodes": trainer.num_nodes,
            **getattr(model, "group_sizes", {}),
            "requeue_callback": any(isinstance(cb, SLURMRequeue) for cb in trainer.callbacks),
        }
        (out / "result.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    main()
