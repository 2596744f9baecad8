"""Trainer fits for ``tests/test_weight_averaging.py``, run by ``tests/lightning_runs.py main`` (2 gloo ranks).

Lightning's ``EMAWeightAveraging`` under ``ragged_fsdp`` against the same callback under DDP (the
oracle): training, validation on the averaged weights, the average at the end, checkpoints (a
sharded directory and one full file holding the average under ``state_dict`` and the trained
weights under ``current_model_state``), resuming from them (also into another layout) and a
second fit of the sharded module. ``BackboneFinetuning`` (frozen at the start, unfrozen with a
new parameter group in epoch 1) records its final weights for the test's one-process oracle.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import lightning.pytorch as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BackboneFinetuning, EMAWeightAveraging, ModelCheckpoint

from lightning_ragged import RaggedFSDPStrategy
from lightning_ragged.checkpoint import consolidate
from tests.comparisons import full_params, loss_diff, max_diff, worst
from tests.lightning_models import LitTinyGPT, cpu_trainer, token_loader

BATCH = 4  # per rank
STEPS = 6
DECAY = 0.8


class LitBackbone(LitTinyGPT):
    """``blocks`` is the backbone ``BackboneFinetuning`` freezes; the optimizer starts without it."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr)
        self.backbone = self.model.blocks

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr, momentum=0.9)


def _fit(strategy, model: LitTinyGPT, root: str | None = None, ckpt_path: str | None = None,
         accumulate: int = 1) -> L.Trainer:
    callbacks = [EMAWeightAveraging(decay=DECAY)]
    if root is not None:
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1))
    trainer = cpu_trainer(strategy, 2, STEPS, callbacks=callbacks, enable_checkpointing=root is not None,
                          limit_val_batches=1, val_check_interval=2 * accumulate, accumulate_grad_batches=accumulate)
    trainer.fit(model, token_loader(STEPS * 2 * BATCH * accumulate, BATCH), token_loader(2 * BATCH, BATCH, seed=5),
                ckpt_path=ckpt_path)
    return trainer


def _fresh() -> LitTinyGPT:
    L.seed_everything(0, verbose=False)
    return LitTinyGPT()


def run(results: dict) -> None:
    rank = dist.get_rank()
    holder = [tempfile.mkdtemp(prefix="ragged_ema_") if rank == 0 else None]
    dist.broadcast_object_list(holder)
    root = holder[0]
    dirs = {name: os.path.join(root, name) for name in ("ddp", "sharded", "full")}

    # Training, validation (the callback swaps the average in) and the average copied in at the end.
    models = {"ddp": _fresh(), "sharded": _fresh(), "full": _fresh()}
    trainers = {
        "ddp": _fit("ddp", models["ddp"], dirs["ddp"]),
        "sharded": _fit(RaggedFSDPStrategy(), models["sharded"], dirs["sharded"]),
        "full": _fit(RaggedFSDPStrategy(state_dict_type="full"), models["full"], dirs["full"]),
    }
    final = {name: full_params(model) for name, model in models.items()}
    for name in ("sharded", "full"):
        results[f"{name}_loss_diff"] = worst(loss_diff(models[name], models["ddp"]))
        results[f"{name}_val_diff"] = worst(
            max(abs(a - b) for a, b in zip(models[name].val_losses, models["ddp"].val_losses)))
        results[f"{name}_final_diff"] = worst(max_diff(final[name], final["ddp"]))
    results["val_count"] = len(models["sharded"].val_losses)
    results["trained_vs_average"] = worst(max_diff(final["ddp"], full_params(_trained_weights(trainers["ddp"]))))
    # The average holds this rank's shards only.
    callback = next(c for c in trainers["sharded"].callbacks if isinstance(c, EMAWeightAveraging))
    average = callback._average_model.module
    results["average_numel"] = sum(p.numel() for p in average.parameters())
    results["shard_numel"] = sum(p.numel() for p in models["sharded"].parameters())
    results["full_numel"] = sum(p.numel() for p in LitTinyGPT().parameters())
    total = torch.tensor([results["average_numel"]], dtype=torch.float64)
    dist.all_reduce(total)
    results["average_numel_sum"] = total.item()

    # The checkpoints hold what DDP's does: the average under state_dict, the trained weights beside it.
    step3 = {name: os.path.join(dirs[name], "epoch=0-step=3.ckpt") for name in dirs}
    dist.barrier()
    if rank == 0:
        reference = torch.load(step3["ddp"], weights_only=False)
        out = os.path.join(root, "consolidated.ckpt")
        consolidate(step3["sharded"], out)
        for name, path in (("sharded", out), ("full", step3["full"])):
            saved = torch.load(path, weights_only=False)
            results[f"{name}_ckpt_average_diff"] = max_diff(saved["state_dict"], reference["state_dict"])
            results[f"{name}_ckpt_current_diff"] = max_diff(saved["current_model_state"],
                                                         reference["current_model_state"])
            results[f"{name}_ckpt_n_averaged"] = int(saved["averaging_state"]["n_averaged"])
        results["ddp_ckpt_n_averaged"] = int(reference["averaging_state"]["n_averaged"])

    # validate(ckpt_path=...) after the fit, the callback still holding its average: DDP validates the checkpoint's
    # average and leaves the module on the checkpoint's trained weights (before: KeyError 'state_dict' on every rank)
    for name in dirs:
        trainers[name].validate(models[name], token_loader(2 * BATCH, BATCH, seed=5), ckpt_path=step3[name],
                                verbose=False)
    for name in ("sharded", "full"):
        results[f"{name}_validate_ckpt_diff"] = worst(abs(models[name].val_losses[-1] - models["ddp"].val_losses[-1]))
        results[f"{name}_after_validate_diff"] = worst(max_diff(full_params(models[name]), full_params(models["ddp"])))
    results["validate_ckpt_vs_final"] = worst(abs(models["ddp"].val_losses[-1] - models["ddp"].val_losses[-2]))
    # ... and from a checkpoint saved without averaging, then a fit with the callback resumed from it: Lightning's
    # callback starts both from its state_dict (before: KeyError 'state_dict' in both)
    plain = {name: os.path.join(root, f"plain_{name}.ckpt") for name in ("ddp", "sharded")}
    for name, strategy in (("ddp", lambda: "ddp"), ("sharded", RaggedFSDPStrategy)):
        trainer = cpu_trainer(strategy(), 2, 2, enable_checkpointing=False)
        trainer.fit(_fresh(), token_loader(4 * BATCH, BATCH))
        trainer.save_checkpoint(plain[name])
        trainers[name].validate(models[name], token_loader(2 * BATCH, BATCH, seed=5), ckpt_path=plain[name],
                                verbose=False)
        models[f"plain_{name}"] = _fresh()
        _fit(strategy(), models[f"plain_{name}"], ckpt_path=plain[name])
    results["validate_plain_diff"] = worst(abs(models["sharded"].val_losses[-1] - models["ddp"].val_losses[-1]))
    results["resume_plain_diff"] = worst(max_diff(full_params(models["plain_sharded"]), full_params(models["plain_ddp"])))

    # Resuming from step 3 (mid-epoch: Lightning replays the epoch's batches, under DDP alike).
    resumed = {name: _fresh() for name in ("ddp", "sharded", "full", "relayout")}
    _fit("ddp", resumed["ddp"], ckpt_path=step3["ddp"])
    _fit(RaggedFSDPStrategy(), resumed["sharded"], ckpt_path=step3["sharded"])
    _fit(RaggedFSDPStrategy(), resumed["full"], ckpt_path=step3["full"])
    # another layout: row granularity, 2 replicas of 1 shard
    _fit(RaggedFSDPStrategy(shard_granularity="row", replicate_degree=2), resumed["relayout"],
         ckpt_path=step3["sharded"])
    reference = full_params(resumed["ddp"])
    for name in ("sharded", "full", "relayout"):
        results[f"resume_{name}_diff"] = worst(max_diff(full_params(resumed[name]), reference))
        results[f"resume_{name}_loss_diff"] = worst(loss_diff(resumed[name], resumed["ddp"]))
    results["resume_steps"] = len(resumed["sharded"].losses)

    # Accumulation: a micro-batch's forward runs outside optimizer.step, right after the validation the callback
    # swapped the average in and out for (through .data, which moves no version counter): before, the root's groups
    # kept from validation's no-grad forwards fed it the average (1.9e-2 from DDP's loss)
    accumulated = {"ddp": _fresh(), "sharded": _fresh()}
    _fit("ddp", accumulated["ddp"], accumulate=2)
    _fit(RaggedFSDPStrategy(), accumulated["sharded"], accumulate=2)
    results["accumulated_loss_diff"] = worst(loss_diff(accumulated["sharded"], accumulated["ddp"]))
    results["accumulated_val_diff"] = worst(
        max(abs(a - b) for a, b in zip(accumulated["sharded"].val_losses, accumulated["ddp"].val_losses)))
    results["accumulated_final_diff"] = worst(max_diff(full_params(accumulated["sharded"]),
                                                       full_params(accumulated["ddp"])))
    results["accumulated_val_count"] = len(accumulated["sharded"].val_losses)

    # A second fit of the sharded module with the callback (the module itself is never deep-copied).
    again = {"ddp": _fresh(), "ragged": _fresh()}
    for name, strategy in (("ddp", lambda: "ddp"), ("ragged", RaggedFSDPStrategy)):
        for _ in range(2):
            _fit(strategy(), again[name])
    results["second_fit_diff"] = worst(max_diff(full_params(again["ragged"]), full_params(again["ddp"])))

    # BackboneFinetuning: frozen blocks, unfrozen at epoch 1 with their own parameter group.
    L.seed_everything(0, verbose=False)
    backbone = LitBackbone()
    trainer = cpu_trainer(RaggedFSDPStrategy(), 2, 12, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
                          enable_checkpointing=False)
    trainer.fit(backbone, token_loader(4 * 2 * BATCH, BATCH))
    results["backbone_weights"] = {k: v.tolist() for k, v in full_params(backbone).items()}
    results["backbone_param_groups"] = len(trainer.optimizers[0].param_groups)
    groups = [None] * dist.get_world_size()  # every rank's parameters per group: the same on all
    dist.all_gather_object(groups, [len(group["params"]) for group in trainer.optimizers[0].param_groups])
    results["backbone_group_sizes"] = groups
    results["backbone_saved_groups"] = _finetuning(trainer).state_dict()["internal_optimizer_metadata"][0]
    # ... and resumed from a checkpoint taken after the unfreeze (end of epoch 1) for one more epoch
    path = os.path.join(root, "unfrozen")
    for epochs, ckpt_path in ((2, None), (3, path)):
        L.seed_everything(0, verbose=False)
        resumed = LitBackbone()
        trainer = cpu_trainer(RaggedFSDPStrategy(), 2, -1, max_epochs=epochs, enable_checkpointing=False,
                              callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
        trainer.fit(resumed, token_loader(4 * 2 * BATCH, BATCH), ckpt_path=ckpt_path)
        if ckpt_path is None:
            trainer.save_checkpoint(path)
    results["backbone_resumed_weights"] = {k: v.tolist() for k, v in full_params(resumed).items()}
    results["backbone_resumed_restarting"] = _finetuning(trainer)._restarting
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def _finetuning(trainer: L.Trainer) -> BackboneFinetuning:
    return next(callback for callback in trainer.callbacks if isinstance(callback, BackboneFinetuning))


def _trained_weights(trainer: L.Trainer) -> L.LightningModule:
    """The DDP run's last checkpoint's trained weights (``current_model_state``), loaded into a plain module."""
    path = os.path.join(trainer.checkpoint_callback.dirpath, "epoch=0-step=6.ckpt")
    module = LitTinyGPT()
    module.load_state_dict(torch.load(path, weights_only=False)["current_model_state"])
    return module
