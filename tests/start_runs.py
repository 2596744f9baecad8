"""Real Trainer runs for ``tests/test_start.py``, run by ``tests/lightning_runs.py``'s main mode (``run``).

Every Trainer below runs in the same two processes as the main mode's (one start-up). Each rank
computes its own numbers; the worst value over ranks is all-reduced into the results.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelSummary  # noqa: E402
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count  # noqa: E402

import lightning_ragged  # noqa: E402,F401  (registers "ragged_fsdp")
from lightning_ragged import RaggedFSDPStrategy, full_state_dict  # noqa: E402
from tests.comparisons import max_diff, worst  # noqa: E402
from tests.lightning_models import cpu_trainer  # noqa: E402
from tests.start_models import (  # noqa: E402
    LitConvBN,
    LitLlama,
    LitLlamaShardedByUser,
    image_loader,
    llama_tokens,
    running_stats,
)

warnings.filterwarnings("ignore")
BATCH = 4  # per rank
DEVICES = 2


def spread(stats: torch.Tensor) -> float:
    """max |rank r's statistics - rank 0's| over ranks."""
    everyone = [torch.empty_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, stats)
    return max((e - everyone[0]).abs().max().item() for e in everyone)


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


class StartProbe(Callback):
    """Records the pre-shard state (``setup`` runs before the strategy shards) and, at fit start,
    the full state against rank 0's pre-shard state."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.before = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        box = [self.before]
        dist.broadcast_object_list(box, src=0)
        self.rank0 = box[0]
        self.own_vs_rank0 = max_diff(self.before, self.rank0)
        self.vs_rank0 = max_diff(full_state_dict(pl_module), self.rank0)


class SummaryProbe(ModelSummary):
    """Lightning's ModelSummary callback; keeps what it would print."""

    def summarize(self, summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, **kwargs) -> None:  # type: ignore[override]
        self.captured = dict(data=dict(summary_data), total=total_parameters, trainable=trainable_parameters,
                             model_size=model_size)


def unseeded_fit(results: dict, strategy, prefix: str, summary: bool = False) -> None:
    """No seed_everything: each rank seeds differently on purpose before building the model."""
    torch.manual_seed(1000 + local_rank())
    model = LitConvBN(freeze_head_bias=True)
    true_total = sum(p.numel() for p in model.parameters())
    true_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    true_layers = {name: sum(p.numel() for p in m.parameters()) for name, m in model.named_modules()
                   if name and name.count(".") < 2}  # the summary's layers at max_depth=2
    probe = StartProbe()
    callbacks: list = [probe]
    if summary:
        callbacks.append(SummaryProbe(max_depth=2))
    trainer = cpu_trainer(strategy, DEVICES, 1, enable_checkpointing=False, callbacks=callbacks)
    trainer.fit(model, image_loader(DEVICES * BATCH, BATCH))
    results[f"{prefix}_own_vs_rank0"] = worst(probe.own_vs_rank0)
    results[f"{prefix}_vs_rank0"] = worst(probe.vs_rank0)
    if summary and trainer.is_global_zero:  # Lightning prints (and so captures) on rank 0 only
        captured = callbacks[-1].captured
        data = captured["data"]
        results["summary"] = {
            "total": captured["total"], "trainable": captured["trainable"], "model_size": captured["model_size"],
            "true_total": true_total, "true_trainable": true_trainable,
            "layer_params": dict(zip(data["Name"], data["Params"])),
            "true_layer_params": {name: get_human_readable_count(n) for name, n in true_layers.items()},
            "per_device_total": sum(p.numel() for p in model.parameters()),  # the local shards
            "per_device_column": dict(zip(data["Name"], data["Params per Device"])),
        }


def batchnorm_fit(strategy, steps: int = 6) -> tuple[LitConvBN, torch.Tensor]:
    L.seed_everything(4, verbose=False)
    model = LitConvBN()
    trainer = cpu_trainer(strategy, DEVICES, steps, enable_checkpointing=False)
    trainer.fit(model, image_loader(steps * DEVICES * BATCH, BATCH, seed=2))
    return model, running_stats(model)


def params_of(model: L.LightningModule) -> dict:
    if getattr(model, "_ragged_fsdp_state", None) is not None:
        full = full_state_dict(model)
        return {k: full[k] for k, _ in model.named_parameters()}
    return {k: p.detach().clone() for k, p in model.named_parameters()}


def batchnorm_mode(results: dict) -> None:
    ddp, stats_ddp = batchnorm_fit("ddp")
    ragged, stats = batchnorm_fit(RaggedFSDPStrategy())  # broadcast_buffers=True, the default
    off, stats_off = batchnorm_fit(RaggedFSDPStrategy(broadcast_buffers=False))
    results["bn_params_vs_ddp"] = worst(max_diff(params_of(ddp), params_of(ragged)))
    results["bn_stats_vs_ddp"] = worst((stats - stats_ddp).abs().max().item())
    results["bn_off_stats_vs_ddp"] = worst((stats_off - stats_ddp).abs().max().item())
    results["bn_spread_ddp"] = spread(stats_ddp)
    results["bn_spread"] = spread(stats)
    results["bn_off_spread"] = spread(stats_off)


def llama_mode(results: dict) -> None:
    for tie, lora, by_user in ((False, False, False), (True, False, False), (False, True, False), (False, False, True)):
        name = "llama_lora" if lora else "llama_user_sharded" if by_user else f"llama_{'tied' if tie else 'untied'}"
        lit = LitLlamaShardedByUser if by_user else LitLlama
        L.seed_everything(11, verbose=False)
        eager = LitLlama(tie, lora)
        expected = {k: v.clone() for k, v in eager.state_dict().items()}
        expected_buffers = {k: v.clone() for k, v in eager.named_buffers()}
        L.seed_everything(11, verbose=False)
        trainer = cpu_trainer("ragged_fsdp", DEVICES, 1, enable_checkpointing=False)
        with trainer.init_module(empty_init=True):
            model = lit(tie, lora)
        results[f"{name}_built_on_meta"] = all(p.is_meta for p in model.parameters())
        trainer.validate(model, llama_tokens(DEVICES * BATCH, BATCH), verbose=False)
        full = full_state_dict(model)
        results[f"{name}_diff"] = worst(max_diff(full, expected))
        results[f"{name}_bitwise"] = worst(float(not all(torch.equal(full[k], expected[k]) for k in expected))) == 0
        results[f"{name}_buffers_equal"] = worst(float(not all(
            torch.equal(b, expected_buffers[k]) for k, b in model.named_buffers()))) == 0
    # Lightning's "empty_init=True, then load a checkpoint": the loaded values stand (before: the replayed
    # random initialization replaced them, silently; DDP keeps them)
    L.seed_everything(12, verbose=False)
    pretrained = {k: v.clone() for k, v in LitLlama(True, False).state_dict().items()}
    L.seed_everything(11, verbose=False)
    trainer = cpu_trainer("ragged_fsdp", DEVICES, 1, enable_checkpointing=False)
    with trainer.init_module(empty_init=True):
        model = LitLlama(True, False)
    model.load_state_dict(pretrained)
    trainer.validate(model, llama_tokens(DEVICES * BATCH, BATCH), verbose=False)
    full = full_state_dict(model)
    results["llama_loaded_keys"] = sorted(full) == sorted(pretrained)
    results["llama_loaded_bitwise"] = worst(float(not all(torch.equal(full[k], pretrained[k]) for k in pretrained))) == 0
    # ... and trains.
    L.seed_everything(11, verbose=False)
    trainer = cpu_trainer("ragged_fsdp", DEVICES, 2, enable_checkpointing=False)
    with trainer.init_module(empty_init=True):
        model = LitLlama()
    losses: list[float] = []

    class Losses(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))

    trainer.callbacks.append(Losses())
    trainer.fit(model, llama_tokens(2 * DEVICES * BATCH, BATCH))
    results["llama_fit_loss_finite"] = worst(float(not (losses and all(torch.isfinite(torch.tensor(losses)))))) == 0


def run(results: dict) -> None:
    unseeded_fit(results, RaggedFSDPStrategy(), "unseeded", summary=True)
    unseeded_fit(results, RaggedFSDPStrategy(sync_module_states=False), "unsynced")
    batchnorm_mode(results)
    llama_mode(results)
