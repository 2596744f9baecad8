"""A Lightning ``Trainer(strategy="ragged_fsdp", devices=2)`` fit with Muon + AdamW param groups (``tests/muon_run.py``).

The fit runs in the processes of ``tests/lightning_runs.py``'s main mode (one start-up for the
Trainer checks of several files); ``configure_optimizers`` returns one ``MuonWithAuxAdamW``:
Muon on the blocks' hidden matrices, AdamW on embeddings, norms, biases and the head — the
recipe docs/optimizers.md documents.
"""

from __future__ import annotations

from tests.muon_run import STEPS


def test_trainer_muon_adamw_loss_falls(main_run: dict) -> None:
    result = main_run["muon"]
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

