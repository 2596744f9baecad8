"""A Fabric training script as a user writes it, run by ``tests/test_fabric.py`` (Fabric launches the ranks).

``python tests/fabric_job.py OUT``: ``Fabric(strategy="ragged_fsdp", devices=2)`` trains the tiny LM
with accumulation (``no_backward_sync``), clipping and AdamW, saves a sharded checkpoint midway,
resumes it into a model built on the meta device, then reshards it into a second Fabric with HSDP
(replicate_degree=2: every rank holds the whole model) that saves and reloads one full file; a third
trains in ``precision="bf16-mixed"`` beside torch's FSDP2 with the same mixed-precision policy; a checkpoint
``fabric.save`` wrote under DDP resumes into a fresh model, and a last Fabric saves asynchronously as the
script's last statement.
Rank 0 writes every result to OUT for the test to compare with its one-process oracle.
"""

from __future__ import annotations

import atexit
import sys
from pathlib import Path

import lightning as L
import torch

import lightning_ragged as lr
from lightning_ragged.lightning.fabric_strategy import RaggedFSDPFabricStrategy
from tests.clean_exit import exit_without_teardown
from tests.models import TinyLM, lm_loss, make_batches, make_model

STEPS, SAVE_AT, MICRO, BATCH, MAX_NORM, LR, EMA_DECAY = 6, 3, 2, 4, 0.5, 1e-2, 0.7
"""Every step: MICRO micro-batches of BATCH sequences over the ranks; clipping at MAX_NORM is active (norms ~1)."""


class MetaReadyLM(TinyLM):
    """The tiny LM with an initializer for the parameter it owns, as a model built on the meta device needs."""

    def reset_parameters(self) -> None:
        torch.nn.init.normal_(self.pos, std=0.1)


REDUCES: list[int] = []
"""The engine's reductions during each micro-batch's backward, for every step ``train`` ran."""


def train(fabric: L.Fabric, model, optimizer, batches: torch.Tensor, steps: range, ema=None) -> list[float]:
    """Steps of MICRO accumulated micro-batches, the gradients reduced once per step; the clipping norms.
    ``ema``: a ``ShardAveragedModel`` updated after every step."""
    per_rank = BATCH // fabric.world_size
    rank = fabric.global_rank
    stats = lr.get_state(model.module).stats if isinstance(fabric.strategy, RaggedFSDPFabricStrategy) else None
    norms = []
    for step in steps:
        for micro in range(MICRO):
            tokens = batches[step, micro, rank * per_rank : (rank + 1) * per_rank]
            before = stats.reduces if stats else 0
            with fabric.no_backward_sync(model, enabled=micro < MICRO - 1):
                fabric.backward(lm_loss(model, tokens) / MICRO)
            if stats:
                REDUCES.append(stats.reduces - before)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        if ema is not None:
            ema.update_parameters(model.module)
    return norms


def make_ema(model) -> "lr.ShardAveragedModel":
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    return lr.ShardAveragedModel(model.module, multi_avg_fn=get_ema_multi_avg_fn(EMA_DECAY))


def average_of(ema, model) -> dict[str, torch.Tensor]:
    """The average's full tensors, read through the model (swapped in, gathered, swapped back)."""
    ema.swap(model.module)
    average = lr.full_state_dict(model.module)
    ema.swap(model.module)
    return average


def main(out: Path) -> None:
    batches = make_batches(STEPS * MICRO, BATCH).view(STEPS, MICRO, BATCH, -1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ragged_fsdp")
    fabric.launch()
    results: dict = {"strategy": type(fabric.strategy).__name__}

    # fabric.setup(model, optimizer): the optimizer was built on the unsharded parameters
    model = make_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    ema = make_ema(model)  # an EMA of the shards, saved and resumed with the model
    norms = train(fabric, model, optimizer, batches, range(SAVE_AT), ema)
    fabric.save(out / "sharded", {"model": model, "optimizer": optimizer, "ema": ema, "step": SAVE_AT})
    norms += train(fabric, model, optimizer, batches, range(SAVE_AT, STEPS), ema)
    results["norms"], results["reduces"] = norms, list(REDUCES)
    results["dbuffers"] = len(list(lr.get_state(model.module).dbuffers()))
    results["uninterrupted"] = lr.full_state_dict(model.module)
    results["ema_uninterrupted"] = average_of(ema, model)
    results["after_swaps"] = lr.full_state_dict(model.module)  # swapped in and back: the trained weights again

    # resume: a model built on the meta device, set up first, then its optimizer
    with fabric.init_module(empty_init=True):
        resumed = MetaReadyLM()
    resumed = fabric.setup_module(resumed)
    resumed_optimizer = fabric.setup_optimizers(torch.optim.AdamW(resumed.parameters(), lr=LR))
    resumed_ema = make_ema(resumed)
    state = {"model": resumed, "optimizer": resumed_optimizer, "ema": resumed_ema, "step": 0}
    results["remainder"] = fabric.load(out / "sharded", state)
    results["loaded_step"] = state["step"]
    train(fabric, resumed, resumed_optimizer, batches, range(SAVE_AT, STEPS), resumed_ema)
    results["resumed"] = lr.full_state_dict(resumed.module)
    results["ema_resumed"] = average_of(resumed_ema, resumed)

    # reshard: the world-2 checkpoint into HSDP with 2 replicas of 1 shard, then one full file
    full = L.Fabric(
        accelerator="cpu", devices=2, strategy=RaggedFSDPFabricStrategy(replicate_degree=2, state_dict_type="full")
    )
    full.launch()
    replica = full.setup_module(make_model(seed=7))
    replica_optimizer = full.setup_optimizers(torch.optim.AdamW(replica.parameters(), lr=LR))
    replica_ema = make_ema(replica)
    full.load(out / "sharded", {"model": replica, "optimizer": replica_optimizer, "ema": replica_ema})
    train(full, replica, replica_optimizer, batches, range(SAVE_AT, STEPS), replica_ema)
    results["replica"] = lr.full_state_dict(replica.module)
    results["ema_replica"] = average_of(replica_ema, replica)
    full.save(out / "full.ckpt", {"model": replica, "optimizer": replica_optimizer, "ema": replica_ema, "step": STEPS})
    reloaded = full.setup_module(make_model(seed=9))
    reloaded_ema = make_ema(reloaded)
    state = {"model": reloaded, "ema": reloaded_ema, "step": 0}
    results["reloaded_remainder"] = full.load(out / "full.ckpt", state)
    results["reloaded"], results["reloaded_step"] = lr.full_state_dict(reloaded.module), state["step"]
    results["ema_reloaded"] = average_of(reloaded_ema, reloaded)
    renamed = full.setup_module(make_model(seed=11))
    renamed_optimizer = full.setup_optimizers(torch.optim.AdamW(renamed.parameters(), lr=LR))
    results["renamed_remainder"] = full.load(out / "full.ckpt", {"net": renamed, "optimizer": renamed_optimizer},
                                             strict=False)
    results["renamed_optimizer_steps"] = sorted({float(s["step"]) for s in renamed_optimizer.state.values()})
    # fabric.load_raw: a plain state-dict file; a filtered save (only the norms) loaded with strict=False
    if full.global_rank == 0:
        torch.save(results["replica"], out / "raw.pt")
    full.barrier()
    raw = full.setup_module(make_model(seed=13))
    full.load_raw(out / "raw.pt", raw)
    results["raw"] = lr.full_state_dict(raw.module)
    full.save(out / "norms", {"model": replica}, filter={"model": lambda name, value: "norm" in name})
    partial = full.setup_module(make_model(seed=15))
    results["partial_before"] = lr.full_state_dict(partial.module)
    full.load(out / "norms", {"model": partial}, strict=False)
    results["partial"] = lr.full_state_dict(partial.module)

    # bf16-mixed: the engine's mixed precision under Fabric's autocast, beside torch's FSDP2 with the same policy
    mixed = L.Fabric(accelerator="cpu", devices=2, strategy="ragged_fsdp", precision="bf16-mixed")
    mixed.launch()
    ragged = mixed.setup_module(make_model(seed=0))
    ragged_optimizer = mixed.setup_optimizers(torch.optim.AdamW(ragged.parameters(), lr=LR))
    train(mixed, ragged, ragged_optimizer, batches, range(SAVE_AT))
    results["bf16_dtypes"] = sorted(
        {f"{d.master_dtype}/{d.param_dtype}/{d.reduce_dtype}" for d in lr.get_state(ragged.module).dbuffers()}
    )
    results["bf16_ragged"] = lr.full_state_dict(ragged.module)
    results["bf16_fsdp2"], _ = train_fsdp2(batches, mixed.global_rank, mixed.world_size, torch.bfloat16, SAVE_AT)

    # 16-mixed: fp16 compute with a ShardedGradScaler in place of the plugin's GradScaler, clipped after unscaling,
    # beside FSDP2 with the same policy and scaler (on CPU Fabric turns precision="16-mixed" into bf16: a plugin)
    from lightning.fabric.plugins.precision import MixedPrecision

    half = L.Fabric(accelerator="cpu", devices=2, strategy="ragged_fsdp",
                    plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **FP16_SCALER))])
    half.launch()
    fp16 = half.setup_module(make_model(seed=0))
    fp16_optimizer = half.setup_optimizers(torch.optim.AdamW(fp16.parameters(), lr=LR))
    results["fp16_scaler"] = type(half.strategy.precision.scaler).__name__
    results["fp16_init_scale"] = FP16_SCALER["init_scale"]
    results["fp16_scales"] = train_fp16(half, fp16, fp16_optimizer, batches)
    results["fp16_ragged"] = lr.full_state_dict(fp16.module)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    results["fp16_fsdp2"], results["fp16_scales_fsdp2"] = train_fsdp2(
        batches, half.global_rank, half.world_size, torch.float16, STEPS, ShardedGradScaler("cpu", **FP16_SCALER))

    # a checkpoint fabric.save wrote under DDP (the user's keys, torch's optimizer state) resumes here
    ddp = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    ddp.launch()
    plain = make_model(seed=0)
    plain, plain_optimizer = ddp.setup(plain, torch.optim.AdamW(plain.parameters(), lr=LR))
    train(ddp, plain, plain_optimizer, batches, range(SAVE_AT))
    ddp.save(out / "ddp.ckpt", {"model": plain, "optimizer": plain_optimizer, "step": SAVE_AT})
    from_ddp = fabric.setup_module(make_model(seed=5))
    from_ddp_optimizer = fabric.setup_optimizers(torch.optim.AdamW(from_ddp.parameters(), lr=LR))
    state = {"model": from_ddp, "optimizer": from_ddp_optimizer, "step": 0}
    results["from_ddp_remainder"] = fabric.load(out / "ddp.ckpt", state)
    results["from_ddp_step"] = state["step"]
    train(fabric, from_ddp, from_ddp_optimizer, batches, range(SAVE_AT, STEPS))
    results["from_ddp"] = lr.full_state_dict(from_ddp.module)

    # an asynchronous save as the script's last act: Fabric has no teardown, the process just ends. The
    # interpreter joins the save's thread first, then runs atexit: there the process leaves without the
    # teardown in which gloo sometimes aborts (tests/clean_exit.py), as every script of the tests does
    atexit.register(exit_without_teardown)
    last = L.Fabric(accelerator="cpu", devices=2, strategy=RaggedFSDPFabricStrategy(async_checkpoint=True))
    last.launch()
    final = last.setup_module(make_model(seed=11))
    results["async_saved"] = lr.full_state_dict(final.module)
    if fabric.global_rank == 0:
        torch.save(results, out / "results.pt")
    last.save(out / "async", {"model": final, "step": STEPS})


FP16_SCALER = dict(init_scale=2.0**19, growth_interval=1)  # overflows first, then grows back after each good step


def train_fp16(fabric: L.Fabric, model, optimizer, batches: torch.Tensor) -> list[float]:
    """Every step's loss scale after it (accumulated micro-batches, clipping after the unscale)."""
    per_rank = BATCH // fabric.world_size
    rank, scales = fabric.global_rank, []
    for step in range(STEPS):
        for micro in range(MICRO):
            with fabric.no_backward_sync(model, enabled=micro < MICRO - 1):
                fabric.backward(lm_loss(model, batches[step, micro, rank * per_rank : (rank + 1) * per_rank]) / MICRO)
        fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
        scales.append(fabric.strategy.precision.scaler.get_scale())
    return scales


def train_fsdp2(batches: torch.Tensor, rank: int, world: int, dtype: torch.dtype, steps: int,
                scaler=None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """``steps`` steps with torch's FSDP2 (each block, then the root), autocast in ``dtype`` and (fp16) its
    ``ShardedGradScaler``, as its users write them; (the full state, the loss scale after each step)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    model = make_model(seed=0)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    per_rank, scales = BATCH // world, []
    for step in range(steps):
        for micro in range(MICRO):
            model.set_requires_gradient_sync(micro == MICRO - 1)
            with torch.autocast("cpu", dtype=dtype):
                loss = lm_loss(model, batches[step, micro, rank * per_rank : (rank + 1) * per_rank]) / MICRO
            (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        optimizer.zero_grad()
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}, scales


if __name__ == "__main__":
    main(Path(sys.argv[1]))
