"""A Lightning ``Trainer(strategy="ragged_fsdp", devices=2)`` fit with Muon + AdamW param groups.

``tests/lightning_runs.py``'s main mode runs it in its processes; ``tests/test_optim_lightning.py``
checks the result. ``configure_optimizers`` returns one ``MuonWithAuxAdamW``: Muon on the blocks'
hidden matrices, AdamW on embeddings, norms, biases and the head (the recipe of docs/optimizers.md).
"""

from __future__ import annotations

import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from lightning_ragged.optim import MuonWithAuxAdamW, muon_param_groups
from tests.lightning_models import LitTinyGPT, token_loader

STEPS = 12


class LitMuon(LitTinyGPT):
    def configure_optimizers(self):
        return MuonWithAuxAdamW(muon_param_groups(self, muon=dict(lr=0.05), adamw=dict(lr=1e-2, weight_decay=0.0)))

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        # forward+backward first, outside the count: CommDebugMode's module tracker (torch 2.13)
        # fails when a module re-enters its own forward, as Lightning's forward redirection does
        # (training_step runs as this module's forward and calls self(...)).
        optimizer_closure()
        with CommDebugMode() as comm:
            optimizer.step()
        self.step_collectives.append(comm.get_comm_counts()[torch.ops.c10d.alltoall_base_])
        self.step_totals.append(comm.get_total_counts())


def fit() -> dict:
    """The fit's losses (mean over ranks), optimizer groups, plan and per-step collectives (every rank)."""
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
    return dict(
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
