"""Sharded checkpoints through Lightning's lifecycle, with the real Trainer on CPU/gloo.

This file is also the script the Trainer runs (``python tests/test_checkpoint_lightning.py
MODE ROOT``): Lightning's launcher re-runs it for every extra rank, each mode runs many
Trainers in the same processes, and rank 0 writes ``ROOT/MODE.json`` for the tests.

* ``save`` (2 ranks): the uninterrupted reference (6 steps), then 4 steps with
  ``ModelCheckpoint`` (top-1 deletion, ``save_last``), a ``save_last="link"`` run, an HPC
  checkpoint, a weights-only one and the full / compressed / async variants.
* ``resume`` (2 ranks, new processes, new process group): ``ckpt_path="last"`` resumes
  bit-identically; every variant reloads the same parameters; ``hpc``; weights-only.
* ``reshard`` (1 rank): resuming the 2-rank checkpoint with another granularity and
  planner continues with losses within 1e-5 of the uninterrupted run (2 <-> 3 <-> 1 for
  every granularity and planner is covered at the engine level, tests/test_checkpoint.py).

The LightningModule here never imports lightning_ragged, so the consolidated file is
loaded by ``load_from_checkpoint`` in a process where lightning_ragged is never imported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.clean_exit import exit_without_teardown  # noqa: E402

import lightning.pytorch as L  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from tests.lightning_models import SEQ, VOCAB, TinyGPT, cpu_trainer  # noqa: E402

GLOBAL_BATCH = 12  # 6 per rank at 2 ranks, 4 at 3
STEPS_PER_EPOCH = 1  # Lightning resumes an end-of-epoch checkpoint exactly only when the epoch is one step (DDP too)
RUN_TIMEOUT_S = 420


class LitCkpt(L.LightningModule):
    """AdamW with a step LR schedule (its state must be restored too); records the global mean loss.

    The logits go through a learnable 0-D scale (a temperature), so every path here (resume,
    full/compressed/async, consolidation, resharding) also carries a parameter of shape ``()``.
    """

    def __init__(self, lr: float = 3e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyGPT()
        self.logit_scale = torch.nn.Parameter(torch.tensor(1.0))
        self.losses: list[float] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens) * self.logit_scale

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        mean = self.trainer.strategy.reduce(loss.detach().clone(), reduce_op="mean")
        self.losses.append(float(mean))
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader(world: int) -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    starts = torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS_PER_EPOCH, 1), generator=generator)
    tokens = (starts + torch.arange(SEQ + 1)) % VOCAB
    return DataLoader(TensorDataset(tokens), batch_size=GLOBAL_BATCH // world, shuffle=False)


# ------------------------------------------------------------------ the Trainer runs
def _trainer(strategy, devices: int, max_steps: int, root: Path, callbacks=(), **kwargs) -> L.Trainer:
    return cpu_trainer(
        strategy,
        devices,
        max_steps,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        default_root_dir=str(root),
        **kwargs,
    )


def _fit(root: Path, max_steps: int, devices: int = 2, strategy="ragged_fsdp", ckpt_path=None, callbacks=(), **kw):
    L.seed_everything(0, verbose=False)
    trainer = _trainer(strategy, devices, max_steps, root, callbacks, **kw)
    model = LitCkpt()
    trainer.fit(model, loader(devices), ckpt_path=ckpt_path)
    return trainer, model


def _local_state(trainer: L.Trainer, model: LitCkpt) -> dict[str, torch.Tensor]:
    out = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    optimizer = trainer.optimizers[0]
    for j, param in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        for key, value in optimizer.state.get(param, {}).items():
            out[f"opt.{j}.{key}"] = value.detach().clone()
    return out


def _full(model: LitCkpt) -> dict[str, torch.Tensor]:
    from lightning_ragged import full_state_dict

    return {k: v.detach().clone() for k, v in full_state_dict(model).items()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def save_mode(root: Path, results: dict) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    rank = int(os.environ.get("LOCAL_RANK", 0))
    trainer, ref = _fit(root, 6)
    results["ref_losses"] = ref.losses
    torch.save(_local_state(trainer, ref), root / f"ref_local_{rank}.pt")
    if rank == 0:
        torch.save(_full(ref), root / "ref_full.pt")
    else:
        _full(ref)

    top1 = ModelCheckpoint(dirpath=root / "ckpts", monitor="step", mode="max", save_top_k=1, save_last=True)
    trainer, part = _fit(root, 4, callbacks=[top1])
    results["part_losses"] = part.losses
    if rank == 0:
        torch.save(_full(part), root / "step4_full.pt")
    else:
        _full(part)
    listing = sorted(os.listdir(root / "ckpts"))
    results["ckpts_listing"] = listing
    results["ckpts_are_dirs"] = all((root / "ckpts" / name).is_dir() for name in listing)

    strategy = trainer.strategy
    hpc_path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)  # what the SLURM handler does
    trainer.save_checkpoint(hpc_path)
    results["hpc_path"] = os.path.basename(hpc_path)
    trainer.save_checkpoint(root / "weights.ckpt", weights_only=True)
    strategy.ragged_checkpoints.compress = True
    trainer.save_checkpoint(root / "zstd.ckpt")
    strategy.ragged_checkpoints.compress = False
    strategy.ragged_checkpoints.async_save = True
    trainer.save_checkpoint(root / "async.ckpt")
    strategy.ragged_checkpoints.async_save = False
    strategy.state_dict_type = "full"
    trainer.save_checkpoint(root / "full.ckpt")
    strategy.state_dict_type = "sharded"
    strategy.ragged_checkpoints.teardown()
    strategy.barrier()
    results["full_is_file"] = (root / "full.ckpt").is_file()

    link = ModelCheckpoint(dirpath=root / "linked", monitor="step", mode="max", save_top_k=1, save_last="link")
    _fit(root, 2, callbacks=[link])
    results["link_is_symlink"] = (root / "linked" / "last.ckpt").is_symlink()
    results["hidden_leftovers"] = sorted(str(p) for p in root.rglob(".ragged*"))
    if rank == 0:  # the resume run writes new checkpoints next to the ones it resumes from
        shutil.copytree(root / "ckpts", root / "ckpts_resume", symlinks=True)


def resume_mode(root: Path, results: dict) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    rank = int(os.environ.get("LOCAL_RANK", 0))
    last = ModelCheckpoint(dirpath=root / "ckpts_resume", monitor="step", mode="max", save_top_k=1, save_last=True)
    trainer, resumed = _fit(root, 6, callbacks=[last], ckpt_path="last")
    reference = torch.load(root / f"ref_local_{rank}.pt")
    got = _local_state(trainer, resumed)
    identical = got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got)
    flag = torch.tensor([float(identical)])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)  # every rank's shards
    results["bit_identical"] = flag.item() == 1.0
    results["resumed_losses"] = resumed.losses
    results["resumed_lr"] = trainer.optimizers[0].param_groups[0]["lr"]

    step4 = torch.load(root / "step4_full.pt")
    for name in ("zstd.ckpt", "async.ckpt", "full.ckpt", "hpc"):
        trainer, model = _fit(root, 4, ckpt_path=name if name == "hpc" else root / name)
        results[f"reload_diff_{name}"] = _max_diff(_full(model), step4)
        results[f"reload_steps_{name}"] = trainer.global_step

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, model = _fit(root, 5, ckpt_path=root / "weights.ckpt")
    results["weights_only_warned"] = any("optimizer and LR-scheduler states are absent" in str(w.message) for w in caught)
    results["weights_only_trained_steps"] = len(model.losses)

    linked = ModelCheckpoint(dirpath=root / "linked", monitor="step", mode="max", save_top_k=1, save_last="link")
    trainer, model = _fit(root, 3, callbacks=[linked], ckpt_path="last")
    results["link_resumed_steps"] = len(model.losses)

    if rank == 0:  # both consolidation CLIs, run in this process to save start-ups
        import runpy

        from lightning_ragged.cli.consolidate import main as consolidate

        results["ours_rc"] = consolidate([str(root / "ckpts" / "last.ckpt"), str(root / "ours.ckpt")])
        argv = sys.argv
        sys.argv = ["consolidate_checkpoint", str(root / "ckpts" / "last.ckpt"), "--output_file", str(root / "theirs.ckpt")]
        try:
            runpy.run_module("lightning.pytorch.utilities.consolidate_checkpoint", run_name="__main__")
        finally:
            sys.argv = argv


def reshard_mode(root: Path, results: dict) -> None:
    from lightning_ragged import RaggedFSDPStrategy

    strategy = RaggedFSDPStrategy(shard_granularity="element", planning_algorithm="greedy")
    trainer, model = _fit(root, 6, devices=1, strategy=strategy, ckpt_path=root / "ckpts" / "last.ckpt")
    results["reshard_losses"] = model.losses


MODES = {"save": save_mode, "resume": resume_mode, "reshard": reshard_mode}


def _main(mode: str, root: str) -> None:
    warnings.filterwarnings("ignore", message=".*(does not have many workers|is not a distributed|LOCAL_RANK).*")
    torch.set_num_threads(1)
    import lightning_ragged  # noqa: F401  (registers "ragged_fsdp")

    function = MODES[mode]
    results: dict = {}
    function(Path(root), results)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        Path(root, f"{mode}.json").write_text(json.dumps(results))


# ------------------------------------------------------------------------ the tests
_LAUNCH_VARS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "PL_GLOBAL_SEED", "TORCHELASTIC_RUN_ID")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("SLURM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run(mode: str, root: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, mode, str(root)], env=_env(), cwd=ROOT, capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S,
    )
    out = root / f"{mode}.json"
    assert proc.returncode == 0 and out.exists(), f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lightning_ckpt")
    results = {"root": root, "save": _run("save", root)}
    results["resume"] = _run("resume", root)
    return results


def test_model_checkpoint_writes_directories_and_deletes_the_worst(runs) -> None:
    save = runs["save"]
    assert save["ckpts_listing"] == ["epoch=3-step=4.ckpt", "last.ckpt"]
    assert save["ckpts_are_dirs"]
    assert save["link_is_symlink"]
    assert save["full_is_file"]
    assert save["hidden_leftovers"] == []


def test_resume_from_last_is_bit_identical_in_a_new_process_group(runs) -> None:
    save, resume = runs["save"], runs["resume"]
    assert resume["bit_identical"]  # parameters and AdamW states of every rank, fp32
    assert resume["resumed_losses"] == save["ref_losses"][4:]
    assert resume["resumed_lr"] == pytest.approx(3e-2 * 0.8**6)


@pytest.mark.parametrize("name", ["zstd.ckpt", "async.ckpt", "full.ckpt", "hpc"])
def test_full_compressed_async_and_hpc_checkpoints_reload_the_same_parameters(runs, name: str) -> None:
    resume = runs["resume"]
    assert resume[f"reload_diff_{name}"] == 0.0
    assert resume[f"reload_steps_{name}"] == 4


def test_weights_only_checkpoint_resumes_weights_and_says_optimizer_state_is_absent(runs) -> None:
    resume = runs["resume"]
    assert resume["weights_only_warned"]
    assert resume["weights_only_trained_steps"] == 1
    assert resume["link_resumed_steps"] == 1  # save_last="link": resumed at step 2, trained to 3


def test_resharded_resume_at_one_rank_matches_uninterrupted(runs) -> None:
    reshard = _run("reshard", runs["root"])
    expected = runs["save"]["ref_losses"][4:]
    assert len(reshard["reshard_losses"]) == len(expected)
    assert max(abs(a - b) for a, b in zip(reshard["reshard_losses"], expected)) < 1e-5


def test_consolidated_checkpoint_loads_without_lightning_ragged(runs) -> None:
    root = runs["root"]
    assert runs["resume"]["ours_rc"] == 0  # python -m lightning_ragged.consolidate CKPT_DIR OUT.ckpt
    ours, theirs = root / "ours.ckpt", root / "theirs.ckpt"  # ours, and Lightning's consolidate_checkpoint
    check = (
        "import sys, torch\n"
        "from tests.test_checkpoint_lightning import LitCkpt\n"
        f"a = LitCkpt.load_from_checkpoint({str(ours)!r})\n"
        f"b = torch.load({str(theirs)!r}, weights_only=True)['state_dict']\n"
        f"ref = torch.load({str(root / 'step4_full.pt')!r})\n"
        "assert 'lightning_ragged' not in sys.modules\n"
        "assert a.hparams.lr == 3e-2\n"
        "assert a.logit_scale.shape == () and b['logit_scale'].shape == ()\n"
        "for k, v in ref.items():\n"
        "    assert torch.equal(a.state_dict()[k], v), k\n"
        "    assert torch.equal(b[k], v), k\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", check], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-4000:]


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
    exit_without_teardown()
