"""The FSDP2 surface of ``fully_shard``: module methods, ``reshard_after_forward=int``, guards,
submodule state dicts, aligned views, grouping of every stack, re-recorded prefetch order.

Parity checks compare with single-process training (``tests/test_fully_shard.py``'s oracle).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_ragged as lr
from lightning_ragged.engine.grouping import stack_blocks
from tests.models import SEQ, WIDTH, TinyBlock, lm_loss, make_batches, make_model, shard_grad_diff
from tests.test_fp8_gather import _IssuedCollectives
from tests.test_fully_shard import BATCH, _local, check_training_matches_single_process


def check_reshard_to_smaller_group(size: int) -> dict:
    """After forward each block keeps 1/size of its full buffer; backward re-gathers it in place."""
    model = lr.fully_shard(make_model(), reshard_after_forward=size)
    state = lr.get_state(model)
    loss = lm_loss(model, _local(make_batches(1, BATCH)[0]))
    kept = [
        (b.is_unsharded, None if b._partial is None else b._partial.numel(), b.layout.buffer_numel)
        for g in state.groups for b in g.dbuffers
    ]
    loss.backward()
    left = [b._partial is not None or b.is_unsharded for b in state.dbuffers()]
    return {"kept": kept, "left": left}


def test_reshard_after_forward_int_keeps_a_part_and_trains_exactly(dist_pool):
    pool = dist_pool(4)
    for rank_result in pool.run(check_reshard_to_smaller_group, 2):
        assert rank_result["kept"]
        for unsharded, kept, total in rank_result["kept"]:
            assert not unsharded and kept == total // 2  # a 2-rank group re-gathers the whole buffer
        assert not any(rank_result["left"])
    results = pool.run(check_training_matches_single_process, dict(reshard_after_forward=2), False, 8)
    assert max(r["max_diff"] for r in results) <= 1e-5, results[0]


def check_reshard_to_smaller_group_after_reinit(init_file: str) -> list[float]:
    """A notebook's second run: the default group destroyed and initialized again, then the same training. The
    smaller groups were cached by ranks only: the second run got the destroyed ones ("Group ... is not
    registered" at its first forward)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for session in range(2):
        if session:
            dist.destroy_process_group()
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        model = lr.fully_shard(make_model(), reshard_after_forward=2)
        loss = lm_loss(model, _local(make_batches(1, BATCH)[0]))
        loss.backward()
        losses.append(loss.item())
    return losses


def test_reshard_after_forward_int_after_the_process_group_is_initialized_again(tmp_path):
    from tests.distributed import DistributedPool

    pool = DistributedPool(4)  # its own: the default group is replaced in it
    try:
        for first, second in pool.run(check_reshard_to_smaller_group_after_reinit, str(tmp_path / "init")):
            assert first == second, (first, second)  # the same model and batch in both runs
    finally:
        pool.stop()
        pool.close()


def check_partial_gathers_named() -> dict:
    """Every all-gather a step issues with ``reshard_after_forward=2``, looked up in the flight recorder's names."""
    from lightning_ragged.observability import flight_recorder

    # the flight recorder is NCCL's: the backend's all-gathers it records (gloo's CPU default sends point to point)
    model = lr.fully_shard(make_model(), reshard_after_forward=2, gather_mode="all_gather")
    signatures = flight_recorder.collective_signatures((repr(i), b) for i, b in enumerate(lr.get_state(model).dbuffers()))
    with _IssuedCollectives() as issued:
        lm_loss(model, _local(make_batches(1, BATCH)[0])).backward()
    smaller = {("all_gather", b.layout.buffer_numel // 2, b.layout.buffer_numel) for b in lr.get_state(model).dbuffers()}
    return {"unnamed": [key for key in issued.seen if key not in signatures], "smaller": set(issued.seen) & smaller}


def test_flight_recorder_names_the_smaller_group_re_gathers(dist_pool):
    for result in dist_pool(4).run(check_partial_gathers_named):
        assert result["smaller"]  # the backward did gather in the 2-rank groups (not the 4-rank shard group)
        assert result["unnamed"] == [], result


def check_reshard_after_forward_values() -> dict:
    state = lr.get_state(lr.fully_shard(make_model(), reshard_after_forward=2))  # = world size: True
    keep = lr.get_state(lr.fully_shard(make_model(), reshard_after_forward=1))  # = False
    default = lr.get_state(lr.fully_shard(make_model(), reshard_after_forward=None))  # FSDP2's default
    with pytest.raises(ValueError, match="reshard_after_forward=3 must be a bool, None .* or an int that divides"):
        lr.fully_shard(make_model(), reshard_after_forward=3)
    return {"two": state.groups[0].reshard_after_forward, "one": keep.groups[0].reshard_after_forward,
            "none": default.groups[0].reshard_after_forward}


def test_reshard_after_forward_int_edge_values(dist_pool):
    assert dist_pool(2).run(check_reshard_after_forward_values)[0] == {"two": True, "one": False, "none": None}


def check_module_methods() -> dict:
    """FSDP2's methods on the model and on each group's module."""
    model = lr.fully_shard(make_model())
    block = model.blocks[0]
    assert isinstance(model, lr.FSDPModule) and isinstance(block, lr.FSDPModule) and isinstance(block, TinyBlock)
    sharded_shape = tuple(block.up.weight.shape)
    block.unshard()
    full_shape = tuple(block.up.weight.shape)
    root_untouched = tuple(model.blocks[1].up.weight.shape)  # not recursive, as FSDP2
    block.reshard()
    handle = block.unshard(async_op=True)
    handle.wait()  # FSDP2's handle: the module computes with full parameters from here on
    async_full = tuple(block.up.weight.shape)
    async_values = block.up.weight.detach().clone()
    block.reshard()
    same_values = torch.equal(async_values, make_model().blocks[0].up.weight)  # the unsharded model's (same seed)
    block.set_modules_to_forward_prefetch([model.blocks[1]])
    model.blocks[1].set_modules_to_backward_prefetch([block])
    with pytest.raises(ValueError, match="not a group of this sharded model"):
        block.set_modules_to_forward_prefetch([nn.Linear(2, 2)])
    return {"sharded": sharded_shape, "full": full_shape, "other": root_untouched,
            "after": tuple(block.up.weight.shape), "async_full": async_full, "same_values": same_values}


def test_module_methods(dist_pool):
    result = dist_pool(2).run(check_module_methods)[0]
    assert result["full"] == (7, 13) and len(result["sharded"]) == 1 and len(result["other"]) == 1
    assert result["after"] == result["sharded"]
    assert result["async_full"] == (7, 13) and result["same_values"]


def check_optimizer_built_before_sharding() -> dict:
    """An optimizer built before fully_shard holds the replaced parameters: its step is refused, not a silent no-op
    (FSDP2's outcome: the parameters never change); one built after, or given the shards later, steps."""
    model = make_model()
    early = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lr.fully_shard(model)
    lm_loss(model, _local(make_batches(1, BATCH)[0])).backward()
    with pytest.raises(ValueError, match=r"AdamW holds \d+ parameters that lightning_ragged.fully_shard replaced by "
                                         r"its shards \(e.g. '.*'\).*Build the optimizer after fully_shard"):
        early.step()
    before = [p.detach().clone() for p in model.parameters()]
    late = torch.optim.AdamW(model.parameters(), lr=1e-2)
    late.step()
    moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    late.add_param_group({"params": [early.param_groups[0]["params"][0]]})  # a replaced one, added later
    with pytest.raises(ValueError, match="AdamW holds 1 parameters"):
        late.step()
    return {"moved": moved}


def test_optimizer_built_before_sharding_is_refused_at_its_step(dist_pool):
    assert all(result["moved"] for result in dist_pool(2).run(check_optimizer_built_before_sharding))


def check_loop_with_module_methods(steps: int = 3) -> dict:
    """An FSDP2-style accumulation loop (sync off and full parameters kept on the first micro-batch,
    explicit prefetch) against single-process training on the global batch."""
    data = make_batches(steps, BATCH)
    reference = make_model()
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model = lr.fully_shard(make_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
    model.blocks[1].set_modules_to_backward_prefetch([model.blocks[0]])
    state = lr.get_state(model)
    kept_unsharded = []
    for step in range(steps):
        local = _local(data[step])
        first, second = local.chunk(2)
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        (lm_loss(model, first) * len(first) / len(local)).backward()
        kept_unsharded.append(all(g.is_unsharded for g in state.groups))
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        (lm_loss(model, second) * len(second) / len(local)).backward()
        opt.step()
        opt.zero_grad()
        lm_loss(reference, data[step]).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    full, expected = lr.full_state_dict(model), reference.state_dict()
    return {"max_diff": max((full[k] - expected[k]).abs().max().item() for k in expected),
            "kept_unsharded": kept_unsharded, "left": [b.is_unsharded for b in state.dbuffers()]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_style_loop_with_module_methods_trains_exactly(dist_pool, world_size):
    for result in dist_pool(world_size).run(check_loop_with_module_methods):
        assert result["max_diff"] <= 1e-5, result
        assert all(result["kept_unsharded"]) and not any(result["left"])


def check_gradient_sync_per_module(target: str) -> dict:
    """FSDP2's ``set_requires_gradient_sync`` is per module: off for ``blocks[0]`` (recurse) or for the root's own
    parameters (``recurse=False``) on the first micro-batch, those accumulate unreduced (``grad is None``, as
    FSDP2's), the rest is reduced at once (its gradients equal one process's on the global first micro-batch);
    the second micro-batch, synchronized, reduces them all: the step equals one process's on the whole batch."""
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    data = make_batches(2, BATCH)
    reference, model, fsdp2 = make_model(), lr.fully_shard(make_model()), make_model()
    for block in fsdp2.blocks:
        fsdp2_shard(block)
    fsdp2_shard(fsdp2)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, model, fsdp2)]
    first_diff, unreduced = 0.0, {}
    for step in range(2):
        local = _local(data[step])
        first, second = local.chunk(2)
        share = len(first) / len(local)
        for net in (fsdp2, model):  # ours last: ``reduced`` holds its gradients after the first micro-batch
            off = net.blocks[0].set_requires_gradient_sync if target == "block" else net.set_requires_gradient_sync
            off(False) if target == "block" else off(False, recurse=False)
            (lm_loss(net, first) * share).backward()
            unreduced[net is model] = sorted(name for name, p in net.named_parameters() if p.grad is None)
            reduced = {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}
            net.set_requires_gradient_sync(True)
            (lm_loss(net, second) * (1 - share)).backward()
        firsts = torch.cat([part.chunk(2)[0] for part in data[step].chunk(dist.get_world_size())])
        lm_loss(reference, firsts).backward()  # the ranks' first halves as one batch: what was reduced at once
        references = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            start, end = param.ragged_shard.local_range
            if name in reduced and end > start:
                expected = references[name].grad.reshape(-1)[start:end] * share
                first_diff = max(first_diff, (reduced[name] - expected).abs().max().item())
        reference.zero_grad()
        lm_loss(reference, data[step]).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    full, expected = lr.full_state_dict(model), reference.state_dict()
    return {"diff": max((full[k] - expected[k]).abs().max().item() for k in expected), "first_diff": first_diff,
            "unreduced": unreduced[True], "fsdp2_unreduced": unreduced[False]}


@pytest.mark.parametrize("target", ["block", "root-only"])
def test_gradient_sync_is_set_per_module_as_fsdp2(dist_pool, target):
    for result in dist_pool(2).run(check_gradient_sync_per_module, target):
        expected = ["blocks.0."] if target == "block" else ["embed.", "norm.", "pos"]
        assert result["unreduced"] == result["fsdp2_unreduced"], result
        assert result["unreduced"] and all(n.startswith(tuple(expected)) for n in result["unreduced"]), result
        assert result["first_diff"] <= 1e-6 and result["diff"] <= 1e-5, result


def check_group_members_are_fsdp_modules() -> dict:
    """Blocks sharded two per group (``blocks_per_group=2``) vs torch's ``fully_shard([block0, block1])``: every
    member is an FSDPModule of one class per block class (a compiled block then shares one graph, no type
    recompile), and the second member's methods act on the group it shares: ``set_requires_gradient_sync(False)``
    on ``blocks[1]`` leaves both blocks' gradients unreduced (``grad is None``), as FSDP2's."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    model = lr.fully_shard(make_model(layers=4), blocks_per_group=2)
    fsdp2 = make_model(layers=4)
    for pair in (fsdp2.blocks[:2], fsdp2.blocks[2:]):
        fsdp2_shard(list(pair))
    fsdp2_shard(fsdp2)
    result: dict = {}
    for name, net, fsdp_class in (("ours", model, lr.FSDPModule), ("fsdp2", fsdp2, TorchFSDPModule)):
        result[f"{name}_members"] = [isinstance(block, fsdp_class) for block in net.blocks]
        result[f"{name}_classes"] = len({type(block) for block in net.blocks})
        net.blocks[1].set_requires_gradient_sync(False)
        lm_loss(net, _local(make_batches(1, BATCH)[0])).backward()
        result[f"{name}_unreduced"] = sorted({n.split(".")[1] for n, p in net.named_parameters() if p.grad is None})
    return result


def test_every_member_of_a_group_is_an_fsdp_module_as_fsdp2(dist_pool):
    result = dist_pool(2).run(check_group_members_are_fsdp_modules)[0]
    assert result["ours_members"] == result["fsdp2_members"] == [True] * 4, result
    assert result["ours_classes"] == result["fsdp2_classes"] == 1, result
    assert result["ours_unreduced"] == result["fsdp2_unreduced"] == ["0", "1"], result


def check_fsdp2_arguments(mesh_shape: tuple[int, ...]) -> dict:
    """FSDP2's arguments: a ``mesh`` (1-D: shard over it; 2-D: replicate over dim 0, shard over dim 1) with
    ``reshard_after_forward=None`` and the no-op ``offload_policy`` / ``ignored_params`` train as one process; the
    ones not implemented are refused by name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    mesh = init_device_mesh("cpu", mesh_shape)
    given = {"mesh": mesh, "reshard_after_forward": None, "offload_policy": OffloadPolicy(), "ignored_params": set()}
    trained = check_training_matches_single_process(given)
    dbuffer = next(lr.get_state(lr.fully_shard(make_model(), mesh=mesh)).dbuffers())
    refusals = {}
    for name, value in (("offload_policy", CPUOffloadPolicy()), ("ignored_params", {nn.Parameter(torch.ones(1))}),
                        ("shard_placement_fn", lambda param: None), ("process_group", dist.group.WORLD)):
        try:
            lr.fully_shard(make_model(), **{name: value, "mesh": mesh} if name == "process_group" else {name: value})
            refusals[name] = None
        except ValueError as error:
            refusals[name] = str(error)
    return {"diff": trained["max_diff"], "shard_world": dbuffer.world_size,
            "replicas": 1 if dbuffer.replicate_group is None else dist.get_world_size(dbuffer.replicate_group),
            "refusals": refusals}


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 1), (1, 2)])
def test_fsdp2_mesh_and_arguments(dist_pool, mesh_shape):
    for result in dist_pool(2).run(check_fsdp2_arguments, mesh_shape):
        assert result["diff"] <= 1e-5, result
        assert result["shard_world"] == mesh_shape[-1], result
        assert result["replicas"] == (mesh_shape[0] if len(mesh_shape) == 2 else 1), result
        refusals = result["refusals"]
        assert "offload_policy=CPUOffloadPolicy" in refusals["offload_policy"], refusals
        assert "ignored_params" in refusals["ignored_params"] and "requires_grad=False" in refusals["ignored_params"]
        assert "shard_granularity" in refusals["shard_placement_fn"], refusals
        assert "not both" in refusals["process_group"], refusals


def check_gradient_divide_factor(mesh_shape: tuple[int, ...]) -> dict:
    """FSDP2's ``set_gradient_divide_factor`` is per module (its own group only): the root's parameters summed
    (1.0), ``blocks[0]``'s divided by 3, ``blocks[1]``'s averaged. Two oracles: torch's FSDP2 with the same
    factors (1-D mesh), and one process's gradients on the global batch times data-parallel size / factor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    mesh = init_device_mesh("cpu", mesh_shape)
    local = _local(make_batches(1, BATCH)[0])
    reference, model = make_model(), lr.fully_shard(make_model(), mesh=mesh)
    nets = [model]
    if len(mesh_shape) == 1:
        fsdp2 = make_model()
        for block in fsdp2.blocks:
            fsdp2_shard(block, mesh=mesh)
        nets.append(fsdp2_shard(fsdp2, mesh=mesh))
        for sharded in (fsdp2, *fsdp2.blocks):  # gloo has no PREMUL_SUM: FSDP2 sums, then divides
            sharded.set_force_sum_reduction_for_comms(True)
    for net in nets:
        net.set_gradient_divide_factor(1.0)
        net.blocks[0].set_reduce_scatter_divide_factor(3)  # FSDP2's older name
        lm_loss(net, local).backward()
    lm_loss(reference, make_batches(1, BATCH)[0]).backward()
    factors = {"blocks.0.": 3.0, "blocks.1.": dist.get_world_size() / 1.0}
    references, diff, fsdp2_diff = dict(reference.named_parameters()), 0.0, 0.0
    for name, param in model.named_parameters():
        factor = next((f for prefix, f in factors.items() if name.startswith(prefix)), 1.0)
        expected = references[name].grad.reshape(-1) * dist.get_world_size() / factor
        start, end = param.ragged_shard.local_range
        diff = max(diff, (param.grad - expected[start:end]).abs().max().item() if end > start else 0.0)
    if len(nets) == 2:
        full = {name: p.grad.full_tensor() for name, p in nets[1].named_parameters()}
        for name, param in model.named_parameters():
            start, end = param.ragged_shard.local_range
            if end > start:
                fsdp2_diff = max(fsdp2_diff, (param.grad - full[name].reshape(-1)[start:end]).abs().max().item())
    with pytest.raises(ValueError, match="positive number"):
        model.set_gradient_divide_factor(0)
    return {"diff": diff, "fsdp2_diff": fsdp2_diff, "compared_fsdp2": len(nets) == 2}


@pytest.mark.parametrize("world_size, mesh_shape", [(2, (2,)), (3, (3,)), (2, (2, 1))])
def test_gradient_divide_factor_per_module_as_fsdp2(dist_pool, world_size, mesh_shape):
    for result in dist_pool(world_size).run(check_gradient_divide_factor, mesh_shape):
        assert result["diff"] <= 1e-6 and result["fsdp2_diff"] <= 1e-6, result
        assert result["compared_fsdp2"] == (len(mesh_shape) == 1), result


def check_hsdp_accumulation_without_all_reduce(mesh_shape: tuple[int, int]) -> dict:
    """FSDP2's HSDP accumulation: micro-batch 1 with ``set_requires_all_reduce(False)`` (the shard group reduces,
    the replicas do not: its sum is held, no gradient is written), micro-batch 2 with True (the held sum joins
    its all-reduce). 2 AdamW steps against one process on the global batch and against torch's FSDP2 (same
    mesh, same calls): gradients and parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    data = make_batches(2, 2 * dist.get_world_size())
    reference, model, fsdp2 = make_model(), lr.fully_shard(make_model(), mesh=mesh), make_model()
    for block in fsdp2.blocks:
        fsdp2_shard(block, mesh=mesh)
    fsdp2_shard(fsdp2, mesh=mesh)
    optimizers = [torch.optim.AdamW(net.parameters(), lr=1e-2) for net in (reference, model, fsdp2)]
    stats = lr.get_state(model).stats
    held_grads, held_replica_all_reduces, last_replica_all_reduces, grad_diff = [], [], [], 0.0
    for batch in data:
        lm_loss(reference, batch).backward()
        for index, micro in enumerate(_local(batch).chunk(2)):
            before = stats.replica_all_reduces
            for net in (model, fsdp2):
                net.set_requires_all_reduce(index == 1)
                (lm_loss(net, micro) / 2).backward()
            if index == 0:
                held_grads += [p.grad is not None for net in (model, fsdp2) for p in net.parameters()]
                held_replica_all_reduces.append(stats.replica_all_reduces - before)
            else:
                last_replica_all_reduces.append(stats.replica_all_reduces - before)
        grad_diff = max(grad_diff, shard_grad_diff(model, reference))
        full = {name: p.grad.full_tensor().reshape(-1) for name, p in fsdp2.named_parameters()}
        for name, param in model.named_parameters():
            start, end = param.ragged_shard.local_range
            if end > start:
                grad_diff = max(grad_diff, (param.grad - full[name][start:end]).abs().max().item())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    full = lr.full_state_dict(model)
    fsdp2_full = {name: p.full_tensor() for name, p in fsdp2.named_parameters()}
    param_diff = max(max((full[name] - p).abs().max().item(), (fsdp2_full[name] - p).abs().max().item())
                     for name, p in reference.named_parameters())
    return {"grad_diff": grad_diff, "param_diff": param_diff, "held_grads": any(held_grads),
            "held_replica_all_reduces": held_replica_all_reduces, "last_replica_all_reduces": last_replica_all_reduces}


@pytest.mark.parametrize("world_size, mesh_shape", [(2, (2, 1)), (4, (2, 2))])
def test_hsdp_accumulation_without_the_replica_all_reduce_as_fsdp2(dist_pool, world_size, mesh_shape):
    for result in dist_pool(world_size).run(check_hsdp_accumulation_without_all_reduce, mesh_shape):
        assert result["grad_diff"] <= 1e-6 and result["param_diff"] <= 1e-6, result
        assert not result["held_grads"], result  # as FSDP2: the held micro-batch writes no gradient
        assert result["held_replica_all_reduces"] == [0, 0], result
        assert all(count > 0 for count in result["last_replica_all_reduces"]), result


def check_fsdp2_method_names() -> dict:
    """Every public method of torch's FSDPModule exists on ours: implemented, accepted as a no-op where nothing
    is needed, or refused with the reason (never an AttributeError)."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    model = lr.fully_shard(make_model())
    wanted = {name for name in dir(TorchFSDPModule) if not name.startswith("_") and callable(getattr(TorchFSDPModule,
                                                                                                      name))}
    missing = sorted(name for name in wanted if not callable(getattr(model, name, None)))
    model.set_is_last_backward(True)
    model.set_post_optim_event(None)
    lm_loss(model, _local(make_batches(1, BATCH)[0]))  # a forward left without its backward
    model.reset_iter_state()
    with pytest.raises(RuntimeError, match="root module"):
        model.blocks[0].reset_iter_state()
    with pytest.raises(NotImplementedError, match=r"set_reduce_scatter_unused_params\(False\)"):
        model.set_reduce_scatter_unused_params(False)
    model.set_unshard_in_backward(False)  # speed only: accepted
    left = [dbuffer.is_unsharded for dbuffer in lr.get_state(model).dbuffers()]
    return {"missing": missing, "left_unsharded": left}


def test_every_fsdp2_module_method_exists(dist_pool):
    for result in dist_pool(2).run(check_fsdp2_method_names):
        assert result["missing"] == [] and not any(result["left_unsharded"]), result


def check_refuses_to_move_or_cast() -> dict:
    model = lr.fully_shard(make_model())
    with pytest.raises(RuntimeError, match=r"would unlink its parameters from their DBuffers.*before fully_shard"):
        model.double()
    with pytest.raises(RuntimeError, match="mp_policy"):
        model.blocks[0].to(torch.bfloat16)
    model.to("cpu").float()  # no move, no cast: allowed
    lm_loss(model, _local(make_batches(1, BATCH)[0])).backward()
    dtype = str(next(model.parameters()).dtype)
    model.norm.double()  # a plain submodule has no guard of its own: its shard leaves the DBuffer
    with pytest.raises(RuntimeError, match=r"parameter 'norm.weight' was moved or cast after fully_shard \(it is "
                                           r"torch.float64.*holds torch.float32.*before fully_shard"):
        lm_loss(model, _local(make_batches(1, BATCH)[0]))
    per_block = make_model()  # FSDP2's calls: the message names the model's parameter, not the block's own
    for block in per_block.blocks:
        lr.fully_shard(block)
    lr.fully_shard(per_block)
    per_block.blocks[1].norm1.double()
    with pytest.raises(RuntimeError, match=r"parameter 'blocks.1.norm1.weight' was moved or cast after fully_shard"):
        lm_loss(per_block, _local(make_batches(1, BATCH)[0]))
    return {"dtype": dtype}


def test_to_after_sharding_is_refused(dist_pool):
    assert dist_pool(2).run(check_refuses_to_move_or_cast)[0] == {"dtype": "torch.float32"}


def check_composition_refuses_other_process_groups() -> str:
    """FSDP2 pattern with a block sharded over other ranks than the root: one model, one set of process groups."""
    own, groups = dist.new_subgroups(group_size=1)  # each rank alone: the block sharded apart from the root
    model = make_model()
    lr.fully_shard(model.blocks[0], process_group=own)
    try:
        with pytest.raises(ValueError, match=r"'blocks.0' was sharded over other process groups.*same process_group"):
            lr.fully_shard(model)
        same = make_model()
        lr.fully_shard(same.blocks[0], process_group=dist.group.WORLD)  # WORLD and None are one group
        return type(lr.fully_shard(same)).__name__
    finally:
        for group in groups:
            dist.destroy_process_group(group)


def test_composition_refuses_other_process_groups(dist_pool):
    assert dist_pool(2).run(check_composition_refuses_other_process_groups) == ["RaggedFSDPTinyLM"] * 2


def check_submodule_state_dicts() -> dict:
    reference = make_model()
    model = lr.fully_shard(make_model())
    block_state = lr.full_state_dict(model.blocks[1])
    expected = reference.blocks[1].state_dict()
    diff = max((block_state[k] - expected[k]).abs().max().item() for k in expected)
    norm = lr.full_state_dict(model.norm)  # part of the root group's DBuffer
    changed = {k: v + 1 for k, v in block_state.items()}
    lr.load_full_state_dict(model.blocks[1], changed)
    reloaded = lr.full_state_dict(model)
    moved = max((reloaded[f"blocks.1.{k}"] - changed[k]).abs().max().item() for k in changed)
    untouched = (reloaded["blocks.0.up.weight"] - reference.blocks[0].up.weight).abs().max().item()
    return {"keys": sorted(block_state) == sorted(expected), "diff": diff, "norm_keys": sorted(norm),
            "moved": moved, "untouched": untouched}


def test_full_state_dict_of_a_submodule(dist_pool):
    for result in dist_pool(2).run(check_submodule_state_dicts):
        assert result["keys"] and result["diff"] == 0.0
        assert result["norm_keys"] == ["bias", "weight"]
        assert result["moved"] == 0.0 and result["untouched"] == 0.0


def check_views_are_aligned(mixed: bool) -> list[int]:
    """Every full parameter view starts 16 bytes aligned (offsets in the layout and real addresses)."""
    policy = None
    if mixed:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = lr.fully_shard(make_model(), mp_policy=policy)
    state = lr.get_state(model)
    misaligned = []
    for dbuffer in state.dbuffers():
        dbuffer.unshard()
        for name, param in dbuffer.unsharded_params.items():
            if param.numel() and (param.data_ptr() % 16 or dbuffer.layout.offsets[name] % dbuffer.layout.alignment):
                misaligned.append(name)
        start = dbuffer.sharded.data_ptr()
        misaligned += [n for n, p in dbuffer.sharded_params.items() if p.numel() and (p.data_ptr() - start) % 16]
        dbuffer.reshard()
    return misaligned


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mixed", [False, True])
def test_parameter_views_are_16_byte_aligned(dist_pool, world_size, mixed):
    assert dist_pool(world_size).run(check_views_are_aligned, mixed) == [[]] * world_size


class Stack(nn.Module):
    """An encoder or decoder: a ModuleList of blocks plus a final norm (T5's ``T5Stack`` shape)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TinyBlock() for _ in range(layers))
        self.norm = nn.LayerNorm(13)


class Pair(nn.Module):
    """A block class repeated among siblings, not in a container (UNet-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = TinyBlock()
        self.up = TinyBlock()
        self.experts = nn.ModuleList(nn.Linear(13, 13) for _ in range(2))  # leaf modules: not blocks


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 13)
        self.encoder = Stack(2)
        self.decoder = Stack(3)
        self.unet = Pair()


def test_every_stack_is_grouped_per_block():
    names = [name for name, _ in stack_blocks(EncoderDecoder())]
    assert names == ["encoder.layers.0", "encoder.layers.1", "decoder.layers.0", "decoder.layers.1",
                     "decoder.layers.2", "unet.down", "unet.up"]


class Reversible(nn.Module):
    """Runs its blocks forward or in reverse (a different forward order, e.g. train vs eval)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(TinyBlock() for _ in range(3))
        self.reverse = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks) if self.reverse else self.blocks:
            x = block(x)
        return x


def check_forward_order_is_re_recorded() -> dict:
    reference, model = Reversible(), lr.fully_shard(Reversible())
    state = lr.get_state(model)
    x = torch.randn(2, 4, 13, generator=torch.Generator().manual_seed(dist.get_rank()))
    orders, diffs = [], []
    for reverse in (False, True, True, False):
        model.reverse = reference.reverse = reverse
        model(x).square().mean().backward()
        reference(x).square().mean().backward()
        orders.append([g.name for g in state.forward_order])
        expected = {k: v.grad.clone() for k, v in reference.named_parameters()}
        for name, param in model.named_parameters():
            dist.all_reduce(expected[name])  # the average of the ranks' gradients, as the engine computes
            start, end = param.ragged_shard.local_range
            mine = expected[name].reshape(-1)[start:end] / dist.get_world_size()
            diffs.append((param.grad - mine).abs().max().item() if mine.numel() else 0.0)
        for p in [*model.parameters(), *reference.parameters()]:
            p.grad = None
    return {"orders": orders, "diff": max(diffs)}


def test_prefetch_order_follows_the_latest_forward(dist_pool):
    result = dist_pool(2).run(check_forward_order_is_re_recorded)[0]
    forward = ["blocks.0", "blocks.1", "blocks.2"]
    assert result["orders"] == [forward, forward[::-1], forward[::-1], forward]
    assert result["diff"] <= 1e-6


def check_unused_prefetch_waited() -> dict:
    """A group prefetched for a backward it never runs (frozen, no input needing a gradient) is not left
    gathering through the optimizer step when the full parameters are kept after backward."""
    model = make_model()
    for param in (model.embed.weight, model.pos, *model.blocks[0].parameters()):
        param.requires_grad_(False)
    model = lr.fully_shard(model)
    model.set_reshard_after_backward(False)
    state = lr.get_state(model)
    lm_loss(model, _local(make_batches(1, BATCH)[0])).backward()
    first = next(g for g in state.groups if g.module is model.blocks[0])
    return {"pending": [g.name for g in state.all_groups if g.unshard_pending], "first_full": first.is_unsharded}


class _SecondBlockIdle(nn.Module):
    """Two blocks, only the first runs: the second is sharded but never used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(TinyBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


def check_unrun_prefetch_waited() -> dict:
    """A group prefetched in forward that never runs (no forward call, no backward), full parameters kept."""
    model = lr.fully_shard(_SecondBlockIdle())
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])
    model.set_reshard_after_backward(False)
    state = lr.get_state(model)
    generator = torch.Generator().manual_seed(dist.get_rank())
    model(torch.randn(2, SEQ, WIDTH, generator=generator)).square().mean().backward()
    return {"pending": [g.name for g in state.all_groups if g.unshard_pending]}


def test_a_prefetch_nothing_used_is_finished_by_the_end_of_backward(dist_pool):
    for result in dist_pool(2).run(check_unused_prefetch_waited):
        assert result == {"pending": [], "first_full": True}, result
    for result in dist_pool(2).run(check_unrun_prefetch_waited):
        assert result == {"pending": []}, result


def check_shard_device(accelerator: str | None) -> dict:
    from lightning_ragged.engine import fsdp2_args

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    real = fsdp2_args.meta_shard_device
    if accelerator is not None:  # the backend's device, as under NCCL on a GPU machine
        fsdp2_args.meta_shard_device = lambda mesh, group: torch.device(accelerator)
    try:
        found = fsdp2_args.shard_device(model, None, None, None)
        given = fsdp2_args.shard_device(model, None, None, "cpu")
        # FSDP2's order: blocks first (moved to the accelerator: fake CUDA shards stand for them here), then the
        # root, whose own parameters are still on the CPU: the root's decision ignores the sharded children's
        from torch._subclasses.fake_tensor import FakeTensorMode

        nested = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4, bias=False)))
        with FakeTensorMode(allow_non_fake_inputs=True):
            shard = nn.Parameter(torch.empty(8, device="cuda"))
        shard.ragged_shard = "a sharded child's"
        nested[1][0].weight = shard
        root = fsdp2_args.shard_device(nested, None, None, None)
        # torchtitan's order: every parameter in a child, the root owning only a buffer (freqs_cis)
        buffers_only = nn.Sequential(nn.Sequential(nn.Linear(4, 4, bias=False)))
        buffers_only.register_buffer("freqs", torch.ones(4), persistent=False)
        buffers_only[0][0].weight = shard
        root_buffers = fsdp2_args.shard_device(buffers_only, None, None, None)
    finally:
        fsdp2_args.meta_shard_device = real
    return {"found": found, "given": given, "root": root, "root_buffers": root_buffers}


def test_a_cpu_model_moves_to_the_accelerator_of_its_backend_as_fsdp2(dist_pool) -> None:
    # Before: fully_shard(cpu_model) under NCCL kept the shards and buffers on the CPU (NCCL refuses them;
    # FSDP2 moves the module to the mesh's device), and with device="cuda" the buffers stayed on the CPU:
    # the rotary table or BatchNorm statistics met CUDA activations in forward.
    from lightning_ragged.engine.fsdp2_args import move_buffers

    assert dist_pool(1).run(check_shard_device, None)[0] == {
        "found": None, "given": torch.device("cpu"), "root": None, "root_buffers": None}
    cuda = torch.device("cuda:0")
    assert dist_pool(1).run(check_shard_device, "cuda:0")[0] == {
        "found": cuda, "given": torch.device("cpu"), "root": cuda, "root_buffers": cuda}
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[0].register_buffer("table", torch.arange(4.0), persistent=False)
    model[0].register_buffer("absent", None)
    kept = model[1].running_mean
    move_buffers(model, torch.device("meta"))  # the only other device a CPU machine has
    assert all(b.is_meta for b in model.buffers()) and model[0].absent is None
    assert "table" not in model[0].state_dict() and "running_mean" in model[1].state_dict()
    assert not kept.is_meta  # the module points at new tensors; the old ones are left alone
    move_buffers(model, None)
    assert all(b.is_meta for b in model.buffers())


@pytest.mark.parametrize("forwards,keep", [("eval-before-step", False), ("eval-before-step-fused", False),
                                           ("kept-after-backward", False), ("eval-before-step", None),
                                           ("eval-before-step-fused", None)])
def test_full_parameters_kept_across_an_optimizer_step_are_gathered_again(dist_pool, forwards, keep):
    # reshard_after_forward=False keeps full parameters through a no-grad forward (FSDP2's rule; its default None
    # keeps the root's); kept across the optimizer step they would be the old values (FSDP2 computes with them):
    # the shards' version says so
    results = dist_pool(2).run(check_training_matches_single_process, dict(reshard_after_forward=keep), False,
                               BATCH, forwards)
    assert max(r["max_diff"] for r in results) <= 1e-5, results[0]


class _MoEBlock(nn.Module):
    """An attention-free MoE block: a router and a ModuleList of experts (a stack inside the block)."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.router(x).softmax(-1)
        return x + sum(weights[..., i : i + 1] * expert(x) for i, expert in enumerate(self.experts))


def _moe(blocks: int = 2) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList(_MoEBlock() for _ in range(blocks))
    return model


def check_per_block_calls_on_moe_blocks() -> dict:
    import warnings

    result = {}
    for variant, block_kwargs in (("split", {}), ("one_group", {"group_modules": ()})):
        model = _moe()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for block in model.blocks:
                lr.fully_shard(block, **block_kwargs)
            lr.fully_shard(model)
        result[variant] = ([str(w.message) for w in caught if "group_modules=()" in str(w.message)],
                           len(lr.get_state(model).all_groups))
    teacher_student = nn.Module()  # two whole models, each split in one call: what those calls want, no warning
    teacher_student.teacher, teacher_student.student = _moe(), _moe()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lr.fully_shard(teacher_student.teacher)
        lr.fully_shard(teacher_student.student)
        lr.fully_shard(teacher_student)
    result["whole_models"] = [str(w.message) for w in caught if "group_modules=()" in str(w.message)]
    return result


def test_per_block_calls_that_split_moe_blocks_by_expert_are_named(dist_pool):
    """FSDP2's pattern on a block holding an expert list: each block call split it by expert (a collective per
    expert, 38 all-gathers a step instead of 6 for 2 blocks of 8 experts in the sweep). Named, with the fix."""
    result = dist_pool(2).run(check_per_block_calls_on_moe_blocks)[0]
    messages, groups = result["split"]
    assert groups == 2 * 5 + 1 and len(messages) == 1, result  # 4 experts + the rest per block, and the root
    assert "adopts 2 earlier calls" in messages[0] and "_MoEBlock: 5 groups" in messages[0], messages
    assert result["one_group"] == ([], 2 + 1), result  # group_modules=(): one group per call, as FSDP2
    assert result["whole_models"] == [], result


def check_torch_sharded_model_refused_by_the_strategy() -> str:
    """A ``configure_model`` written for ``ModelParallelStrategy`` (torch's ``fully_shard`` on a block) under the
    ragged_fsdp strategy: refused by name at setup (before: "'Parameter' object has no attribute '_local_tensor'"
    at the first forward)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from lightning_ragged.lightning.sharding import shard_module

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    torch_fully_shard(model[0])
    with pytest.raises(ValueError, match=r"2 parameters of Sequential are DTensors \(e.g. '0.weight'\).*"
                                         r"lightning_ragged.fully_shard"):
        shard_module(model, device=torch.device("cpu"))
    return "refused"


def test_a_model_sharded_by_torch_is_refused_by_the_strategy(dist_pool):
    assert dist_pool(2).run(check_torch_sharded_model_refused_by_the_strategy) == ["refused", "refused"]


def check_named_optimizers_after_per_block_calls() -> dict:
    """lightning_ragged's own optimizers key their state by ``ragged_shard.name``: after FSDP2's per-block calls those
    must be the model's names, as after one call; each optimizer then trains as it does on the one-call model."""
    from lightning_ragged.optim import SOAP, AdamW8bit, Shampoo

    batches = make_batches(3, BATCH)
    result = {}
    for cls, kwargs in ((Shampoo, dict(max_preconditioner_dim=32)), (SOAP, {}), (AdamW8bit, dict(block_size=32))):
        models = {"per_block": make_model(), "one_call": make_model()}
        for block in models["per_block"].blocks:
            lr.fully_shard(block, shard_granularity="matrix")
        for model in models.values():
            lr.fully_shard(model, shard_granularity="matrix")
        result["names_match"] = [n for n, _ in models["per_block"].named_parameters()] == \
            [p.ragged_shard.name for p in models["per_block"].parameters()]
        losses = {}
        for name, model in models.items():
            optimizer = cls(model.parameters(), lr=1e-2, **kwargs)
            losses[name] = []
            for batch in batches:
                loss = lm_loss(model, _local(batch))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses[name].append(loss.item())
        result[cls.__name__] = max(abs(a - b) for a, b in zip(losses["per_block"], losses["one_call"]))
    return result


def test_named_optimizers_work_after_fsdp2_per_block_calls(dist_pool):
    # before: "parameter name 'norm1.weight' appears twice in Shampoo's param groups" (each block's names were its own)
    for result in dist_pool(2).run(check_named_optimizers_after_per_block_calls):
        assert result.pop("names_match"), result
        assert max(result.values()) <= 1e-6, result  # the same shards and layouts: the same arithmetic
