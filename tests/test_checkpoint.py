"""Sharded checkpoints at the engine level: exact resume, resharding, options, validation, crash safety.

Distributed checks run on the shared gloo pools (2, 3 and 1 ranks); each ``check_*``
loops over many configurations inside one task so the pools are started once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_ragged as lr
from lightning_ragged import checkpoint as ck
from tests.models import TinyLM, lm_loss, make_batches, make_model

BATCH = 6  # global batch: divisible by 1, 2 and 3 ranks
GRANULARITIES = {
    "element": dict(shard_granularity="element"),
    "row": dict(shard_granularity="row"),
    "block": dict(shard_granularity="block", block_rows=2),
    "matrix": dict(shard_granularity="matrix"),
}
PLANNERS = ("optimal", "greedy")
CONFIGS = [(g, p) for g in GRANULARITIES for p in PLANNERS]


def _kwargs(config: tuple[str, str]) -> dict:
    granularity, planner = config
    return dict(GRANULARITIES[granularity], planning_algorithm=planner)


def _rotated(config: tuple[str, str]) -> tuple[str, str]:
    """A different granularity and the other planner: resumes never reuse the saved layout."""
    names = list(GRANULARITIES)
    return names[(names.index(config[0]) + 1) % len(names)], PLANNERS[1 - PLANNERS.index(config[1])]


def _step(model, optimizers, batch: torch.Tensor) -> float:
    """One step on this rank's slice of the global batch; returns the global mean loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per = batch.shape[0] // world
    loss = lm_loss(model, batch[rank * per : (rank + 1) * per])
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def _adamw(model):
    return [torch.optim.AdamW(model.parameters(), lr=1e-2)]


def _muon_and_adamw(model):
    from lightning_ragged.optim import Muon, split_muon_params

    muon, other = split_muon_params(model.named_parameters())
    return [Muon([p for _, p in muon], lr=2e-2), torch.optim.AdamW([p for _, p in other], lr=1e-2)]


def _shampoo(model):
    from lightning_ragged.optim import Shampoo

    return [Shampoo(model.parameters(), lr=1e-2, max_preconditioner_dim=8, precondition_frequency=2,
                    start_preconditioning_step=2)]


def _adamw8bit(model):
    from lightning_ragged.optim import AdamW8bit

    return [AdamW8bit(model.parameters(), lr=1e-2, block_size=16)]


OPTIMIZERS = {"adamw": _adamw, "muon": _muon_and_adamw, "shampoo": _shampoo, "adamw8bit": _adamw8bit}
SHARDING_FOR = {
    "adamw": dict(shard_granularity="row"),
    "muon": dict(shard_granularity="row"),
    "shampoo": dict(shard_granularity="block", block_rows=8),  # every 8-row tile on one rank
    "adamw8bit": dict(shard_granularity=lambda name, param: 16),  # cuts only between 16-element blocks
}


def _local_state(model, optimizers) -> dict[str, torch.Tensor]:
    out = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, optimizer in enumerate(optimizers):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for j, param in enumerate(params):
            _flatten_state(f"opt{i}.{j}", optimizer.state.get(param, {}), out)
    return out


def _flatten_state(prefix: str, state: dict, out: dict[str, torch.Tensor]) -> None:
    """Every tensor of an optimizer state, nested dicts (Shampoo's tiles) included."""
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[f"{prefix}.{key}"] = value.detach().clone()
        elif isinstance(value, dict):
            _flatten_state(f"{prefix}.{key}", value, out)


# --------------------------------------------------------------------- exact resume
def check_resume_is_bit_identical(root: str, optimizer_kind: str) -> dict:
    make_optimizers, sharding = OPTIMIZERS[optimizer_kind], SHARDING_FOR[optimizer_kind]
    data = make_batches(6, BATCH)
    model = lr.fully_shard(make_model(), **sharding)
    optimizers = make_optimizers(model)
    for step in range(6):
        _step(model, optimizers, data[step])
    uninterrupted = _local_state(model, optimizers)

    first = lr.fully_shard(make_model(), **sharding)
    first_opts = make_optimizers(first)
    for step in range(3):
        _step(first, first_opts, data[step])
    ck.save(f"{root}/{optimizer_kind}", first, first_opts, {"step": 3})
    del first, first_opts

    resumed = lr.fully_shard(make_model(seed=7), **sharding)  # other init: the load must overwrite
    resumed_opts = make_optimizers(resumed)
    extra = ck.load(f"{root}/{optimizer_kind}", resumed, resumed_opts)
    for step in range(extra["step"], 6):
        _step(resumed, resumed_opts, data[step])
    got = _local_state(resumed, resumed_opts)
    assert got.keys() == uninterrupted.keys(), sorted(set(got) ^ set(uninterrupted))
    return {key: torch.equal(got[key], uninterrupted[key]) for key in got}


@pytest.mark.parametrize("optimizer_kind", list(OPTIMIZERS))
def test_resume_same_world_size_is_bit_identical(dist_pool, tmp_path, optimizer_kind: str) -> None:
    for result in dist_pool(2).run(check_resume_is_bit_identical, str(tmp_path), optimizer_kind):
        assert all(result.values()), [k for k, same in result.items() if not same]


def check_async_saves_leave_no_process_group(root: str) -> dict:
    """A Trainer's checkpoint plugin per run (a sweep): each builds a gloo group for its async saves, and its
    teardown destroys it (before: one more group, with its sockets, per Trainer: ~5 file descriptors per run)."""
    from lightning_ragged.lightning.checkpoint_io import LightningCheckpointIO

    def groups() -> int:
        return len(dist.distributed_c10d._world.pg_map)

    model = lr.fully_shard(make_model(), shard_granularity="row")
    before, counts = groups(), []
    for run in range(3):
        io = LightningCheckpointIO(async_save=True)
        io.save({"state_dict": model.state_dict(), "global_step": run}, os.path.join(root, f"run{run}"))
        counts.append(groups() - before)  # the save's own group, alive while it may be in flight
        io.teardown()
    fresh = lr.fully_shard(make_model(seed=3), shard_granularity="row")
    ck.load(os.path.join(root, "run2"), fresh, [])
    return {"during": counts, "after": groups() - before,
            "loaded": max((a - b).abs().max().item() for a, b in zip(lr.full_state_dict(fresh).values(),
                                                                      lr.full_state_dict(model).values()))}


def test_async_saves_leave_no_process_group(dist_pool, tmp_path) -> None:
    for result in dist_pool(2).run(check_async_saves_leave_no_process_group, str(tmp_path)):
        assert result == {"during": [1, 1, 1], "after": 0, "loaded": 0.0}, result


def check_async_staging_allocates_only_its_copies() -> dict:
    """What staging an async save allocates, counted by a dispatch mode over the second stage (the stager's CPU
    buffers exist from the first): no copy of any tensor's data. Before: DCP's stager copied each DTensor through ``new_empty``, which
    torch's LocalShardsWrapper answers with ``empty_like`` of its boxes on their own device, twice (the DTensor's
    and the wrapper's): 2.8x the shards' bytes here, on the GPU under CUDA (the copies being made for pinned CPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from lightning_ragged.checkpoint.model_state import sharded_model_state_dict
    from lightning_ragged.checkpoint.writer import CheckpointWriter

    class Allocations(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.bytes = self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket in (torch.ops.aten.empty_like, torch.ops.aten.new_empty, torch.ops.aten.empty,
                                        torch.ops.aten.empty_strided):
                sizes = [t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                self.bytes, self.largest = self.bytes + sum(sizes), max([self.largest, *sizes])
            return out

    model = lr.fully_shard(make_model(), shard_granularity="row")
    tensors = {"model": sharded_model_state_dict(model)}
    writer = CheckpointWriter()
    writer._stage(tensors)  # allocates the CPU copies, kept for the next save
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    with Allocations() as allocations:
        staged = writer._stage(tensors)
    shards = {k: v for k, v in tensors["model"].items()}
    copies = {k: v for k, v in staged["model"].items()}
    same = all(torch.equal(copies[k].to_local().local_shards()[i], box)
               for k, v in shards.items() if hasattr(v, "to_local")
               for i, box in enumerate(v.to_local().local_shards()))
    apart = all(copies[k].to_local().local_shards()[0].untyped_storage().data_ptr()
                != v.to_local().local_shards()[0].untyped_storage().data_ptr()
                for k, v in shards.items() if hasattr(v, "to_local") and v.to_local().local_shards())
    writer.close()
    return {"bytes": allocations.bytes, "largest": allocations.largest, "same": same, "apart": apart,
            "shard_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def test_async_staging_allocates_only_its_copies(dist_pool) -> None:
    for result in dist_pool(2).run(check_async_staging_allocates_only_its_copies):
        assert result["shard_bytes"] > 0 and result["same"] and result["apart"], result
        # the staged boxes are new tensor objects over the kept CPU storages: a scalar's worth each, no copy of data
        assert result["largest"] <= 4 and result["bytes"] < result["shard_bytes"] / 20, result


# ----------------------------------------------------------------------- resharding
def check_buffers_saved_from_rank_zero(root: str, async_save: bool) -> dict:
    """BatchNorm's running statistics after a step on each rank's own data: the ranks' differ (the broadcast
    comes before the next forward, DDP's rule); what a sharded checkpoint loads back, on every rank."""
    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))

    model = lr.fully_shard(make(), shard_granularity="row")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).pow(2).mean().backward()
    opt.step()
    mine = model[1].running_mean.clone()
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    path = os.path.join(root, "bn")
    ck.save(path, model, [opt], {"step": 1}, async_save=async_save)
    ck.wait_for_pending_save()
    fresh = lr.fully_shard(make(), shard_granularity="row")
    ck.load(path, fresh, [torch.optim.AdamW(fresh.parameters(), lr=1e-2)])
    return {"ranks_differ": not torch.equal(every[0], every[1]),
            "loaded_vs_rank0": (fresh[1].running_mean - every[0]).abs().max().item(),
            "var_vs_rank0": (fresh[1].running_var - _broadcast(model[1].running_var)).abs().max().item()}


def _broadcast(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    dist.broadcast(tensor, 0)
    return tensor


@pytest.mark.parametrize("async_save", [False, True])
def test_buffers_are_saved_from_rank_zero(dist_pool, tmp_path, async_save: bool) -> None:
    # rank 0's, as DDP saves and as the uninterrupted run's next forward broadcasts; DCP's default planner wrote a
    # buffer every rank holds from the least-loaded rank (rank 1's here: 0.056 apart, a resume's BatchNorm drifted)
    for result in dist_pool(2).run(check_buffers_saved_from_rank_zero, str(tmp_path), async_save):
        assert result["ranks_differ"], result
        assert result["loaded_vs_rank0"] == 0.0 and result["var_vs_rank0"] == 0.0, result


def check_async_meta_is_the_state_at_the_save(root: str) -> dict:
    """An async save returns once the tensors are staged; rank 0 writes ``meta.pt`` later. The extras (Lightning's
    callback and loop states) must be those at the save, not those the training changed meanwhile."""
    model = lr.fully_shard(make_model(), shard_granularity="row")
    callbacks = {"best_k_models": {"step=1": 1.0}}
    path = os.path.join(root, "async")
    ck.save(path, model, [], {"callbacks": callbacks}, async_save=True)
    callbacks["best_k_models"]["step=2"] = 0.5  # ModelCheckpoint's bookkeeping at the next step
    ck.wait_for_pending_save()
    return {"saved": ck.inspect_checkpoint(path).meta["callbacks"]}


def test_async_save_writes_the_extras_as_they_were_at_the_save(dist_pool, tmp_path) -> None:
    # before: a checkpoint's ModelCheckpoint state listed the checkpoints saved after it (meta.pt written late)
    for result in dist_pool(2).run(check_async_meta_is_the_state_at_the_save, str(tmp_path)):
        assert result["saved"] == {"best_k_models": {"step=1": 1.0}}, result


def check_hsdp_replicas_share_the_writing(root: str) -> dict:
    """2 replicas of 1 shard: every shard is held by both ranks; DCP spreads such items over the ranks holding
    them (as FSDP2's HSDP saves), only whole-held tensors are pinned to rank 0."""
    rank = dist.get_rank()
    shard_groups = [dist.new_group([0]), dist.new_group([1])]
    model = lr.fully_shard(make_model(), process_group=shard_groups[rank], replicate_group=dist.group.WORLD)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lm_loss(model, make_batches(1, 4)[0][rank * 2 : rank * 2 + 2]).backward()
    opt.step()
    path = os.path.join(root, "hsdp_spread")
    ck.save(path, model, [opt], {"step": 1})
    dist.barrier()
    return {"bytes": sorted(p.stat().st_size for p in Path(path).glob("*.distcp"))}


def test_hsdp_replicas_share_the_writing(dist_pool, tmp_path) -> None:
    # with DCP's dedup_save_to_lowest_rank every replicated shard went to rank 0 (rank 1's file: 0 bytes)
    for result in dist_pool(2).run(check_hsdp_replicas_share_the_writing, str(tmp_path)):
        small, large = result["bytes"]
        assert small > large / 4, result


def check_train_and_save(root: str, tag: str, steps_total: int) -> dict:
    """For every config: 3 steps then save (and, for the reference, the uninterrupted losses)."""
    data = make_batches(steps_total, BATCH)
    losses = {}
    for config in CONFIGS:
        model = lr.fully_shard(make_model(), **_kwargs(config))
        optimizers = _adamw(model)
        trace = [_step(model, optimizers, data[step]) for step in range(3)]
        ck.save(f"{root}/{tag}-{config[0]}-{config[1]}", model, optimizers, {"step": 3})
        trace += [_step(model, optimizers, data[step]) for step in range(3, steps_total)]
        losses[config] = trace
    return losses


def check_resume(root: str, tag: str, steps_total: int) -> dict:
    """For every saved config: load with another granularity/planner here, train to the end."""
    data = make_batches(steps_total, BATCH)
    losses = {}
    for config in CONFIGS:
        model = lr.fully_shard(make_model(seed=11), **_kwargs(_rotated(config)))
        optimizers = _adamw(model)
        extra = ck.load(f"{root}/{tag}-{config[0]}-{config[1]}", model, optimizers)
        losses[config] = [_step(model, optimizers, data[step]) for step in range(extra["step"], steps_total)]
    return losses


@pytest.fixture(scope="module")
def reshard_root():
    root = tempfile.mkdtemp(prefix="ragged_reshard_")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("saved_at,resumed_at", [(2, 3), (2, 1), (3, 2)])
def test_resharded_resume_matches_uninterrupted(dist_pool, reshard_root, saved_at: int, resumed_at: int) -> None:
    tag = f"w{saved_at}"
    if not Path(reshard_root, f"{tag}-row-optimal").exists():
        references = dist_pool(saved_at).run(check_train_and_save, reshard_root, tag, 6)[0]
        Path(reshard_root, f"{tag}.ref").write_text(repr({f"{g}-{p}": v for (g, p), v in references.items()}))
    references = eval(Path(reshard_root, f"{tag}.ref").read_text())  # noqa: S307 - our own repr of floats
    resumed = dist_pool(resumed_at).run(check_resume, reshard_root, tag, 6)[0]
    for (granularity, planner), losses in resumed.items():
        expected = references[f"{granularity}-{planner}"][3:]
        assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-5, (granularity, planner, losses, expected)


# ------------------------------------------------------- a fused expert stack cut inside an expert
class ExpertStack(torch.nn.Module):
    """A fused MoE expert tensor [E, a, b], as transformers holds it, and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = torch.nn.Parameter(torch.randn(8, 4, 8))
        self.head = torch.nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.einsum("bi,eoi->bo", x, self.experts)).square().mean()


def check_expert_stack_round_trip(root: str, save: bool) -> dict:
    """Save ("row": cut at rows of one expert, several 3-D boxes on a rank) or load (at "element"); then one more
    step from the same batch. Several 3-D boxes on a rank failed both ways in torch's LocalShardsWrapper view
    ("No support for view on tensors ndim > 2"): the default "row" could not checkpoint a Qwen3-MoE."""
    model = lr.fully_shard(ExpertStack(), shard_granularity="row" if save else "element")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    if save:
        model(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        ck.save(root, model, [optimizer])
    else:
        ck.load(root, model, [optimizer])
    boxes = len(model.experts.ragged_shard.local_boxes())
    model(batch).backward()
    optimizer.step()
    return {"boxes": boxes, "after": {k: v.clone() for k, v in lr.full_state_dict(model).items()}}


def test_expert_stack_cut_inside_an_expert_saves_and_reshards(dist_pool, tmp_path) -> None:
    saved = dist_pool(2).run(check_expert_stack_round_trip, str(tmp_path / "ckpt"), True)
    loaded = dist_pool(3).run(check_expert_stack_round_trip, str(tmp_path / "ckpt"), False)
    assert max(r["boxes"] for r in saved) > 1 and max(r["boxes"] for r in loaded) > 1  # the case that failed
    for result in loaded:
        for name, value in saved[0]["after"].items():
            assert torch.allclose(result["after"][name], value, atol=1e-6, rtol=0), name


# ------------------------------------------------------------------------- HSDP
def check_hsdp_round_trip(root: str) -> dict:
    """HSDP (2 replicas x 1-rank shard groups) -> plain 2-rank FSDP and back: losses match uninterrupted."""
    shard_group, _ = dist.new_subgroups_by_enumeration([[0], [1]])
    replicate_group, _ = dist.new_subgroups_by_enumeration([[0, 1]])
    hsdp = dict(process_group=shard_group, replicate_group=replicate_group, shard_granularity="row")
    layouts = {"hsdp": hsdp, "fsdp": dict(shard_granularity="element")}
    data = make_batches(6, BATCH)
    worst = 0.0
    for saved, resumed in (("hsdp", "fsdp"), ("fsdp", "hsdp")):
        model = lr.fully_shard(make_model(), **layouts[saved])
        optimizers = _adamw(model)
        trace = [_step(model, optimizers, data[step]) for step in range(3)]
        ck.save(f"{root}/{saved}", model, optimizers)
        trace += [_step(model, optimizers, data[step]) for step in range(3, 6)]
        model = lr.fully_shard(make_model(seed=2), **layouts[resumed])
        optimizers = _adamw(model)
        ck.load(f"{root}/{saved}", model, optimizers)
        resumed_trace = [_step(model, optimizers, data[step]) for step in range(3, 6)]
        worst = max(worst, max(abs(a - b) for a, b in zip(resumed_trace, trace[3:])))
    return {"worst": worst}


def test_hsdp_checkpoint_reshards_to_fsdp_and_back(dist_pool, tmp_path) -> None:
    result = dist_pool(2).run(check_hsdp_round_trip, str(tmp_path))[0]
    assert result["worst"] < 1e-5, result


# ------------------------------------------------------- FSDP2 / ModelParallelStrategy
def check_fsdp2_checkpoint_resumes_ragged(root: str) -> float:
    """A directory as Lightning's ModelParallelStrategy writes it (FSDP2 + DCP) resumes a ragged model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard as fsdp2

    data = make_batches(6, BATCH)
    model = make_model()
    for block in model.blocks:
        fsdp2(block)
    fsdp2(model)
    optimizers = _adamw(model)
    trace = [_step(model, optimizers, data[step]) for step in range(3)]
    state = {"state_dict": get_model_state_dict(model), "optimizer_0": get_optimizer_state_dict(model, optimizers[0])}
    dcp.save(state, checkpoint_id=f"{root}/fsdp2")
    if dist.get_rank() == 0:
        torch.save({"global_step": 3}, f"{root}/fsdp2/meta.pt")
    dist.barrier()
    trace += [_step(model, optimizers, data[step]) for step in range(3, 6)]
    ragged = lr.fully_shard(make_model(seed=3), shard_granularity="row")
    ragged_opts = _adamw(ragged)
    assert ck.load(f"{root}/fsdp2", ragged, ragged_opts) == {"global_step": 3}
    resumed = [_step(ragged, ragged_opts, data[step]) for step in range(3, 6)]
    return max(abs(a - b) for a, b in zip(resumed, trace[3:]))


def test_lightning_model_parallel_checkpoint_resumes_a_ragged_model(dist_pool, tmp_path) -> None:
    assert dist_pool(2).run(check_fsdp2_checkpoint_resumes_ragged, str(tmp_path))[0] < 1e-5


# ------------------------------------------------------------------ plain nn.Module
def test_sharded_checkpoint_loads_into_a_plain_module(dist_pool, reshard_root) -> None:
    path = Path(reshard_root, "w2-element-greedy")
    if not path.exists():
        pytest.skip("needs the 2-rank checkpoints of the resharding test")
    reference = make_model()
    data = make_batches(6, BATCH)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(3):
        lm_loss(reference, data[step]).backward()
        opt.step()
        opt.zero_grad()
    plain = make_model(seed=3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    ck.load(path, plain, [plain_opt])
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[key], value, rtol=0, atol=1e-6)
    for param, ref_param in zip(plain.parameters(), reference.parameters()):
        torch.testing.assert_close(plain_opt.state[param]["exp_avg"], opt.state[ref_param]["exp_avg"], rtol=0, atol=1e-6)


# -------------------------------------------------------- full / compressed / async
def check_options_reload(root: str) -> dict:
    data = make_batches(4, BATCH)
    model = lr.fully_shard(make_model(), shard_granularity="row")
    optimizers = _adamw(model)
    writer = ck.CheckpointWriter()
    expected = {}
    saves = {
        "plain": dict(),
        "zstd": dict(compress=True),
        "async": dict(async_save=True),
        "async_zstd": dict(async_save=True, compress=True),
        "full.ckpt": dict(full=True),
    }
    for step, (name, options) in enumerate(saves.items()):
        _step(model, optimizers, data[step % len(data)])
        ck.save(f"{root}/{name}", model, optimizers, writer=writer, **options)
        expected[name] = _local_state(model, optimizers)  # taken before the async write finishes
        _step(model, optimizers, data[(step + 1) % len(data)])  # training goes on while it is written
    writer.wait()
    same = {"in_step": _state_dict_is_sharded_inside_a_step()}
    for name in saves:
        restored = lr.fully_shard(make_model(seed=5), shard_granularity="row")
        restored_opts = _adamw(restored)
        ck.load(f"{root}/{name}", restored, restored_opts)
        got = _local_state(restored, restored_opts)
        same[name] = all(torch.equal(got[k], expected[name][k]) for k in expected[name]) and got.keys() == expected[name].keys()
    return same


def _state_dict_is_sharded_inside_a_step() -> bool:
    """Between forward and backward the modules point at full parameters; the state dict is still the shards."""
    from torch.distributed.tensor import DTensor

    model = lr.fully_shard(make_model(), shard_granularity="row", reshard_after_forward=False)
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    loss = lm_loss(model, make_batches(1, BATCH)[0][dist.get_rank() :: dist.get_world_size()])
    state = ck.sharded_model_state_dict(model)
    loss.backward()
    return all(isinstance(value, DTensor) for key, value in state.items() if key in names)


def test_full_compressed_and_async_saves_reload_the_same_state(dist_pool, tmp_path) -> None:
    result = dist_pool(2).run(check_options_reload, str(tmp_path))[0]
    assert all(result.values()), result
    assert (tmp_path / "full.ckpt").is_file()
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert set(full) >= {"state_dict", "optimizer_states"}
    size = lambda name: sum(f.stat().st_size for f in (tmp_path / name).glob("*.distcp"))  # noqa: E731
    assert size("zstd") < size("plain")
    assert not any(p.name.startswith(".ragged") for p in tmp_path.iterdir()), sorted(os.listdir(tmp_path))


def _publish_fails_on_rank_zero(root: str, async_save: bool) -> tuple[str, bool]:
    """Rank 0's disk fills while it publishes (after every rank wrote its shards): what each rank raises."""
    from datetime import timedelta

    from lightning_ragged.checkpoint import atomic_dir
    from lightning_ragged.checkpoint.timeout import group_timeout

    model = lr.fully_shard(make_model(), shard_granularity="row")
    optimizers = _adamw(model)
    _step(model, optimizers, make_batches(1, BATCH)[0])

    def full_disk(name: str, path: Path) -> None:
        if name == "write_checksums":
            raise OSError(28, "No space left on device")

    timeout = group_timeout()
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=60), None)  # a regression waits 60 s, not 30 min
    writer = ck.CheckpointWriter()
    try:
        with atomic_dir.on_step(full_disk):
            ck.save(f"{root}/ckpt", model, optimizers, writer=writer, async_save=async_save)
            writer.wait()
        outcome = "no error"
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    finally:
        dist.distributed_c10d._set_pg_timeout(timeout, None)
    return outcome, Path(root, "ckpt").exists()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_publish_failing_on_rank_zero_is_raised_on_every_rank(dist_pool, tmp_path, async_save) -> None:
    # Before: rank 0 raised and the other ranks waited in the barrier after publishing (async: in the next
    # save's wait) until the process-group timeout, then blamed rank 0 for not arriving
    (first, published), (other, _) = dist_pool(2).run(_publish_fails_on_rank_zero, str(tmp_path), async_save)
    assert first == "OSError: [Errno 28] No space left on device" and not published
    assert other.startswith("CheckpointError: checkpoint save to ") and "failed on ranks [0] (rank 0: OSError: " in other
    assert "No space left on device" in other


def _staged_storages(tree) -> list[tuple[str, int]]:
    """(device, storage address) of every tensor a staged state dict holds (a DTensor by its local boxes)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    out = []
    for leaf in tree_leaves(tree):
        if isinstance(leaf, DTensor):
            leaf = leaf._local_tensor
        for piece in getattr(leaf, "local_shards", lambda: [leaf])() if isinstance(leaf, torch.Tensor) else []:
            out.append((piece.device.type, piece.untyped_storage().data_ptr()))
    return out


def check_async_staging_reuses_cpu_buffers(root: str) -> dict:
    """Two async saves: the staged copy is in CPU memory apart from the live shards, and the second
    save copies into the first one's buffers; training between them does not change what was saved."""
    data = make_batches(3, BATCH)
    model = lr.fully_shard(make_model(), shard_granularity="row")
    optimizers = _adamw(model)
    writer = ck.CheckpointWriter()
    live = {ptr for _, ptr in _staged_storages(
        {"model": ck.sharded_model_state_dict(model), "opt": ck.sharded_optimizer_state_dict(model, optimizers[0])}
    )}
    staged, expected, held = [], [], []
    for step in range(2):
        _step(model, optimizers, data[step])
        ck.save(f"{root}/save{step}", model, optimizers, writer=writer, async_save=True)
        held.append(writer.pending.staged)  # alive: fresh buffers for the second save could not reuse its addresses
        staged.append(_staged_storages(writer.pending.staged))
        expected.append(_local_state(model, optimizers))
        _step(model, optimizers, data[step + 1])  # overwrites the shards while the write is in flight
    writer.close()
    same = []
    for step in range(2):
        restored = lr.fully_shard(make_model(seed=5), shard_granularity="row")
        restored_opts = _adamw(restored)
        ck.load(f"{root}/save{step}", restored, restored_opts)
        got = _local_state(restored, restored_opts)
        same.append(got.keys() == expected[step].keys() and all(torch.equal(got[k], v) for k, v in expected[step].items()))
    return {
        "tensors": len(staged[0]),
        "on_cpu": all(device == "cpu" for device, _ in staged[0] + staged[1]),
        "apart_from_live": not live & {ptr for _, ptr in staged[0]},
        "reused": staged[0] == staged[1],
        "saved_what_was_staged": same,
    }


def test_async_save_stages_into_reused_cpu_buffers(dist_pool, tmp_path) -> None:
    for result in dist_pool(2).run(check_async_staging_reuses_cpu_buffers, str(tmp_path)):
        assert result["tensors"] > 0 and result["on_cpu"] and result["apart_from_live"], result
        assert result["reused"], result
        assert result["saved_what_was_staged"] == [True, True], result


def test_compression_without_zstandard_is_a_clear_error(monkeypatch, tmp_path) -> None:
    from torch.distributed.checkpoint import _extension

    monkeypatch.setattr(_extension.ZStandard, "is_available", staticmethod(lambda: False))
    with pytest.raises(RuntimeError, match="pip install zstandard"):
        ck.save(tmp_path / "c", make_model(), compress=True)


# -------------------------------------------------------------------- consolidation
def test_consolidated_file_is_an_ordinary_checkpoint(reshard_root, tmp_path) -> None:
    path = Path(reshard_root, "w2-row-optimal")
    if not path.exists():
        pytest.skip("needs the 2-rank checkpoints of the resharding test")
    from lightning_ragged.cli.consolidate import main

    assert main([str(path), str(tmp_path / "out.ckpt")]) == 0
    checkpoint = torch.load(tmp_path / "out.ckpt", weights_only=True)  # plain torch, no lightning_ragged types
    plain = make_model(seed=9)
    plain.load_state_dict(checkpoint["state_dict"])
    direct = make_model(seed=8)
    ck.load(path, direct)
    for key, value in direct.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])  # torch's index-keyed layout
    assert checkpoint["step"] == 3
    assert main([str(path), str(tmp_path / "out.ckpt")]) == 1  # refuses to overwrite


class ScoresByName(dict):
    """A user's dict subclass: pytree does not walk it (module level so that a trusted load can import it)."""


def test_consolidation_refuses_tensors_it_cannot_reach(tmp_path) -> None:
    """A tensor inside a container pytree does not know would come out of the skip-data write empty:
    consolidation refuses (a named error, no output file) instead of writing a file that lacks data."""
    ck.save(tmp_path / "c", make_model(), extra={"scores": ScoresByName(best=torch.ones(2))})
    with pytest.raises(ck.CheckpointError, match=r"1 tensor\(s\) inside containers consolidation cannot walk"):
        ck.consolidate(tmp_path / "c", tmp_path / "out.ckpt", trust_checkpoint=True)
    assert not (tmp_path / "out.ckpt").exists()
    assert not list(tmp_path.glob(".out.ckpt*"))


def test_consolidation_keeps_the_tensors_of_meta_in_any_container(tmp_path) -> None:
    """Real tensors outside DCP (meta.pt: a callback's best score, ...) survive the skip-data write wherever they sit."""
    extra = {
        "best": torch.tensor(0.25),  # 0-D
        "scores": [torch.arange(3.0), {"inner": (torch.ones(2, 2), 7)}],  # a list holding a dict holding a tuple
        "by_epoch": {3: torch.full((2,), 5.0)},  # a dict keyed by int
    }
    ck.save(tmp_path / "c", make_model(), extra=extra)
    checkpoint = torch.load(ck.consolidate(tmp_path / "c", tmp_path / "out.ckpt"), weights_only=True)
    assert torch.equal(checkpoint["best"], extra["best"]) and checkpoint["best"].shape == ()
    assert torch.equal(checkpoint["scores"][0], extra["scores"][0])
    inner = checkpoint["scores"][1]["inner"]
    assert isinstance(inner, tuple) and torch.equal(inner[0], torch.ones(2, 2)) and inner[1] == 7
    assert torch.equal(checkpoint["by_epoch"][3], extra["by_epoch"][3])


# ------------------------------------------------------------------- 0-D parameters
class ScaledLM(TinyLM):
    """The tiny LM with a learnable 0-D logit scale (a temperature), used in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = torch.nn.Parameter(1.0 + torch.rand(()))  # seed-dependent: a load must overwrite it

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * self.logit_scale


def make_scaled_model(seed: int = 0) -> ScaledLM:
    torch.manual_seed(seed)
    return ScaledLM()


ZERO_DIM_SAVED_WITH = dict(shard_granularity="row")
ZERO_DIM_RESHARDED = dict(shard_granularity="element", planning_algorithm="greedy")
RESHARD_TOLERANCE = 1e-5  # what the resharding tests allow (fp32 sums in another order)


def _gathered(model, optimizer) -> dict[str, torch.Tensor]:
    """Full parameters (the engine's gather) and AdamW states (every rank's range put in place), by name.

    An oracle that goes through no checkpoint code: on a rank, a state shaped like the local
    shard is per-element, anything else (``step``) is whole.
    """
    full = {f"param.{name}": value.clone() for name, value in lr.full_state_dict(model).items()}
    params = dict(model.named_parameters())
    local = {}
    for name, param in params.items():
        for key, value in optimizer.state[param].items():
            per_element = value.shape == param.shape
            local[(name, key)] = (param.ragged_shard.local_range if per_element else None, value.detach().clone())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    for (name, key), (local_range, value) in local.items():
        if local_range is None:
            full[f"opt.{name}.{key}"] = value
            continue
        shard = params[name].ragged_shard
        flat = torch.empty(shard.numel, dtype=value.dtype)
        for rank_state in everyone:
            (start, end), piece = rank_state[(name, key)]
            flat[start:end] = piece
        full[f"opt.{name}.{key}"] = flat.view(shard.global_shape)
    return full


def _plain_state(model, optimizer) -> dict[str, torch.Tensor]:
    """The same keys as ``_gathered`` for an unsharded model."""
    full = {f"param.{name}": value.detach().clone() for name, value in model.state_dict().items()}
    for name, param in model.named_parameters():
        for key, value in optimizer.state[param].items():
            full[f"opt.{name}.{key}"] = value.detach().clone()
    return full


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    assert all(a[k].shape == b[k].shape for k in a), [(k, a[k].shape, b[k].shape) for k in a if a[k].shape != b[k].shape]
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _plain_zero_dim_run(root: str) -> dict[int, dict[str, torch.Tensor]]:
    """The independent oracle: the unsharded model and torch's AdamW on the global batch, 6 steps.

    Writes its step-3 state as an ordinary torch checkpoint and as a directory saved from the
    plain module (neither holds a record of which 0-D states are per-element).
    """
    data = make_batches(6, BATCH)
    model = make_scaled_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    states = {}
    for step in range(6):
        lm_loss(model, data[step]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == 3:
            states[3] = _plain_state(model, optimizer)
            torch.save(
                {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "step": 3},
                f"{root}/plain-3.ckpt",
            )
            ck.save(f"{root}/plain-3", model, [optimizer], {"step": 3})
    states[6] = _plain_state(model, optimizer)
    return states


def check_zero_dim_save(root: str, tag: str) -> dict:
    """3 AdamW steps sharded, then a sharded and a full save, then 3 more steps."""
    data = make_batches(6, BATCH)
    model = lr.fully_shard(make_scaled_model(), **ZERO_DIM_SAVED_WITH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        _step(model, [optimizer], data[step])
    ck.save(f"{root}/{tag}", model, [optimizer], {"step": 3})
    ck.save(f"{root}/{tag}-full.ckpt", model, [optimizer], {"step": 3}, full=True)
    at3 = _gathered(model, optimizer)
    for step in range(3, 6):
        _step(model, [optimizer], data[step])
    return {
        "at3": at3,
        "at6": _gathered(model, optimizer),
        "local": _local_state(model, [optimizer]),
        "scale_local_numel": model.logit_scale.numel(),
    }


def check_zero_dim_resume(root: str, sources: list[str], sharding: dict) -> dict:
    """For each saved source: a fresh model (other init) loads it here and trains to step 6."""
    data = make_batches(6, BATCH)
    results = {}
    for source in sources:
        model = lr.fully_shard(make_scaled_model(seed=7), **sharding)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        extra = ck.load(f"{root}/{source}", model, [optimizer])
        for step in range(extra["step"], 6):
            _step(model, [optimizer], data[step])
        results[source] = {"final": _gathered(model, optimizer), "local": _local_state(model, [optimizer])}
    return results


def _muon_with_aux_adamw(model):
    from lightning_ragged.optim import MuonWithAuxAdamW, muon_param_groups

    return [MuonWithAuxAdamW(muon_param_groups(model, muon=dict(lr=2e-2), adamw=dict(lr=1e-2)))]


def _scale_on_its_own(model):
    """AdamW for the rest and one for the 0-D scale alone: no other parameter shows its state's layout."""
    rest = [p for name, p in model.named_parameters() if name != "logit_scale"]
    return [torch.optim.AdamW(rest, lr=1e-2), torch.optim.AdamW([model.logit_scale], lr=5e-2)]


def check_zero_dim_other_optimizers(root: str) -> dict:
    """A ragged optimizer (its AdamW group holds the scale) and an optimizer of the scale alone:
    the directory and the full file resume bit-identically; a plain torch state of the scale alone
    (no record of which entries are per-element) is refused with a clear message."""
    data = make_batches(6, BATCH)
    same = {}
    for kind, make_optimizers in (("muon", _muon_with_aux_adamw), ("alone", _scale_on_its_own)):
        model = lr.fully_shard(make_scaled_model(), **ZERO_DIM_SAVED_WITH)
        optimizers = make_optimizers(model)
        for step in range(6):
            if step == 3:
                ck.save(f"{root}/{kind}", model, optimizers, {"step": 3})
                ck.save(f"{root}/{kind}-full.ckpt", model, optimizers, {"step": 3}, full=True)
            _step(model, optimizers, data[step])
        uninterrupted = _local_state(model, optimizers)
        for source in (kind, f"{kind}-full.ckpt"):
            model = lr.fully_shard(make_scaled_model(seed=7), **ZERO_DIM_SAVED_WITH)
            optimizers = make_optimizers(model)
            ck.load(f"{root}/{source}", model, optimizers)
            for step in range(3, 6):
                _step(model, optimizers, data[step])
            got = _local_state(model, optimizers)
            same[source] = got.keys() == uninterrupted.keys() and all(torch.equal(got[k], uninterrupted[k]) for k in got)
    plain = make_scaled_model()
    plain_optimizers = _scale_on_its_own(plain)
    lm_loss(plain, data[0]).backward()
    for optimizer in plain_optimizers:
        optimizer.step()
    if dist.get_rank() == 0:
        torch.save({"state_dict": plain.state_dict(), "optimizer_states": [o.state_dict() for o in plain_optimizers]},
                   f"{root}/alone-plain.ckpt")
    dist.barrier()
    model = lr.fully_shard(make_scaled_model(seed=7), **ZERO_DIM_SAVED_WITH)
    with pytest.raises(ck.CheckpointMismatchError, match=r"0-D parameters that cannot be told apart.*'logit_scale'"):
        ck.load(f"{root}/alone-plain.ckpt", model, _scale_on_its_own(model))
    return same


@pytest.fixture(scope="module")
def zero_dim(dist_pool):
    """The plain oracle, and 2- and 3-rank runs that saved at step 3 (per-rank results)."""
    root = tempfile.mkdtemp(prefix="ragged_zero_dim_")
    oracle = _plain_zero_dim_run(root)
    saved = {world: dist_pool(world).run(check_zero_dim_save, root, f"z{world}") for world in (2, 3)}
    yield root, oracle, saved
    shutil.rmtree(root, ignore_errors=True)


def test_zero_dim_parameter_trains_sharded_like_the_plain_model(zero_dim) -> None:
    _, oracle, saved = zero_dim
    for world, ranks in saved.items():
        assert sorted(rank["scale_local_numel"] for rank in ranks) == [0] * (world - 1) + [1]  # one owner
        for step in (3, 6):
            assert _worst(ranks[0][f"at{step}"], oracle[step]) < RESHARD_TOLERANCE, (world, step)
    assert oracle[6]["param.logit_scale"].shape == () and oracle[6]["opt.logit_scale.exp_avg"].shape == ()
    assert oracle[6]["param.logit_scale"] != make_scaled_model().logit_scale  # it trains


def test_zero_dim_parameter_resumes_bit_identically_at_the_same_world_size(dist_pool, zero_dim) -> None:
    root, _, saved = zero_dim
    for world in (2, 3):
        sources = [f"z{world}", f"z{world}-full.ckpt"]
        resumed = dist_pool(world).run(check_zero_dim_resume, root, sources, ZERO_DIM_SAVED_WITH)
        for rank, (got, expected) in enumerate(zip(resumed, saved[world])):
            for source in sources:
                local = got[source]["local"]
                assert local.keys() == expected["local"].keys(), (world, source)
                different = [k for k in local if not torch.equal(local[k], expected["local"][k])]
                assert not different, (world, rank, source, different)
        assert _worst(resumed[0][sources[0]]["final"], saved[world][0]["at6"]) == 0.0


@pytest.mark.parametrize(
    "saved_at,resumed_at,sources",
    [(2, 3, ["z2", "plain-3.ckpt", "plain-3"]), (3, 2, ["z3", "z3-full.ckpt"]), (2, 1, ["z2"])],
)
def test_zero_dim_parameter_reshards(dist_pool, zero_dim, saved_at: int, resumed_at: int, sources: list[str]) -> None:
    root, oracle, saved = zero_dim
    resumed = dist_pool(resumed_at).run(check_zero_dim_resume, root, sources, ZERO_DIM_RESHARDED)[0]
    for source in sources:
        final = resumed[source]["final"]
        reference = oracle[6] if source.startswith("plain") else saved[saved_at][0]["at6"]
        assert _worst(final, reference) < RESHARD_TOLERANCE, source
        assert _worst(final, oracle[6]) < RESHARD_TOLERANCE, source


def test_zero_dim_parameter_keeps_its_shape_in_full_and_consolidated_files(zero_dim, tmp_path) -> None:
    from lightning_ragged.cli.consolidate import main

    root, oracle, saved = zero_dim
    assert main([f"{root}/z3", str(tmp_path / "z3.ckpt")]) == 0  # python -m lightning_ragged.consolidate
    data = make_batches(6, BATCH)
    for file, world in ((f"{root}/z2-full.ckpt", 2), (tmp_path / "z3.ckpt", 3)):
        checkpoint = torch.load(file, weights_only=True)
        assert checkpoint["state_dict"]["logit_scale"].shape == ()
        plain = make_scaled_model(seed=9)
        plain.load_state_dict(checkpoint["state_dict"], strict=True)
        optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        optimizer.load_state_dict(checkpoint["optimizer_states"][0])  # torch's index-keyed layout
        assert optimizer.state[plain.logit_scale]["exp_avg"].shape == ()
        assert _worst(_plain_state(plain, optimizer), saved[world][0]["at3"]) == 0.0, file  # equal to the gather
        for step in range(3, 6):  # and an ordinary resume from it continues the uninterrupted run
            lm_loss(plain, data[step]).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert _worst(_plain_state(plain, optimizer), oracle[6]) < RESHARD_TOLERANCE, file


def test_zero_dim_sharded_checkpoint_loads_into_a_plain_module(zero_dim) -> None:
    root, _, saved = zero_dim
    plain = make_scaled_model(seed=3)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    ck.load(f"{root}/z3", plain, [optimizer])
    assert plain.logit_scale.shape == () and optimizer.state[plain.logit_scale]["exp_avg"].shape == ()
    assert _worst(_plain_state(plain, optimizer), saved[3][0]["at3"]) == 0.0


def test_zero_dim_parameter_under_a_ragged_optimizer_and_an_optimizer_of_its_own(dist_pool, tmp_path) -> None:
    for same in dist_pool(2).run(check_zero_dim_other_optimizers, str(tmp_path)):
        assert all(same.values()), same


# ------------------------------------------------------------- bad checkpoints
@pytest.fixture()
def saved(tmp_path) -> Path:
    """A small single-process checkpoint to break in various ways."""
    model = make_model()
    ck.save(tmp_path / "good", model, [torch.optim.AdamW(model.parameters())], {"step": 1})
    return tmp_path / "good"


def test_missing_checkpoint_names_the_path(tmp_path) -> None:
    with pytest.raises(ck.MissingCheckpointError, match="no checkpoint at .*nowhere"):
        ck.load(tmp_path / "nowhere", make_model())


def test_unfinished_save_is_reported_and_not_a_checkpoint(saved) -> None:
    partial = ck.partial_path(saved.parent / "next")
    shutil.copytree(saved, partial)
    with pytest.raises(ck.MissingCheckpointError, match="did not finish"):
        ck.load(saved.parent / "next", make_model())


def test_missing_meta_means_incomplete(saved) -> None:
    (saved / ck.META_FILENAME).unlink()
    with pytest.raises(ck.CorruptCheckpointError, match="meta.pt' is missing"):
        ck.load(saved, make_model())


def test_truncated_data_file_is_detected_before_loading(saved) -> None:
    data = next(saved.glob("*.distcp"))
    with open(data, "r+b") as handle:
        handle.truncate(data.stat().st_size // 2)
    model = make_model(seed=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ck.CorruptCheckpointError, match=f"truncated: data file {data.name}"):
        ck.load(saved, model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched


def test_unreadable_format_version(saved) -> None:
    meta = torch.load(saved / ck.META_FILENAME, weights_only=True)
    meta[ck.FORMAT_KEY]["format_version"] = ck.FORMAT_VERSION + 1
    torch.save(meta, saved / ck.META_FILENAME)
    with pytest.raises(ck.CheckpointVersionError, match=f"format version {ck.FORMAT_VERSION + 1}"):
        ck.load(saved, make_model())


def test_different_model_names_keys_and_shapes(saved) -> None:
    other = make_model()
    other.extra = torch.nn.Linear(2, 2)
    other.pos = torch.nn.Parameter(torch.zeros(7, 13))
    del other.norm
    with pytest.raises(ck.CheckpointMismatchError) as error:
        ck.load(saved, other)
    message = str(error.value)
    assert "missing keys" in message and "extra.weight" in message
    assert "unexpected keys" in message and "norm.weight" in message
    assert "shape mismatch" in message and "pos: checkpoint [6, 13] vs model [7, 13]" in message


def test_weights_only_checkpoint_says_optimizer_state_is_absent(tmp_path) -> None:
    model = make_model()
    ck.save(tmp_path / "w", model)
    with pytest.raises(ck.CheckpointMismatchError, match="saved with weights only"):
        ck.load(tmp_path / "w", make_model(), [torch.optim.AdamW(model.parameters())])


def test_remove_checkpoint_handles_dirs_files_and_links(saved) -> None:
    link = saved.parent / "last.ckpt"
    link.symlink_to(saved, target_is_directory=True)
    ck.remove_checkpoint(link)
    assert saved.is_dir() and not link.exists()
    ck.remove_checkpoint(saved)
    assert not saved.exists() and not list(saved.parent.glob(".ragged*"))


# ------------------------------------------------------------ SIGKILL mid-save
def _crash_worker(rank: int, root: str, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model = lr.fully_shard(make_model(), shard_granularity="row")
    optimizers = _adamw(model)
    data = make_batches(2, BATCH)
    _step(model, optimizers, data[0])
    ck.save(f"{root}/epoch=0-step=1.ckpt", model, optimizers, {"step": 1})
    ck.save(f"{root}/last.ckpt", model, optimizers, {"step": 1})
    _step(model, optimizers, data[1])
    if rank == 1:  # die in the middle of writing this rank's shards
        from torch.distributed.checkpoint import filesystem

        original = filesystem._write_item

        def write_then_die(*args, **kwargs):
            result = original(*args, **kwargs)
            args[1].flush()
            os.kill(os.getpid(), signal.SIGKILL)
            return result

        filesystem._write_item = write_then_die
    ck.save(f"{root}/last.ckpt", model, optimizers, {"step": 2})


def test_sigkill_mid_save_keeps_the_previous_checkpoint(tmp_path) -> None:
    context = mp.get_context("spawn")
    init_file = tempfile.mktemp(prefix="ragged_crash_")
    workers = [context.Process(target=_crash_worker, args=(rank, str(tmp_path), init_file)) for rank in range(2)]
    for worker in workers:
        worker.start()
    workers[1].join(timeout=120)
    assert workers[1].exitcode == -signal.SIGKILL
    workers[0].join(timeout=5)
    if workers[0].is_alive():  # blocked in a collective with the dead rank
        workers[0].kill()
        workers[0].join()
    if os.path.exists(init_file):
        os.remove(init_file)

    assert ck.partial_path(tmp_path / "last.ckpt").exists()  # the torn save is there, hidden
    plain = make_model(seed=5)
    extra = ck.load(tmp_path / "last.ckpt", plain, [torch.optim.AdamW(plain.parameters())])
    assert extra["step"] == 1  # the previous, complete checkpoint

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.states import TrainerFn

    callback = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer = Trainer(callbacks=[callback], logger=False, enable_progress_bar=False, enable_model_summary=False)
    chosen = trainer._checkpoint_connector._parse_ckpt_path(TrainerFn.FITTING, "last", True, True)
    assert Path(chosen) == tmp_path / "last.ckpt"


# ------------------------------------------------------------------- parameters with no elements
class EmptyParamLM(TinyLM):
    """The tiny LM with a parameter of shape (3, 0) (a slot sized by a config value of 0), used in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.empty = torch.nn.Parameter(torch.zeros(3, 0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) + self.empty.sum()


def check_empty_parameter_round_trip(root: str) -> dict:
    """Saved at step 2 (no rank holds an element of ``empty``: before, its key was in no file and the load
    refused the checkpoint as "missing keys ... empty"); a fresh model loads it and trains to step 4."""
    data = make_batches(4, BATCH)
    runs = {}
    for resumed in (False, True):
        torch.manual_seed(0)
        model = lr.fully_shard(EmptyParamLM())
        optimizers = _adamw(model)
        for step in range(4):
            if step == 2 and resumed:
                ck.save(f"{root}/empty", model, optimizers, {"step": 2})
                torch.manual_seed(7)
                model = lr.fully_shard(EmptyParamLM())
                optimizers = _adamw(model)
                ck.load(f"{root}/empty", model, optimizers)
            _step(model, optimizers, data[step])
        runs[resumed] = _local_state(model, optimizers)
    plain = EmptyParamLM()
    ck.load(f"{root}/empty", plain)  # an unsharded module loads it too
    same = runs[True].keys() == runs[False].keys() and all(torch.equal(runs[True][k], runs[False][k]) for k in runs[True])
    return {"same": same, "plain_shape": tuple(plain.empty.shape)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_parameter_with_no_elements_saves_and_resumes(dist_pool, tmp_path, world_size) -> None:
    for result in dist_pool(world_size).run(check_empty_parameter_round_trip, str(tmp_path)):
        assert result == {"same": True, "plain_shape": (3, 0)}, result
