"""Lightning Fabric: ``Fabric(strategy="ragged_fsdp")`` against one-process training of the same model.

``tests/fabric_job.py`` is the user's script (Fabric's launcher starts its second rank); one run,
started once by a module-scoped fixture, holds every result. The oracle trains the same model on
the same global batches in this process with torch alone (``clip_grad_norm_``, AdamW).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.fabric_job import BATCH, EMA_DECAY, LR, MAX_NORM, MICRO, SAVE_AT, STEPS
from tests.models import lm_loss, make_batches, make_model
from tests.test_strategy import ROOT, _clean_env

FP32_TOL = 1e-5
"""fp32 training of a few steps where only the reduction order differs from one process (as the other suites)."""


@pytest.fixture(scope="module")
def fabric_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("fabric")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fabric_job.py"), str(out)], env=_clean_env(), cwd=ROOT,
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"fabric run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return torch.load(out / "results.pt", weights_only=True), out


@pytest.fixture(scope="module")
def oracle() -> tuple[dict[str, torch.Tensor], list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The same steps in one process: the whole global batch per micro-batch, torch's clipping, torch's
    ``AveragedModel`` EMA; (final state, clipping norms, state after SAVE_AT steps, the final average)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    batches = make_batches(STEPS * MICRO, BATCH).view(STEPS, MICRO, BATCH, -1)
    model = make_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(EMA_DECAY))
    norms = []
    for step in range(STEPS):
        for micro in range(MICRO):
            (lm_loss(model, batches[step, micro]) / MICRO).backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        ema.update_parameters(model)
        if step == SAVE_AT - 1:
            midway = {k: v.clone() for k, v in model.state_dict().items()}
    return model.state_dict(), norms, midway, ema.module.state_dict()


def _max_diff(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert set(state) == set(reference)
    return max((state[key] - reference[key]).abs().max().item() for key in reference)


def test_fabric_trains_like_one_process(fabric_run, oracle) -> None:
    """Joint ``fabric.setup(model, optimizer)``, accumulation under ``no_backward_sync``, active clipping."""
    results, _ = fabric_run
    reference, norms, _, _ = oracle
    assert results["strategy"] == "RaggedFSDPFabricStrategy"  # the registered name
    assert min(norms) > MAX_NORM  # the clipping acts at every step
    assert results["norms"] == pytest.approx(norms, rel=FP32_TOL)
    # no reduction in the accumulating micro-batch, one per DBuffer in the last
    assert results["reduces"] == [0, results["dbuffers"]] * STEPS
    assert _max_diff(results["uninterrupted"], reference) < FP32_TOL


def test_fabric_ema_of_the_shards_saves_resumes_and_swaps(fabric_run, oracle) -> None:
    """``lr.ShardAveragedModel`` (where ``AveragedModel(model)`` cannot deep-copy a sharded module): the EMA of
    torch's ``AveragedModel`` in one process; saved beside the model, resumed bit for bit, into HSDP (another
    layout) and through one full file; ``swap`` there and back leaves the trained weights."""
    results, _ = fabric_run
    _, _, _, average = oracle
    assert _max_diff(results["ema_uninterrupted"], average) < FP32_TOL
    assert _max_diff(results["ema_uninterrupted"], results["uninterrupted"]) > 100 * FP32_TOL  # it averages
    assert _max_diff(results["ema_resumed"], results["ema_uninterrupted"]) == 0.0
    assert _max_diff(results["after_swaps"], results["uninterrupted"]) == 0.0
    assert _max_diff(results["ema_replica"], average) < FP32_TOL
    assert _max_diff(results["ema_reloaded"], results["ema_replica"]) == 0.0


def test_fabric_checkpoint_resumes_bit_identically(fabric_run) -> None:
    """Saved at step 3, loaded into a model built on the meta device (setup first, then its optimizer)."""
    results, _ = fabric_run
    assert results["loaded_step"] == SAVE_AT and results["remainder"] == {}
    assert all(torch.equal(results["resumed"][k], v) for k, v in results["uninterrupted"].items())


def test_fabric_resumes_a_checkpoint_saved_under_ddp(fabric_run, oracle) -> None:
    """``fabric.save`` under ``strategy="ddp"`` writes the user's keys with torch's optimizer state: loaded here with
    strict=True, the optimizer's state too. Before, the optimizer's state was left in the remainder, silently (the
    resumed run ended 0.03 away from an uninterrupted one; with the module under a key other than "model" the load
    said the file "holds a different model")."""
    results, _ = fabric_run
    reference, _, _, _ = oracle
    assert results["from_ddp_step"] == SAVE_AT and results["from_ddp_remainder"] == {}
    assert _max_diff(results["from_ddp"], reference) < FP32_TOL


def test_fabric_checkpoint_reshards_into_hsdp_and_one_full_file(fabric_run, oracle) -> None:
    """The world-2 shards load into 2 replicas of 1 shard (another layout), train on, save one full file: with the
    state's own keys, as Fabric's files (before: Lightning's "state_dict"/"optimizer_states", so the usual
    ``torch.load(path)["model"]`` and a single-device ``fabric.load`` raised KeyError)."""
    results, out = fabric_run
    reference, _, _, _ = oracle
    assert _max_diff(results["replica"], reference) < FP32_TOL
    full = torch.load(out / "full.ckpt", weights_only=True)
    assert full["step"] == STEPS and set(full["optimizer"]) == {"state", "param_groups"}
    assert "state_dict" not in full and "optimizer_states" not in full
    assert full["fabric_state"] == {"module": "model", "optimizers": ["optimizer"]}
    assert all(torch.equal(full["model"][k], v) for k, v in results["replica"].items())
    assert results["reloaded_step"] == STEPS
    assert all(torch.equal(results["reloaded"][k], v) for k, v in results["replica"].items())


def test_fabric_load_of_a_full_file_returns_what_it_did_not_restore(fabric_run) -> None:
    """As Fabric's DDP and FSDP: a state without the optimizer gets the file's optimizer state back in the remainder,
    and a module under another key (strict=False) is not restored and gets the saved module back, while the optimizer
    under its own key is restored. Before, the states were dropped: the remainder was {} and {'step': ..., 'ema': ...},
    and the optimizer of the renamed module was neither restored nor returned."""
    results, out = fabric_run
    saved = torch.load(out / "full.ckpt", weights_only=True)
    user_keys = set(saved) - {"fabric_state", "ragged_checkpoint"}
    remainder = results["reloaded_remainder"]
    assert set(remainder) == user_keys - {"model", "ema", "step"}
    assert remainder["optimizer"]["param_groups"] == saved["optimizer"]["param_groups"]
    for index, state in saved["optimizer"]["state"].items():
        assert all(torch.equal(remainder["optimizer"]["state"][index][k], v) for k, v in state.items())
    assert set(results["renamed_remainder"]) == user_keys - {"optimizer"}
    assert results["renamed_optimizer_steps"] == sorted({float(s["step"]) for s in saved["optimizer"]["state"].values()})
    model = results["renamed_remainder"]["model"]
    assert set(model) == set(saved["model"]) and all(torch.equal(model[k], v) for k, v in saved["model"].items())


def test_fabric_load_raw_and_a_filtered_save(fabric_run) -> None:
    """``load_raw`` slices a plain state-dict file into the shards; a save filtered to the norms, loaded with
    ``strict=False``, sets exactly those and leaves every other tensor as it was (LoRA-style partial saves)."""
    results, _ = fabric_run
    replica, before, after = results["replica"], results["partial_before"], results["partial"]
    assert all(torch.equal(results["raw"][k], v) for k, v in replica.items())
    norms = {k for k in replica if "norm" in k}
    assert norms and all(torch.equal(after[k], replica[k]) for k in norms)
    assert all(torch.equal(after[k], before[k]) for k in replica if k not in norms)
    assert any(not torch.equal(before[k], replica[k]) for k in norms)  # the load did change them


def test_fabric_bf16_mixed_matches_fsdp2_with_the_same_policy(fabric_run, oracle) -> None:
    """fp32 master shards, bf16 all-gathers and compute, fp32 reduction, as torch's FSDP2 with
    ``MixedPrecisionPolicy(bf16, fp32)``: both differ from fp32 training by bf16 rounding (the oracle's
    distance), and from each other at most by a tenth of it (reduction order is fp32 rounding)."""
    results, _ = fabric_run
    _, _, midway, _ = oracle
    assert results["bf16_dtypes"] == ["torch.float32/torch.bfloat16/torch.float32"]
    bf16_distance = _max_diff(results["bf16_fsdp2"], midway)
    assert bf16_distance > FP32_TOL  # bf16 did round the training
    assert _max_diff(results["bf16_ragged"], results["bf16_fsdp2"]) <= 0.1 * bf16_distance


def test_fabric_fp16_mixed_matches_fsdp2_with_the_same_policy_and_scaler(fabric_run) -> None:
    """16-mixed with accumulation and clipping: the same skipped steps and loss scales as FSDP2's ShardedGradScaler."""
    results, _ = fabric_run
    assert results["fp16_scaler"] == "ShardedGradScaler"
    scales = [results["fp16_init_scale"], *results["fp16_scales"]]
    assert results["fp16_scales"] == results["fp16_scales_fsdp2"], (scales, results["fp16_scales_fsdp2"])
    changes = [b / a for a, b in zip(scales, scales[1:])]
    assert 0.5 in changes and 2.0 in changes, scales  # steps skipped (scale halved) and taken (grown)
    # the same fp16 casts of the same values; only the reductions' order may differ (fp32 sums)
    assert _max_diff(results["fp16_ragged"], results["fp16_fsdp2"]) <= 1e-3


def test_fabric_async_save_completes_when_the_script_ends(fabric_run, tmp_path) -> None:
    """The background write and the publish finish before the processes exit (no teardown call needed)."""
    from lightning_ragged.checkpoint import consolidate

    results, out = fabric_run
    full = torch.load(consolidate(out / "async", tmp_path / "async.ckpt"), weights_only=True)
    assert full["step"] == STEPS
    assert all(torch.equal(full["model"][k], v) for k, v in results["async_saved"].items())


# ------------------------------------------------------------ in-process (no processes)
def test_fabric_refuses_bad_settings_before_launch() -> None:
    import lightning as L
    from lightning.fabric.plugins.precision import Precision

    from lightning_ragged.lightning.fabric_strategy import RaggedFSDPFabricStrategy

    import lightning_ragged

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ragged_fsdp", precision="bf16-mixed")
    assert type(fabric.strategy) is RaggedFSDPFabricStrategy is lightning_ragged.RaggedFSDPFabricStrategy
    with pytest.raises(ValueError, match="precision plugin Custom.*32-true"):
        RaggedFSDPFabricStrategy(precision=type("Custom", (Precision,), {})())
    with pytest.raises(ValueError, match="dbuffer_size='recommended'.*pass the bytes"):
        RaggedFSDPFabricStrategy(dbuffer_size="recommended")
    with pytest.raises(ValueError, match="replicate_degree='auto'.*'node'"):
        RaggedFSDPFabricStrategy(replicate_degree="auto")
    with pytest.raises(TypeError, match="did you mean shard_granularity='row'"):
        RaggedFSDPFabricStrategy(shard_granularty="row")
    # the Trainer's knobs Fabric has no place for: refused with what to do (it suggested the refused name itself)
    for name, value, fix in [("metrics", True, "EngineMetrics"), ("monitor_port", 8080, "Monitor"),
                             ("monitor_address", "0.0.0.0", "Monitor"), ("sync_grads_each_micro_batch", True,
                                                                           "no_backward_sync")]:
        with pytest.raises(TypeError) as refused:
            RaggedFSDPFabricStrategy(**{name: value})
        assert f"({name}={value!r}):" in str(refused.value) and fix in str(refused.value), refused.value
        assert "did you mean" not in str(refused.value), refused.value
    with pytest.raises(ValueError, match=r"replicate_degree=3 \(3\) must divide the world size 2"):  # at construction
        L.Fabric(accelerator="cpu", devices=2, strategy=RaggedFSDPFabricStrategy(replicate_degree=3))


class _Sharded(nn.Linear):
    """Passes the sharded-module check without a process group: the checks below run before any collective."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self._ragged_fsdp_state = object()


def test_fabric_checkpoint_states_get_named_errors(tmp_path) -> None:
    from lightning_ragged.engine.runtime import get_state
    from lightning_ragged.lightning import fabric_checkpoints
    from lightning_ragged.lightning.checkpoint_io import LightningCheckpointIO

    io = LightningCheckpointIO()
    with pytest.raises(ValueError, match=r"exactly one module.*'model' \(not sharded\)"):
        fabric_checkpoints.save(io, tmp_path / "c", {"model": nn.Linear(2, 2)})
    with pytest.raises(ValueError, match="'optimizer_0' is reserved"):
        fabric_checkpoints.save(io, tmp_path / "c", {"model": _Sharded(), "optimizer_0": 1})
    model = _Sharded()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match="optimizer's state cannot be filtered"):
        fabric_checkpoints.save(io, tmp_path / "c", {"model": model, "opt": optimizer}, {"opt": lambda k, v: True})
    with pytest.raises(ValueError, match="load it with its module"):
        fabric_checkpoints.load(io, tmp_path, optimizer)
    with pytest.raises(ValueError, match="needs the state to restore in place"):
        fabric_checkpoints.load(io, tmp_path, None)
    wrapper = nn.Sequential()
    wrapper.add_module("_forward_module", model)
    with pytest.raises(ValueError, match="wraps the sharded module '_forward_module'.*model.module"):
        get_state(wrapper)
