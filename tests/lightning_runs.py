"""Real Trainer runs for ``tests/test_strategy.py``: ``python tests/lightning_runs.py MODE OUT.json``.

Lightning's subprocess launcher re-runs this script for every extra rank, so one
invocation runs many Trainers in the same processes (one process start-up for all the
checks of a mode). Every rank computes its own numbers; the worst value over ranks is
all-reduced and rank 0 writes the JSON the test reads.

Modes: ``main`` (2 processes, Lightning's launcher; it also runs the fits of ``start_runs.py``
for ``tests/test_start.py``, ``hf_runs.py`` for ``tests/test_hf_models.py`` and ``muon_run.py``
for ``tests/test_optim_lightning.py``, under ``"start"``, ``"hf"`` and ``"muon"``) and ``slurm_hsdp`` (started by the test as 4 processes with the SLURM
variables of a 2-node x 2-task job).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.clean_exit import exit_without_teardown  # noqa: E402

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

import lightning_ragged  # noqa: E402,F401  (registers "ragged_fsdp")
from lightning_ragged import RaggedFSDPStrategy, get_state  # noqa: E402
from tests.comparisons import full_params, loss_diff, max_diff, worst  # noqa: E402
from tests.lightning_models import (  # noqa: E402
    LitGradNorm, LitListGPT, LitManualGPT, LitRegression, LitTinyGPT, cpu_trainer, regression_loader, token_loader,
)

warnings.filterwarnings("ignore")
BATCH = 4  # per rank


def make_trainer(strategy, devices: int, steps: int, **kwargs) -> L.Trainer:
    return cpu_trainer(strategy, devices, steps, enable_checkpointing=False, **kwargs)


def fit(strategy, devices: int = 2, steps: int = 6, seed: int = 0, accumulate: int = 1, meta: bool = False,
        lr: float = 0.5, module: type[LitTinyGPT] = LitTinyGPT, **kwargs) -> tuple[L.Trainer, LitTinyGPT]:
    L.seed_everything(seed, verbose=False)
    trainer = make_trainer(strategy, devices, steps, accumulate_grad_batches=accumulate, **kwargs)
    if meta:
        with trainer.init_module(empty_init=True):
            model = module(lr=lr)
    else:
        model = module(lr=lr)
    trainer.fit(model, token_loader(steps * accumulate * devices * BATCH, BATCH))
    return trainer, model


class CountReductions(Callback):
    """Engine reductions issued by each backward (one entry per micro-batch)."""

    def __init__(self) -> None:
        self.per_backward: list[int] = []
        self._last = 0

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        reduces = get_state(pl_module).stats.reduces
        self.per_backward.append(reduces - self._last)
        self._last = reduces


def parity(results: dict, name: str, ragged_strategy, devices: int = 2, ragged_callbacks=(), ddp_strategy="ddp",
           **kwargs) -> tuple[L.Trainer, LitTinyGPT]:
    """Fit DDP and the ragged strategy on the same seed and data; record loss and parameter diffs."""
    _, ddp = fit(ddp_strategy, devices=devices, **kwargs)
    trainer, ragged = fit(ragged_strategy, devices=devices, callbacks=list(ragged_callbacks), **kwargs)
    results[f"{name}_loss_diff"] = worst(loss_diff(ddp, ragged))
    results[f"{name}_param_diff"] = worst(max_diff(full_params(ddp), full_params(ragged)))
    results[f"{name}_steps"] = len(ragged.losses)
    return trainer, ragged


def with_batchnorm(model: LitTinyGPT) -> LitTinyGPT:
    """A BatchNorm layer the forward does not use: what ``sync_batchnorm=True`` would convert."""
    model.probe_norm = torch.nn.BatchNorm1d(4)
    return model


def main_mode(results: dict) -> None:
    # fp32 parity, names, and the strategy's collectives (full checkpoints: one ordinary file).
    trainer, ragged = parity(results, "fp32", RaggedFSDPStrategy(state_dict_type="full"))
    strategy = trainer.strategy
    results["strategy_class"] = type(strategy).__name__
    results["precision_class"] = type(trainer.precision_plugin).__name__
    results["names_unchanged"] = [n for n, _ in ragged.named_parameters()] == [
        n for n, _ in LitTinyGPT().named_parameters()
    ]
    results["all_sharded"] = all(hasattr(p, "ragged_shard") and p.dim() == 1 for p in ragged.parameters())
    rank = strategy.global_rank
    strategy.barrier()
    results["broadcast_ok"] = worst(strategy.broadcast(f"from{rank}") != "from0") == 0
    total = strategy.reduce(torch.tensor(float(rank)), reduce_op="sum")
    results["reduce_ok"] = total.item() == 1.0
    gathered = strategy.all_gather(torch.tensor([rank]))
    results["all_gather_ok"] = gathered.flatten().tolist() == [0, 1]

    # The same trainer and sharded module: validate / test / predict re-enter setup.
    loader = token_loader(4 * BATCH, BATCH, seed=5)
    before = len(ragged.val_losses)
    val = trainer.validate(ragged, loader, verbose=False)
    results["validate_ok"] = len(ragged.val_losses) > before and "val_loss" in val[0]
    test = trainer.test(ragged, loader, verbose=False)
    results["test_ok"] = "test_loss" in test[0]
    predictions = trainer.predict(ragged, loader)
    results["predict_ok"] = bool(predictions) and tuple(predictions[0].shape) == (BATCH, 8)

    # Refused before any step, with the reason (tests/test_strategy.py checks the messages): the sharded module in a
    # run with another precision; Lightning's SWA and pruning callbacks; sync_batchnorm on CPU with a BatchNorm.
    from lightning.pytorch.callbacks import ModelPruning, StochasticWeightAveraging

    refusals = {
        "reuse_precision": lambda: make_trainer(RaggedFSDPStrategy(state_dict_type="full"), 2, 1,
                                                precision="bf16-true").validate(ragged, loader, verbose=False),
        "swa": lambda: make_trainer("ragged_fsdp", 2, 2, callbacks=[StochasticWeightAveraging(swa_lrs=0.01)]).fit(
            LitTinyGPT(), token_loader(4 * BATCH, BATCH)),
        "pruning": lambda: make_trainer("ragged_fsdp", 2, 2, callbacks=[ModelPruning("l1_unstructured", amount=0.5)]).fit(
            LitTinyGPT(), token_loader(4 * BATCH, BATCH)),
        "sync_batchnorm": lambda: make_trainer("ragged_fsdp", 2, 2, sync_batchnorm=True).fit(
            with_batchnorm(LitTinyGPT()), token_loader(4 * BATCH, BATCH)),
    }

    def swapped_head() -> None:  # a new head between two runs: unsharded, its gradients would never be averaged
        head = ragged.model.head
        ragged.model.head = torch.nn.Linear(head.in_features, head.out_features, bias=False)
        try:
            make_trainer("ragged_fsdp", 2, 2).fit(ragged, token_loader(4 * BATCH, BATCH))
        finally:
            ragged.model.head = head

    refusals["reuse_swapped_head"] = swapped_head
    for name, run in refusals.items():
        try:
            run()
            results[f"refused_{name}"] = None
        except ValueError as error:
            results[f"refused_{name}"] = str(error)
    results["reuse_after_refusal_same_settings"] = "val_loss" in trainer.validate(ragged, loader, verbose=False)[0]

    # state_dict_type="full": a usable, ordinary checkpoint; resuming from it loads the shards.
    # (Sharded DCP checkpoints, the default, are tested by tests/test_checkpoint.py.)
    ckpt_dir = strategy.broadcast(tempfile.mkdtemp(prefix="ragged_ckpt_") if rank == 0 else None)
    path = os.path.join(ckpt_dir, "last.ckpt")
    trainer.save_checkpoint(path)
    strategy.barrier()
    checkpoint = torch.load(path, weights_only=False)
    plain = LitTinyGPT()
    plain.load_state_dict(checkpoint["state_dict"])
    results["checkpoint_diff"] = worst(max_diff(plain.state_dict(), full_params(ragged)))
    resume_trainer = make_trainer(RaggedFSDPStrategy(state_dict_type="full"), 2, 8)
    resumed = LitTinyGPT()
    loader_resume = token_loader(8 * 2 * BATCH, BATCH)
    # rank 1 did not see the checkpoint (an NFS cache, newest_checkpoint() -> None): it loads rank 0's too
    resume_trainer.fit(resumed, loader_resume, ckpt_path=path if rank == 0 else None)
    results["resume_steps"] = len(resumed.losses)
    results["resume_global_step"] = resume_trainer.global_step
    results["resume_steps_per_rank"] = resume_trainer.strategy.all_gather(
        torch.tensor([len(resumed.losses), resume_trainer.global_step])).tolist()
    resume_trainer.strategy.barrier()
    if rank == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)

    # Clipping by norm (small threshold: every step clips) and by value.
    _, clipped = parity(results, "clip_norm", "ragged_fsdp", gradient_clip_val=0.05)
    results["clip_changes_params"] = worst(max_diff(full_params(clipped), full_params(ragged)))
    parity(results, "clip_value", "ragged_fsdp", gradient_clip_val=0.002, gradient_clip_algorithm="value")

    # Lightning's grad_norm utility, logged every step: each parameter's whole gradient's norm, as under DDP.
    _, ddp_norms = fit("ddp", steps=3, module=LitGradNorm)
    _, ragged_norms = fit("ragged_fsdp", steps=3, module=LitGradNorm)
    results["grad_norm_keys"] = [sorted(a) == sorted(b) for a, b in zip(ddp_norms.grad_norms, ragged_norms.grad_norms)]
    results["grad_norm_steps"] = len(ragged_norms.grad_norms)
    results["grad_norm_rel_diff"] = worst(max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-12) for a, b in zip(
        ddp_norms.grad_norms, ragged_norms.grad_norms) for k in a))

    # Manual optimization: two optimizers behind toggle_optimizer, manual_backward, clip_gradients, hand-stepped
    # schedulers (DDP needs find_unused_parameters: each backward leaves the other optimizer's parameters frozen).
    parity(results, "manual", "ragged_fsdp", steps=12, module=LitManualGPT,
           ddp_strategy="ddp_find_unused_parameters_true")

    # The user's configure_model shards the embedding, the blocks and a list ([norm, head]); the strategy adopts them.
    _, listed = parity(results, "lists", "ragged_fsdp", module=LitListGPT)
    results["lists_groups"] = sorted(g.name for g in get_state(listed).all_groups if g.dbuffers)

    # Accumulation: no reduction on the non-final micro-batch.
    counter = CountReductions()
    parity(results, "accum", "ragged_fsdp", accumulate=2, ragged_callbacks=[counter])
    results["accum_reduces_per_backward"] = counter.per_backward
    counter_sync = CountReductions()
    parity(results, "accum_sync", RaggedFSDPStrategy(sync_grads_each_micro_batch=True), accumulate=2,
           ragged_callbacks=[counter_sync])
    results["accum_sync_reduces_per_backward"] = counter_sync.per_backward

    # The auto-planner through the strategy: it picks blocks per group and the HSDP degree, the strategy
    # builds those process groups and fully_shard applies those groups.
    auto = RaggedFSDPStrategy(planning="auto", memory_budget_bytes=10**9, replicate_degree="auto")
    trainer_auto, auto_model = parity(results, "auto", auto)
    state = get_state(auto_model)
    results["auto_replicate_degree"] = trainer_auto.strategy.auto_replicate_degree
    results["auto_shard_world"] = next(iter(auto_model.parameters())).ragged_shard.world_size
    results["auto_plan_replicate_degree"] = state.auto_plan.replicate_degree
    results["auto_plan_block_groups"] = sum(len(g.members) for g in state.auto_plan.groups if g.kind != "root")
    results["auto_block_groups"] = len(state.groups)

    # Activation checkpointing (composable: names unchanged) and a non-default granularity.
    parity(results, "ac", RaggedFSDPStrategy(activation_checkpointing=["Block"], shard_granularity="element"))

    # bf16-mixed and bf16-true train with a falling loss.
    _, mixed = fit("ragged_fsdp", steps=16, precision="bf16-mixed")
    results["bf16_mixed_losses"] = mixed.losses
    state = get_state(mixed)
    results["bf16_mixed_dtypes"] = sorted({
        f"{dbuffer.master_dtype}/{dbuffer.param_dtype}/{dbuffer.reduce_dtype}" for dbuffer in state.dbuffers()
    })
    # bf16-mixed leaves the batch as DDP's autocast does: float targets reach training_step in fp32.
    for name in ("ddp", "ragged_fsdp"):
        L.seed_everything(0, verbose=False)
        regression = LitRegression()
        make_trainer(name, 2, 3, precision="bf16-mixed").fit(regression, regression_loader(6 * 2 * BATCH, BATCH))
        results[f"bf16_mixed_batch_dtypes_{name}"] = sorted(set(regression.batch_dtypes))
        results[f"bf16_mixed_regression_losses_{name}"] = regression.losses
        with torch.no_grad():  # outside Lightning's autocast (a callback, after fit): the owners of the weights cast
            results[f"bf16_mixed_plain_forward_{name}"] = str(regression.model(torch.randn(2, 4)).dtype)
    fp16_mode(results)
    _, half = fit("ragged_fsdp", steps=16, precision="bf16-true")
    results["bf16_true_losses"] = half.losses
    results["bf16_true_dtypes"] = sorted({str(p.dtype) for p in half.parameters()})

    # Meta-device init (Trainer.init_module(empty_init=True)) equals an eager init with the same seed.
    L.seed_everything(3, verbose=False)
    eager = {k: v.clone() for k, v in LitTinyGPT().state_dict().items()}
    L.seed_everything(3, verbose=False)
    meta_trainer = make_trainer("ragged_fsdp", 2, 1)
    with meta_trainer.init_module(empty_init=True):
        meta_model = LitTinyGPT()
    results["meta_built_on_meta"] = all(p.is_meta for p in meta_model.parameters())
    meta_trainer.validate(meta_model, token_loader(2 * BATCH, BATCH), verbose=False)
    results["meta_init_diff"] = worst(max_diff(eager, full_params(meta_model)))
    # ... and trains exactly like the eager-initialized sharded model.
    _, eager_fit = fit("ragged_fsdp", seed=3)
    _, meta_fit = fit("ragged_fsdp", seed=3, meta=True)
    results["meta_fit_param_diff"] = worst(max_diff(full_params(eager_fit), full_params(meta_fit)))

    # Every rank raises in the same step: OnExceptionCheckpoint writes a complete checkpoint of the weights the
    # exception found (the one-rank case, where nothing may be written, is tests/test_exception_agreement.py).
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    from lightning_ragged.checkpoint import consolidate

    exception_dir = strategy.broadcast(tempfile.mkdtemp(prefix="ragged_exc_") if rank == 0 else None)
    L.seed_everything(0, verbose=False)
    failing = FailsEverywhere()
    try:
        cpu_trainer("ragged_fsdp", 2, 4, callbacks=[OnExceptionCheckpoint(exception_dir)]).fit(
            failing, token_loader(4 * 2 * BATCH, BATCH))
        results["exception_raised"] = False
    except RuntimeError as error:
        results["exception_raised"] = "failing on every rank" in str(error)
    weights = full_params(failing)
    dist.barrier()
    if rank == 0:
        consolidated = os.path.join(exception_dir, "consolidated.ckpt")
        consolidate(os.path.join(exception_dir, "on_exception.ckpt"), consolidated)
        saved = torch.load(consolidated, weights_only=False)
        results["exception_ckpt_step"] = saved["global_step"]
        results["exception_ckpt_diff"] = max_diff(saved["state_dict"], weights)
        shutil.rmtree(exception_dir, ignore_errors=True)
    dist.barrier()


FP16_STEPS = 10
FP16_SCALER = dict(init_scale=2.0**22, growth_interval=2)  # overflows in the first steps, grows back every 2 good ones


class RecordsBatches(LitTinyGPT):
    """Records each training batch and, after each step, the loss scale (for the FSDP2 replay)."""

    def __init__(self) -> None:
        super().__init__(lr=0.05)
        self.batches: list[torch.Tensor] = []
        self.scales: list[float] = []

    def training_step(self, batch, batch_idx):
        self.batches.append(batch[0].clone())
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.scales.append(self.trainer.precision_plugin.scaler.get_scale())


def fp16_mode(results: dict) -> None:
    """``"16-mixed"`` (fp16 compute, fp32 reduction and master shards, a ShardedGradScaler) against torch's FSDP2
    replaying the same batches with the same policy, autocast and scaler. On CPU Lightning turns
    ``precision="16-mixed"`` into bf16, so the plugin is given explicitly, as a GPU run would build it."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    L.seed_everything(0, verbose=False)
    ragged = RecordsBatches()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **FP16_SCALER))
    trainer = make_trainer("ragged_fsdp", 2, FP16_STEPS, plugins=[plugin])
    trainer.fit(ragged, token_loader(FP16_STEPS * 2 * BATCH, BATCH))
    results["fp16_scaler"] = type(trainer.precision_plugin.scaler).__name__
    results["fp16_dtypes"] = sorted({
        f"{d.master_dtype}/{d.param_dtype}/{d.reduce_dtype}" for d in get_state(ragged).dbuffers()
    })
    L.seed_everything(0, verbose=False)
    reference = RecordsBatches()
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for block in reference.model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(reference, mp_policy=policy)
    optimizer = reference.configure_optimizers()
    scaler = ShardedGradScaler("cpu", **FP16_SCALER)
    for tokens in ragged.batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = reference._loss((tokens,))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        reference.losses.append(loss.item())
        reference.scales.append(scaler.get_scale())
    results["fp16_scales"] = ragged.scales
    results["fp16_scales_fsdp2"] = reference.scales
    results["fp16_loss_diff"] = worst(loss_diff(ragged, reference))
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in reference.state_dict().items()}
    results["fp16_param_diff"] = worst(max_diff(full_params(ragged), full))
    results["fp16_moved"] = worst(max_diff(full_params(ragged), {k: v for k, v in _initial_weights().items()}))


def _initial_weights() -> dict[str, torch.Tensor]:
    L.seed_everything(0, verbose=False)
    return {k: v.clone() for k, v in RecordsBatches().state_dict().items()}


class FailsEverywhere(LitTinyGPT):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2:
            raise RuntimeError("failing on every rank at step 2")
        return super().training_step(batch, batch_idx)


def slurm_hsdp_mode(results: dict) -> None:
    """Started by the test as a simulated SLURM job: 2 nodes x 2 tasks on this machine.

    HSDP 2x2 against DDP: ``replicate_degree="node"`` shards inside each node and
    replicates across the two; ``replicate_degree=2`` (the same groups) with clipping.
    """
    trainer, ragged = parity(results, "hsdp", RaggedFSDPStrategy(replicate_degree="node"), devices=2, num_nodes=2)
    results["cluster_environment"] = type(trainer.strategy.cluster_environment).__name__
    results["world_size"] = trainer.world_size
    results["hsdp_losses"] = ragged.losses
    shard = next(iter(ragged.parameters())).ragged_shard
    results["hsdp_shard_world"] = shard.world_size
    trainer, clipped = parity(results, "hsdp_clip", RaggedFSDPStrategy(replicate_degree=2), devices=2, num_nodes=2,
                              gradient_clip_val=0.05)
    # After fit (and its teardown) the HSDP groups still serve the module until the next run: a sharded
    # checkpoint saves, and a new run resumes from it with the same weights (max_steps reached: no new step).
    rank = trainer.strategy.global_rank
    ckpt_dir = trainer.strategy.broadcast(tempfile.mkdtemp(prefix="ragged_hsdp_") if rank == 0 else None)
    path = os.path.join(ckpt_dir, "after_fit.ckpt")
    trainer.save_checkpoint(path)
    trained = full_params(clipped)
    resumed = LitTinyGPT()
    make_trainer(RaggedFSDPStrategy(replicate_degree=2), 2, trainer.global_step, num_nodes=2).fit(
        resumed, token_loader(4 * 2 * BATCH, BATCH), ckpt_path=path)
    results["hsdp_save_after_fit_resume_diff"] = worst(max_diff(trained, full_params(resumed)))
    # A module with buffers fitted again by a new run: its buffer broadcasts (broadcast_buffers=True, from the
    # second training forward on) go over the new run's HSDP groups (the old ones are destroyed at its setup).
    reused = {}
    strategies = {"ragged": lambda: RaggedFSDPStrategy(replicate_degree=2), "ddp": lambda: "ddp_find_unused_parameters_true"}
    for name, strategy in strategies.items():
        L.seed_everything(0, verbose=False)
        reused[name] = with_batchnorm(LitTinyGPT())
        for _ in range(2):
            make_trainer(strategy(), 2, 3, num_nodes=2).fit(reused[name], token_loader(3 * 2 * BATCH, BATCH))
    # gloo still runs a destroyed group's collectives (NCCL does not), so the groups themselves are checked
    state = get_state(reused["ragged"])
    dbuffer = next(iter(state.dbuffers()))
    stale = state.buffer_sync.groups != [dbuffer.process_group, dbuffer.replicate_group]
    results["hsdp_refit_buffer_groups_stale"] = worst(float(stale))
    results["hsdp_refit_param_diff"] = worst(max_diff(full_params(reused["ragged"]), full_params(reused["ddp"])))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    results: dict = {}
    {"main": main_mode, "slurm_hsdp": slurm_hsdp_mode}[mode](results)
    if mode == "main":  # the Trainer fits of other files, in the same start-up (each costs ~7 s of CPU here)
        from tests import averaging_runs, hf_runs, muon_run, start_runs

        results["averaging"] = {}
        averaging_runs.run(results["averaging"])
        results["start"] = {}
        start_runs.run(results["start"])
        results["hf"] = {}
        for kind in hf_runs.KINDS:
            hf_runs.run_kind(results["hf"], kind)
        results["muon"] = muon_run.fit()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.barrier()
    exit_without_teardown()  # the results are written (tests/clean_exit.py)


if __name__ == "__main__":
    main()
