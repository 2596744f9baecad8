"""A Lightning ``Trainer(strategy="ragged_fsdp", devices=2)`` run with Muon + AdamW param groups.

The test starts this file as a script (``python tests/test_optim_lightning.py OUT.json``);
Lightning's launcher re-runs it for rank 1. ``configure_optimizers`` returns one
``MuonWithAuxAdamW``: Muon on the blocks' hidden matrices, AdamW on embeddings, norms,
biases and the head — the recipe docs/optimizers.md documents.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LAUNCH_VARS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "PL_GLOBAL_SEED", "TORCHELASTIC_RUN_ID")
STEPS = 12


def _fit(out: str) -> None:
    sys.path.insert(0, str(ROOT))
    import warnings

    import lightning.pytorch as L
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    import lightning_ragged  # noqa: F401  (registers "ragged_fsdp")
    from lightning_ragged.optim import MuonWithAuxAdamW, muon_param_groups
    from tests.clean_exit import exit_without_teardown
    from tests.lightning_models import LitTinyGPT, token_loader

    warnings.filterwarnings("ignore")

    class LitMuon(LitTinyGPT):
        def configure_optimizers(self):
            return MuonWithAuxAdamW(
                muon_param_groups(self, muon=dict(lr=0.05), adamw=dict(lr=1e-2, weight_decay=0.0))
            )

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            # forward+backward first, outside the count: CommDebugMode's module tracker (torch 2.13)
            # fails when a module re-enters its own forward, as Lightning's forward redirection does
            # (training_step runs as this module's forward and calls self(...)).
            optimizer_closure()
            with CommDebugMode() as comm:
                optimizer.step()
            self.step_collectives.append(comm.get_comm_counts()[torch.ops.c10d.alltoall_base_])
            self.step_totals.append(comm.get_total_counts())

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy="ragged_fsdp", accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    model = LitMuon(lr=0.0)
    model.step_collectives = []
    model.step_totals = []
    trainer.fit(model, token_loader(STEPS * 2 * 4, 4))
    optimizer = trainer.optimizers[0]
    losses = torch.tensor(model.losses, dtype=torch.float64)
    dist.all_reduce(losses)
    result = dict(
        losses=(losses / 2).tolist(),
        optimizer=type(optimizer).__name__,
        muon_params=sorted(optimizer.param_groups[0]["param_names"]),
        adamw_params=sorted(optimizer.param_groups[1]["param_names"]),
        split=optimizer.last_plan.split,
        owned=optimizer.last_plan.owned,
        all_to_alls=model.step_collectives,
        step_collectives=model.step_totals,
        state_keys=sorted(optimizer.state_dict()["state"]),
    )
    if trainer.global_rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    exit_without_teardown()  # the result is written (tests/clean_exit.py)


def test_trainer_muon_adamw_loss_falls(tmp_path):
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=480)
    assert proc.returncode == 0 and out.exists(), f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(out.read_text())
    losses = result["losses"]
    assert len(losses) == STEPS
    assert sum(losses[-3:]) / 3 < 0.85 * losses[0], losses  # measured: 3.56 -> ~2.8
    assert result["optimizer"] == "MuonWithAuxAdamW"
    assert result["muon_params"] == sorted(
        f"model.blocks.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "up", "down")
    )
    assert "model.tok.weight" in result["adamw_params"] and "model.head.weight" in result["adamw_params"]
    assert set(result["state_keys"]) == set(result["muon_params"]) | set(result["adamw_params"])
    # default "row" granularity splits some matrices: one all-to-all each way per step, and no other collective
    assert result["split"] > 0 and set(result["all_to_alls"]) == {2}
    assert result["step_collectives"] == result["all_to_alls"]


if __name__ == "__main__":
    _fit(sys.argv[1])
