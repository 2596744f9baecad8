"""The Lightning strategy: real Trainer runs on CPU/gloo against ``strategy="ddp"``.

Trainer runs live in ``tests/lightning_runs.py`` (Lightning's launcher re-runs a script per
rank); each mode is started once per session by a module-scoped fixture and its checks
are split into the tests below.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "tests" / "lightning_runs.py"
RUN_TIMEOUT_S = 480
FP32_TOL = 1e-5
_LAUNCH_VARS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "PL_GLOBAL_SEED", "TORCHELASTIC_RUN_ID")


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _run_mode(mode: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp(mode) / "results.json"
    proc = subprocess.run(
        [sys.executable, str(RUNS), mode, str(out)], env=_clean_env(), cwd=ROOT, capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode == 0 and out.exists(), f"{mode} run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out.read_text())


# ------------------------------------------------------------ in-process (no processes)
def test_registered_name_builds_the_strategy_and_ragged_precision() -> None:
    import lightning.pytorch as L

    import lightning_ragged
    from lightning_ragged.lightning.precision import RaggedHalfPrecision, RaggedMixedPrecision, RaggedPrecision

    from lightning.pytorch.strategies import StrategyRegistry

    assert "ragged_fsdp" in StrategyRegistry
    expected = {"32-true": RaggedPrecision, "bf16-mixed": RaggedMixedPrecision, "bf16-true": RaggedHalfPrecision}
    for precision, plugin_class in expected.items():
        trainer = L.Trainer(strategy="ragged_fsdp", accelerator="cpu", devices=2, precision=precision, logger=False)
        assert isinstance(trainer.strategy, lightning_ragged.RaggedFSDPStrategy)
        assert type(trainer.precision_plugin) is plugin_class
    policy = RaggedMixedPrecision("bf16-mixed", "cpu").mp_policy()
    import torch

    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_fp16_amp_gets_a_sharded_grad_scaler_with_the_plugins_settings() -> None:
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from lightning_ragged.lightning.precision import RaggedMixedPrecision, to_ragged_precision

    given = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    plugin = to_ragged_precision(MixedPrecision("16-mixed", "cpu", scaler=given))
    assert type(plugin) is RaggedMixedPrecision and isinstance(plugin.scaler, ShardedGradScaler)
    scaler = plugin.scaler
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (1024.0, 4.0, 0.25, 7)
    policy = plugin.mp_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float16, torch.float32)


def test_fp16_amp_matches_fsdp2_with_the_same_policy_and_scaler(main_run: dict) -> None:
    """Overflowing steps are skipped on every rank alike and the scale grows back, step for step as FSDP2's."""
    assert main_run["fp16_scaler"] == "ShardedGradScaler"
    assert main_run["fp16_dtypes"] == ["torch.float32/torch.float16/torch.float32"]
    scales = main_run["fp16_scales"]
    assert scales == main_run["fp16_scales_fsdp2"], (scales, main_run["fp16_scales_fsdp2"])
    changes = [b / a for a, b in zip([2.0**22, *scales], scales)]
    assert 0.5 in changes and 2.0 in changes, scales  # steps skipped (scale halved) and taken (grown)
    # the same fp16 casts of the same values; only the reductions' order may differ (fp32 sums)
    assert main_run["fp16_loss_diff"] <= 1e-3 and main_run["fp16_param_diff"] <= 1e-3, main_run
    assert main_run["fp16_moved"] > 1e-2, main_run  # the steps that were not skipped trained


def test_checkpoint_plugins_are_adopted_or_refused_never_ignored() -> None:
    """``AsyncCheckpointIO`` means background saves (the engine's own); torch's default IO changes nothing; another
    plugin (which would write one torch.save file) is refused when the Trainer or Fabric is built."""
    import lightning as LL
    import lightning.pytorch as L
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from lightning_ragged import RaggedFSDPStrategy

    class CustomIO(TorchCheckpointIO):
        pass

    kwargs = dict(accelerator="cpu", devices=2)
    assert L.Trainer(strategy="ragged_fsdp", plugins=[AsyncCheckpointIO()], logger=False,
                     **kwargs).strategy.ragged_checkpoints.async_save
    assert not L.Trainer(strategy="ragged_fsdp", plugins=[TorchCheckpointIO()], logger=False,
                         **kwargs).strategy.ragged_checkpoints.async_save
    assert LL.Fabric(strategy="ragged_fsdp", plugins=[AsyncCheckpointIO()], **kwargs).strategy.checkpoints.async_save
    for io in (CustomIO(), AsyncCheckpointIO(CustomIO())):
        with pytest.raises(ValueError, match="does not take the CustomIO checkpoint plugin.*async_checkpoint=True"):
            L.Trainer(strategy="ragged_fsdp", plugins=[io], logger=False, **kwargs)
    with pytest.raises(ValueError, match="RaggedFSDPStrategy does not take the CustomIO"):
        RaggedFSDPStrategy(checkpoint_io=CustomIO())
    with pytest.raises(ValueError, match="RaggedFSDPFabricStrategy does not take the CustomIO"):
        LL.Fabric(strategy="ragged_fsdp", plugins=[CustomIO()], **kwargs)


def test_strategy_knobs_are_validated() -> None:
    from lightning_ragged import RaggedFSDPStrategy

    with pytest.raises(ValueError, match="state_dict_type"):
        RaggedFSDPStrategy(state_dict_type="local")
    with pytest.raises(ValueError, match="replicate_degree"):
        RaggedFSDPStrategy(replicate_degree=0)


@pytest.mark.parametrize(
    ("variables", "trainer_kwargs", "message"),
    [
        ({"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2"}, {"devices": 3, "num_nodes": 2},
         r"RaggedFSDPStrategy.*ntasks-per-node=2.*devices=2"),
        ({"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2"}, {"devices": 2, "num_nodes": 1},
         r"RaggedFSDPStrategy.*--nodes=2.*num_nodes=2"),
    ],
)
def test_mismatched_slurm_allocation_fails_clearly(monkeypatch, variables, trainer_kwargs, message) -> None:
    import lightning.pytorch as L

    import lightning_ragged  # noqa: F401

    for key in _LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    base = {"SLURM_JOB_NAME": "ragged", "SLURM_JOB_ID": "1234", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1"}
    for key, value in {**base, **variables}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        L.Trainer(strategy="ragged_fsdp", accelerator="cpu", logger=False, **trainer_kwargs)


# ----------------------------------------------------- plain fully_shard users (pool)
def _clip_against_torch(max_norm: float, norm_type: float) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from lightning_ragged import clip_grad_norm_, fully_shard
    from tests.models import lm_loss, make_batches, make_model, shard_grad_diff

    rank, world = dist.get_rank(), dist.get_world_size()
    reference, sharded = make_model(0), fully_shard(make_model(0))
    tokens = make_batches(1, 2 * world)[0]
    lm_loss(reference, tokens).backward()
    lm_loss(sharded, tokens[2 * rank : 2 * rank + 2]).backward()
    unclipped = clip_grad_norm_(list(sharded.parameters()), 1e9, norm_type)  # the per-parameter path, no clipping
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
    total = clip_grad_norm_(sharded, max_norm, norm_type)
    grad_diff = shard_grad_diff(sharded, reference)
    return {
        "norm_diff": abs(total.item() - expected.item()),
        "params_path_norm_diff": abs(unclipped.item() - expected.item()),
        "grad_diff": grad_diff,
        "clipped": float(expected.item() > max_norm),
    }


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_is_the_global_norm(dist_pool, norm_type: float) -> None:
    for result in dist_pool(2).run(_clip_against_torch, 0.05, norm_type):
        assert result["clipped"] == 1.0
        assert result["norm_diff"] <= 1e-5 and result["params_path_norm_diff"] <= 1e-5, result
        assert result["grad_diff"] <= 1e-6, result


def _clip_one_optimizer_after_toggle() -> dict[str, float]:
    """Lightning's GAN pattern: both halves get gradients, ``toggle_optimizer(opt_d)`` freezes the generator (its
    gradients stay), ``opt_d.zero_grad()``, a second backward, ``clip_gradients(opt_d)``: only the discriminator's
    gradients count and are scaled, as torch's clipping of ``opt_d``'s parameters in one process."""
    import torch
    import torch.distributed as dist

    from lightning_ragged import fully_shard
    from lightning_ragged.lightning.precision import RaggedPrecision
    from tests.models import lm_loss, make_batches, make_model, shard_grad_diff

    rank, world = dist.get_rank(), dist.get_world_size()
    reference, sharded = make_model(0), fully_shard(make_model(0))
    first, second = make_batches(2, 2 * world)
    plugin = RaggedPrecision()
    plugin.sharded_module = sharded
    for net, local in ((reference, slice(None)), (sharded, slice(2 * rank, 2 * rank + 2))):
        generator = [p for name, p in net.named_parameters() if not name.startswith("blocks.1.")]
        discriminator = list(net.blocks[1].parameters())
        opt_d = torch.optim.SGD(discriminator, lr=0.1)
        lm_loss(net, first[local]).backward()
        for param in generator:
            param.requires_grad_(False)
        opt_d.zero_grad()
        lm_loss(net, second[local]).backward()
        if net is sharded:
            plugin.clip_grad_by_norm(opt_d, 0.05)
        else:
            expected = torch.nn.utils.clip_grad_norm_(discriminator, 0.05)
    return {"grad_diff": shard_grad_diff(sharded, reference), "clipped": float(expected.item() > 0.05)}


def test_clipping_one_optimizer_leaves_the_others_gradients(dist_pool) -> None:
    for result in dist_pool(2).run(_clip_one_optimizer_after_toggle):
        assert result["clipped"] == 1.0
        assert result["grad_diff"] <= 1e-6, result


def _meta_init_against_eager() -> dict[str, float]:
    import torch
    from torch import nn

    from lightning_ragged import full_state_dict, fully_shard
    from lightning_ragged.engine.meta_init import materialize_meta_module

    def build() -> nn.Module:
        model = nn.Module()
        model.embed = nn.Embedding(37, 13)
        model.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(13), nn.Linear(13, 7), nn.Linear(7, 13))
                                     for _ in range(4))
        model.norm = nn.LayerNorm(13)
        model.head = nn.Linear(13, 37)
        return model

    torch.manual_seed(11)
    eager = build().state_dict()
    with torch.device("meta"):
        sharded = fully_shard(build(), device="cpu")
    report = materialize_meta_module(sharded, "cpu", seed=11)
    full = full_state_dict(sharded)
    state = sharded._ragged_fsdp_state
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in build().modules()) * 4
    return {
        "diff": max((full[k] - eager[k]).abs().max().item() for k in eager),
        "peak_open_groups": report.peak_open_groups,
        "peak_within_largest_module": float(report.peak_full_bytes <= largest),
        "groups": len(state.all_groups),
    }


def test_meta_init_is_group_by_group_and_equals_eager(dist_pool) -> None:
    for result in dist_pool(2).run(_meta_init_against_eager):
        assert result["diff"] == 0.0, result
        # 4 blocks, the embedding's group, the root (norm, head: all after the blocks): one module's tensors whole at
        # a time (a reset_parameters() call needs its module's)
        assert result["groups"] == 6 and result["peak_open_groups"] == 1, result
        assert result["peak_within_largest_module"] == 1.0, result


# --------------------------------------------------------- Trainer, 2 processes
def test_fp32_loss_and_params_match_ddp(main_run: dict) -> None:
    assert main_run["strategy_class"] == "RaggedFSDPStrategy"
    assert main_run["precision_class"] == "RaggedPrecision"
    assert main_run["fp32_steps"] >= 5
    assert main_run["fp32_loss_diff"] <= FP32_TOL and main_run["fp32_param_diff"] <= FP32_TOL, main_run


def test_optimizer_sees_sharded_params_with_original_names(main_run: dict) -> None:
    assert main_run["names_unchanged"] and main_run["all_sharded"]


def test_validate_test_predict_and_collectives(main_run: dict) -> None:
    for check in ("validate_ok", "test_ok", "predict_ok", "broadcast_ok", "reduce_ok", "all_gather_ok"):
        assert main_run[check], check


def test_runs_it_cannot_honour_are_refused_with_the_reason(main_run: dict) -> None:
    reuse = main_run["refused_reuse_precision"]
    assert reuse and "sharded by an earlier Trainer run" in reuse
    assert "precision was '32-true', now 'bf16-true'" in reuse, reuse
    swapped = main_run["refused_reuse_swapped_head"]  # the ranks' heads drifted apart silently before (sweep: 9.5e-2)
    assert swapped and "parameters set since are not sharded (model.head.weight)" in swapped, swapped
    assert main_run["reuse_after_refusal_same_settings"]  # the module still serves a run with its own settings
    swa = main_run["refused_swa"]  # WeightAveraging/EMAWeightAveraging work: tests/test_weight_averaging.py
    assert swa and "does not support the StochasticWeightAveraging callback" in swa and "EMAWeightAveraging" in swa
    pruning = main_run["refused_pruning"]
    assert pruning and "does not support the ModelPruning callback" in pruning and "configure_model" in pruning
    sync = main_run["refused_sync_batchnorm"]
    assert sync and "sync_batchnorm=True" in sync and "probe_norm" in sync and "not on CPU" in sync, sync


def test_settings_compare_by_value_not_identity() -> None:
    """A reused module is refused only for a real change: equal settings built twice (a lambda written in the same
    place, a new MixedPrecisionPolicy, Float8AllGather) describe alike; another value does not."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_ragged import Float8AllGather
    from lightning_ragged.lightning.run_checks import describe

    def fp8(tile: int) -> Float8AllGather:
        return Float8AllGather(tile=tile, module_filter=lambda fqn, module: fqn != "head")

    def policy(dtype: torch.dtype) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=dtype)

    assert describe(fp8(128)) == describe(fp8(128)) != describe(fp8(64))
    assert describe(policy(torch.bfloat16)) == describe(policy(torch.bfloat16)) != describe(policy(torch.float16))
    assert describe(["Block", 2]) == describe(("Block", 2)) != describe(["Block", 3])


def test_sync_batchnorm_converts_before_sharding_on_accelerators() -> None:
    """The conversion itself (Lightning's ``TorchSyncBatchNorm``, what ``sync_batchnorm=True`` sets), for a CUDA run:
    torch's conversion is device-independent, so it runs here; a model without BatchNorm passes through on CPU."""
    from lightning.pytorch.plugins import TorchSyncBatchNorm
    from torch import nn

    from lightning_ragged.lightning.run_checks import apply_sync_batchnorm

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Sequential(nn.BatchNorm2d(3)))
    converted = apply_sync_batchnorm(TorchSyncBatchNorm(), model, torch.device("cuda"))
    assert [type(m).__name__ for m in converted.modules() if "BatchNorm" in type(m).__name__] == ["SyncBatchNorm"] * 2
    plain = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert apply_sync_batchnorm(TorchSyncBatchNorm(), plain, torch.device("cpu")) is plain
    assert apply_sync_batchnorm(None, model, torch.device("cpu")) is model
    with pytest.raises(ValueError, match="runs on accelerators only"):
        apply_sync_batchnorm(TorchSyncBatchNorm(), nn.Sequential(nn.BatchNorm1d(4)), torch.device("cpu"))


def test_checkpoint_is_full_and_resumes(main_run: dict) -> None:
    assert main_run["checkpoint_diff"] == 0.0
    assert main_run["resume_steps"] == 2 and main_run["resume_global_step"] == 8
    assert main_run["resume_steps_per_rank"] == [[2, 8], [2, 8]]  # rank 1 got ckpt_path=None (before: a hang)


def test_gradient_clipping_matches_ddp(main_run: dict) -> None:
    for name in ("clip_norm", "clip_value"):
        assert main_run[f"{name}_steps"] >= 5
        assert main_run[f"{name}_loss_diff"] <= FP32_TOL and main_run[f"{name}_param_diff"] <= FP32_TOL, name
    assert main_run["clip_changes_params"] > 1e-3  # the threshold really clipped


def test_lightning_grad_norm_logs_whole_gradients_as_ddp(main_run: dict) -> None:
    """Lightning's ``grad_norm`` (imported by name before any strategy existed): every parameter's norm and the
    total, 2-norm and inf-norm, equal to DDP's to fp32 rounding (this rank's part of a shard would be smaller)."""
    assert main_run["grad_norm_steps"] == 3 and all(main_run["grad_norm_keys"]), main_run["grad_norm_keys"]
    assert main_run["grad_norm_rel_diff"] <= 1e-5, main_run["grad_norm_rel_diff"]


def test_manual_optimization_with_two_optimizers_matches_ddp(main_run: dict) -> None:
    assert main_run["manual_steps"] >= 6  # batches: max_steps counts both optimizers' steps
    assert main_run["manual_loss_diff"] <= FP32_TOL and main_run["manual_param_diff"] <= FP32_TOL, main_run


def test_modules_sharded_in_configure_model_with_a_list_match_ddp(main_run: dict) -> None:
    assert main_run["lists_steps"] >= 5
    assert main_run["lists_loss_diff"] <= FP32_TOL and main_run["lists_param_diff"] <= FP32_TOL, main_run
    assert main_run["lists_groups"] == ["model.blocks.0", "model.blocks.1", "model.norm+model.head", "model.tok", "root"]


def test_accumulation_reduces_only_on_the_last_micro_batch(main_run: dict) -> None:
    per_backward = main_run["accum_reduces_per_backward"]
    assert len(per_backward) == 12
    assert per_backward[0::2] == [0] * 6 and all(n > 0 for n in per_backward[1::2]), per_backward
    assert main_run["accum_loss_diff"] <= FP32_TOL and main_run["accum_param_diff"] <= FP32_TOL
    # sync_grads_each_micro_batch=True: a reduction after every micro-batch, same result.
    assert all(n > 0 for n in main_run["accum_sync_reduces_per_backward"])
    assert main_run["accum_sync_loss_diff"] <= FP32_TOL and main_run["accum_sync_param_diff"] <= FP32_TOL


def test_auto_planning_through_the_strategy_matches_ddp(main_run: dict) -> None:
    """replicate_degree='auto' + planning='auto': the HSDP degree the planner chose is the one the
    process groups have (shard world x replicas = 2), fully_shard applied the same plan, and training equals DDP."""
    degree = main_run["auto_replicate_degree"]
    assert degree in (1, 2) and main_run["auto_plan_replicate_degree"] == degree
    assert main_run["auto_shard_world"] * degree == 2
    assert main_run["auto_block_groups"] == main_run["auto_plan_block_groups"] >= 1
    assert main_run["auto_loss_diff"] <= FP32_TOL and main_run["auto_param_diff"] <= FP32_TOL


def test_activation_checkpointing_matches_ddp(main_run: dict) -> None:
    assert main_run["ac_loss_diff"] <= FP32_TOL and main_run["ac_param_diff"] <= FP32_TOL


def _falls(losses: list[float]) -> bool:
    return sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3


def test_bf16_mixed_and_bf16_true_train(main_run: dict) -> None:
    assert _falls(main_run["bf16_mixed_losses"]), main_run["bf16_mixed_losses"]
    # fp32 master shards, bf16 all-gather/compute, fp32 reduction.
    assert main_run["bf16_mixed_dtypes"] == ["torch.float32/torch.bfloat16/torch.float32"]
    assert _falls(main_run["bf16_true_losses"]), main_run["bf16_true_losses"]
    assert main_run["bf16_true_dtypes"] == ["torch.bfloat16"]
    # The batch is not cast (the root is the LightningModule): float targets arrive in fp32, as under DDP.
    assert main_run["bf16_mixed_batch_dtypes_ragged_fsdp"] == main_run["bf16_mixed_batch_dtypes_ddp"] == [
        ["torch.float32", "torch.float32"]
    ]
    assert main_run["bf16_mixed_plain_forward_ragged_fsdp"] == "torch.bfloat16"  # and it ran, with no autocast
    ddp_losses, ragged_losses = (main_run[f"bf16_mixed_regression_losses_{n}"] for n in ("ddp", "ragged_fsdp"))
    assert len(ddp_losses) == len(ragged_losses) == 3
    # bf16 compute differs from DDP's autocast by rounding only (FSDP2 casts the weights, autocast the matmuls)
    assert max(abs(a - b) for a, b in zip(ddp_losses, ragged_losses)) <= 0.02, (ddp_losses, ragged_losses)


def test_an_exception_on_every_rank_saves_a_complete_checkpoint(main_run: dict) -> None:
    """All ranks raise in step 3: OnExceptionCheckpoint's sharded save runs (the exception is re-raised after it)."""
    assert main_run["exception_raised"]
    assert main_run["exception_ckpt_step"] == 2
    assert main_run["exception_ckpt_diff"] == 0.0  # the weights as the exception left them, every rank's part


def test_meta_device_init_equals_eager_init(main_run: dict) -> None:
    assert main_run["meta_built_on_meta"]
    assert main_run["meta_init_diff"] == 0.0
    assert main_run["meta_fit_param_diff"] == 0.0


# ------------------------------------------- SLURM (simulated 2 nodes x 2 tasks), HSDP
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def slurm_hsdp_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """4 local processes with the SLURM variables `srun` sets for --nodes=2 --ntasks-per-node=2."""
    out = tmp_path_factory.mktemp("slurm") / "results.json"
    common = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "ragged",
              "SLURM_JOB_ID": "4242", "SLURM_NODELIST": "127.0.0.1", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(_free_port())}
    procs = [
        subprocess.Popen(
            [sys.executable, str(RUNS), "slurm_hsdp", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
            env=_clean_env(**common, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % 2), SLURM_NODEID=str(rank // 2)),
        )
        for rank in range(4)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=RUN_TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert all(proc.returncode == 0 for proc in procs), "\n".join(o[-4000:] for o in outputs)
    return json.loads(out.read_text())


def test_simulated_slurm_run_trains(slurm_hsdp_run: dict) -> None:
    assert slurm_hsdp_run["cluster_environment"] == "SLURMEnvironment" and slurm_hsdp_run["world_size"] == 4
    losses = slurm_hsdp_run["hsdp_losses"]
    assert len(losses) >= 5 and losses[-1] < losses[0], losses


def test_hsdp_2x2_matches_ddp(slurm_hsdp_run: dict) -> None:
    assert slurm_hsdp_run["hsdp_shard_world"] == 2  # sharded inside a node, replicated across the two
    for name in ("hsdp", "hsdp_clip"):
        assert slurm_hsdp_run[f"{name}_steps"] >= 5
        assert slurm_hsdp_run[f"{name}_loss_diff"] <= FP32_TOL, slurm_hsdp_run
        assert slurm_hsdp_run[f"{name}_param_diff"] <= FP32_TOL, slurm_hsdp_run
    assert slurm_hsdp_run["hsdp_save_after_fit_resume_diff"] == 0.0  # trainer.save_checkpoint after fit, with HSDP
    assert slurm_hsdp_run["hsdp_refit_param_diff"] <= FP32_TOL  # a second fit with the same module, as DDP
    assert slurm_hsdp_run["hsdp_refit_buffer_groups_stale"] == 0.0  # its buffers broadcast over the second run's groups


def test_lightning_cli_fits_from_the_example_yaml() -> None:
    proc = subprocess.run(
        [sys.executable, "examples/cli.py", "fit", "--config", "examples/config.yaml", "--trainer.max_steps=3",
         "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false"],
        env=_clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-8000:]
    assert "max_steps=3` reached" in output and "Starting with 2 processes" in output
