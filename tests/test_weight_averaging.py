"""Lightning's weight averaging (``EMAWeightAveraging``) and ``BackboneFinetuning`` under ``ragged_fsdp``.

The fits run in ``tests/averaging_runs.py`` (part of the ``main_run`` 2-rank start-up). Oracles:
the same callback under Lightning's DDP, and for ``BackboneFinetuning`` one-process training on
each step's global batch (DDP is no oracle there: its reducer is built while the backbone is
frozen, so after the unfreeze each rank steps its backbone with its own gradients).
"""

from __future__ import annotations

import torch

FP32_TOL = 1e-5  # the same fp32 arithmetic on the same values; only summation order may differ


def test_ema_trains_validates_and_ends_on_the_average_as_under_ddp(main_run: dict) -> None:
    run = main_run["averaging"]
    assert run["val_count"] == 3  # validation every 2 of 6 steps, on the swapped-in average
    for name in ("sharded", "full"):
        assert run[f"{name}_loss_diff"] <= FP32_TOL, run
        assert run[f"{name}_val_diff"] <= FP32_TOL, run
        assert run[f"{name}_final_diff"] <= FP32_TOL, run
    # the average is not the trained weights (an averaging that did nothing would pass the rest)
    assert run["trained_vs_average"] > 100 * FP32_TOL, run


def test_ema_with_accumulation_trains_on_the_weights_not_the_swapped_out_average(main_run: dict) -> None:
    run = main_run["averaging"]
    assert run["accumulated_val_count"] == 3, run
    for key in ("accumulated_loss_diff", "accumulated_val_diff", "accumulated_final_diff"):
        assert run[key] <= FP32_TOL, run


def test_the_average_costs_one_shard_per_rank(main_run: dict) -> None:
    run = main_run["averaging"]
    assert run["average_numel"] == run["shard_numel"] < run["full_numel"], run
    assert run["average_numel_sum"] == run["full_numel"], run  # the ranks' averages together: the model once


def test_checkpoints_hold_the_average_and_the_trained_weights_as_ddps_do(main_run: dict) -> None:
    run = main_run["averaging"]
    for name in ("sharded", "full"):  # the sharded directory consolidated; the full file as written
        assert run[f"{name}_ckpt_average_diff"] <= FP32_TOL, run
        assert run[f"{name}_ckpt_current_diff"] <= FP32_TOL, run
        assert run[f"{name}_ckpt_n_averaged"] == run["ddp_ckpt_n_averaged"] == 3, run


def test_validate_from_a_checkpoint_after_fit_uses_its_average_as_under_ddp(main_run: dict) -> None:
    run = main_run["averaging"]
    for name in ("sharded", "full"):
        assert run[f"{name}_validate_ckpt_diff"] <= FP32_TOL, run
        assert run[f"{name}_after_validate_diff"] <= FP32_TOL, run
    assert run["validate_ckpt_vs_final"] > 100 * FP32_TOL, run  # step 3's average is not the end's
    assert run["validate_plain_diff"] <= FP32_TOL and run["resume_plain_diff"] <= FP32_TOL, run


def test_resuming_restores_the_average_and_the_weights_in_any_layout(main_run: dict) -> None:
    run = main_run["averaging"]
    assert run["resume_steps"] == 3, run  # steps 4-6 trained after the restore
    for name in ("sharded", "full", "relayout"):
        assert run[f"resume_{name}_diff"] <= FP32_TOL, run
        assert run[f"resume_{name}_loss_diff"] <= FP32_TOL, run


def test_a_second_fit_of_the_sharded_module_averages_again(main_run: dict) -> None:
    assert main_run["averaging"]["second_fit_diff"] <= FP32_TOL, main_run["averaging"]


class _GlobalBatches(torch.utils.data.Sampler):
    """Each step's global batch of a 2-rank run: both ranks' shuffled ``DistributedSampler`` batches (seed 0)."""

    def __init__(self, dataset: torch.utils.data.Dataset, per_rank: int) -> None:
        self.dataset, self.per_rank, self.epoch = dataset, per_rank, 0

    def __iter__(self):
        from torch.utils.data import DistributedSampler

        ranks = []
        for rank in range(2):
            sampler = DistributedSampler(self.dataset, num_replicas=2, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(self.epoch)
            ranks.append(list(sampler))
        self.epoch += 1
        for start in range(0, len(ranks[0]), self.per_rank):
            yield ranks[0][start : start + self.per_rank] + ranks[1][start : start + self.per_rank]

    def __len__(self) -> int:
        return len(self.dataset) // (2 * self.per_rank)


def _identity_filter(optimizer, params) -> list:
    """``BaseFinetuning.filter_on_optimizer`` as meant: leave out the parameters already in the optimizer (Lightning
    compares values with ``torch.equal``: the blocks' LayerNorm weights, all ones like the final norm's, were left
    out of the new group and never trained, in one process and under DDP)."""
    present = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [p for p in params if id(p) not in present]


def test_backbone_finetuning_unfreezes_into_a_new_param_group_like_one_process(main_run: dict, monkeypatch,
                                                                                tmp_path) -> None:
    """Frozen blocks at the start (not in the optimizer), unfrozen at epoch 1 with lr/10 in their own group, then
    raised each epoch: the 2-rank sharded run ends where one process on the global batches ends (the check of
    what is already in the optimizer by identity in both). Every rank builds the same groups, all the blocks'
    parameters in the new one (before: a shard equal in value to one in the optimizer, an empty one or a norm's,
    was left out on some ranks); resumed from a checkpoint after the unfreeze it ends at the same weights (before:
    the restore came after the callback rebuilt its group, "holds optimizer state for parameters the optimizer
    does not have")."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning
    from torch.utils.data import DataLoader

    from tests.averaging_runs import BATCH, LitBackbone
    from tests.lightning_models import cpu_trainer, token_loader

    run = main_run["averaging"]
    monkeypatch.setattr(BaseFinetuning, "filter_on_optimizer", staticmethod(_identity_filter))
    L.seed_everything(0, verbose=False)
    model = LitBackbone()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = cpu_trainer("auto", 1, 12, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
                          enable_checkpointing=False, use_distributed_sampler=False)
    dataset = token_loader(4 * 2 * BATCH, BATCH).dataset
    trainer.fit(model, DataLoader(dataset, batch_sampler=_GlobalBatches(dataset, BATCH)))
    assert run["backbone_param_groups"] == len(trainer.optimizers[0].param_groups) == 2
    expected = model.state_dict()
    got = {k: torch.tensor(v) for k, v in run["backbone_weights"].items()}
    assert got.keys() == expected.keys()
    worst = max((got[k] - expected[k]).abs().max().item() for k in got)
    assert worst <= FP32_TOL, worst
    for name in got:
        if "blocks" in name:  # every backbone parameter unfrozen and trained
            assert (got[name] - initial[name]).abs().max().item() > 100 * FP32_TOL, name
    names = [name for name, _ in model.named_parameters()]
    blocks = sorted(name for name in names if "blocks" in name)
    assert run["backbone_group_sizes"] == [[len(names) - len(blocks), len(blocks)]] * 2, run["backbone_group_sizes"]
    assert sorted(run["backbone_saved_groups"][1]["params"]) == blocks, run["backbone_saved_groups"]
    assert run["backbone_resumed_restarting"] is False, run  # before: left True (a later fit would re-apply it)

    # resumed after the unfreeze: the same in one process (Lightning freezes the backbone again at the restart,
    # so the last epoch trains the head only, under DDP too)
    path = tmp_path / "unfrozen.ckpt"
    for epochs, start in ((2, 0), (3, 2)):
        L.seed_everything(0, verbose=False)
        model = LitBackbone()
        trainer = cpu_trainer("auto", 1, -1, max_epochs=epochs, enable_checkpointing=False,
                              callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)], use_distributed_sampler=False)
        batches = _GlobalBatches(dataset, BATCH)
        batches.epoch = start
        trainer.fit(model, DataLoader(dataset, batch_sampler=batches), ckpt_path=path if start else None)
        if not start:
            trainer.save_checkpoint(path)
    expected = model.state_dict()
    got = {k: torch.tensor(v) for k, v in run["backbone_resumed_weights"].items()}
    assert max((got[k] - expected[k]).abs().max().item() for k in got) <= FP32_TOL
