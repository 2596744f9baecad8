"""FSDP2's custom communication on ``fully_shard``'s modules: ``set_custom_all_gather``,
``set_custom_reduce_scatter`` (torch's ``AllGather`` / ``ReduceScatter`` interface) and ``set_all_reduce_hook``.

Oracles: single-process training on the global batch (the custom collectives train the same model;
a hook that all-reduces over the world turns 1-rank shard groups into DDP), torch's FSDP2 given the same
hook, the engine's own ``CommStats`` (every collective went through the user's object), and the log of
fake device streams (``tests/test_streams.py``'s) for the hook's stream.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

try:  # torch's interface classes, as a user subclasses them (the engine needs only allocate and __call__)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # a torch without FSDP2's custom comms
    AllGather = ReduceScatter = object

import lightning_ragged as lr
from lightning_ragged.engine.fsdp_module import FSDPModule
from tests.models import lm_loss, make_batches, make_model
from tests.test_fully_shard import BATCH, _local, _max_diff
from tests.test_streams import Recorder

STEPS = 3
MIXED = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class CountingAllGather(AllGather):
    """torch's plain all-gather, recording each allocation and call."""

    def __init__(self) -> None:
        self.allocated: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        self.allocated.append((tuple(size), dtype))
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingReduceScatter(ReduceScatter):
    """torch's plain reduce-scatter, recording each allocation, call and reduce op."""

    def __init__(self) -> None:
        self.allocated: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.ops: list[str] = []

    def allocate(self, size, *, dtype, device):
        self.allocated.append((tuple(size), dtype))
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.ops.append(str(op))
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _sharded_modules(model) -> list:
    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def _train(model, batches) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in batches:
        lm_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()


# ------------------------------------------------ 1. custom all-gather and reduce-scatter
def check_custom_collectives_train() -> dict:
    batches = make_batches(STEPS, BATCH)
    reference = make_model()
    _train(reference, batches)
    model = lr.fully_shard(make_model())
    gather, reduce = CountingAllGather(), CountingReduceScatter()
    for module in _sharded_modules(model):
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(reduce)
    state = lr.get_state(model)
    _train(model, [_local(batch) for batch in batches])
    full_sizes = {(dbuffer.full_numel,) for dbuffer in state.dbuffers()}
    segments = {(dbuffer.layout.segment_size,) for dbuffer in state.dbuffers()}
    return {
        "diff": _max_diff(lr.full_state_dict(model), reference),
        "gathers": (gather.calls, state.stats.all_gathers),
        "reduces": (len(reduce.ops), state.stats.reduces),
        "ops": set(reduce.ops),
        "gather_sizes_ok": {size for size, _ in gather.allocated} <= full_sizes,
        # per reduction: the input (a full buffer) then the output (this rank's segment)
        "reduce_sizes_ok": all(size in full_sizes for size, _ in reduce.allocated[0::2])
        and all(size in segments for size, _ in reduce.allocated[1::2]),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_custom_all_gather_and_reduce_scatter_train_as_one_process(dist_pool, world_size):
    for result in dist_pool(world_size).run(check_custom_collectives_train):
        assert result["diff"] <= 1e-5, result
        assert result["gathers"][0] == result["gathers"][1] > 0, result  # every all-gather went through it
        assert result["reduces"][0] == result["reduces"][1] > 0, result
        assert result["ops"] == {str(dist.ReduceOp.SUM)}, result
        assert result["gather_sizes_ok"] and result["reduce_sizes_ok"], result


def check_custom_collectives_mixed_precision() -> dict:
    """bf16 gathers, fp32 reduction: the comms get the compute and the reduce dtype; gradients equal ours."""
    local = _local(make_batches(1, BATCH)[0])
    plain, custom = lr.fully_shard(make_model(), mp_policy=MIXED), lr.fully_shard(make_model(), mp_policy=MIXED)
    gather, reduce = CountingAllGather(), CountingReduceScatter()
    for module in _sharded_modules(custom):
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(reduce)
    for model in (plain, custom):
        lm_loss(model, local).backward()
    grads = {name: param.grad for name, param in plain.named_parameters()}
    diff = max((param.grad - grads[name]).abs().max().item() for name, param in custom.named_parameters()
               if param.grad is not None and param.numel())
    return {"diff": diff, "gather_dtypes": {dtype for _, dtype in gather.allocated},
            "reduce_dtypes": {dtype for _, dtype in reduce.allocated}}


def test_custom_collectives_under_mixed_precision(dist_pool):
    for result in dist_pool(2).run(check_custom_collectives_mixed_precision):
        assert result["diff"] <= 1e-6, result  # the same sums (two ranks: a + b either way)
        assert result["gather_dtypes"] == {torch.bfloat16} and result["reduce_dtypes"] == {torch.float32}, result


# ------------------------------------------------------------------- 2. the all-reduce hook
def check_hook_sees_divided_segments() -> dict:
    """A hook halving what it sees: gradients are half the average, as with torch's FSDP2 given the same hook."""
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    local = _local(make_batches(1, BATCH)[0])
    reference, model, fsdp2 = make_model(), lr.fully_shard(make_model()), make_model()
    for block in fsdp2.blocks:
        fsdp2_shard(block)
    fsdp2_shard(fsdp2)
    seen: list[tuple[int, torch.dtype]] = []

    def halve(reduced: torch.Tensor) -> None:
        seen.append((reduced.numel(), reduced.dtype))
        reduced.mul_(0.5)

    for sharded in (*_sharded_modules(model), fsdp2, *fsdp2.blocks):
        sharded.set_all_reduce_hook(halve)
    lm_loss(model, local).backward()
    ours = len(seen)
    lm_loss(fsdp2, local).backward()
    lm_loss(reference, make_batches(1, BATCH)[0]).backward()
    references = dict(reference.named_parameters())
    full = {name: param.grad.full_tensor() for name, param in fsdp2.named_parameters()}
    diff = fsdp2_diff = 0.0
    for name, param in model.named_parameters():
        start, end = param.ragged_shard.local_range
        if end > start:
            diff = max(diff, (param.grad - 0.5 * references[name].grad.reshape(-1)[start:end]).abs().max().item())
            fsdp2_diff = max(fsdp2_diff, (param.grad - full[name].reshape(-1)[start:end]).abs().max().item())
    dbuffers = list(lr.get_state(model).dbuffers())
    return {"diff": diff, "fsdp2_diff": fsdp2_diff, "calls": ours, "dbuffers": len(dbuffers),
            "seen": sorted(set(seen[:ours])), "segments": sorted({(b.layout.segment_size, torch.float32)
                                                                 for b in dbuffers})}


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_hook_sees_the_reduced_segment_as_fsdp2(dist_pool, world_size):
    for result in dist_pool(world_size).run(check_hook_sees_divided_segments):
        assert result["diff"] <= 1e-6 and result["fsdp2_diff"] <= 1e-6, result
        assert result["calls"] == result["dbuffers"], result  # once per DBuffer and backward
        assert result["seen"] == result["segments"], result


def check_ddp_through_the_hook(with_hook: bool) -> float:
    """Shard groups of one rank (nothing sharded or reduced) and a hook averaging over the world: DDP."""
    subgroup, _ = dist.new_subgroups(1)
    batches = make_batches(STEPS, BATCH)
    reference = make_model()
    _train(reference, batches)
    model = lr.fully_shard(make_model(), process_group=subgroup)

    def average(reduced: torch.Tensor) -> None:
        dist.all_reduce(reduced)
        reduced.div_(dist.get_world_size())

    if with_hook:
        for module in _sharded_modules(model):
            module.set_all_reduce_hook(average)
    _train(model, [_local(batch) for batch in batches])
    return _max_diff(lr.full_state_dict(model), reference)


def test_all_reduce_hook_over_the_world_is_ddp(dist_pool):
    pool = dist_pool(2)
    assert max(pool.run(check_ddp_through_the_hook, True)) <= 1e-5
    assert min(pool.run(check_ddp_through_the_hook, False)) > 1e-4  # without it each rank trains alone


def check_hook_stream_order() -> list:
    """With ``stream=``: the hook's stream waits for compute, the hook runs inside it, compute waits for it."""
    model = lr.fully_shard(make_model())
    recorder = Recorder(ordered=False)
    lr.get_state(model).set_comm_streams(recorder.streams)
    hook_stream = type(recorder.compute)("hook", recorder)

    def hook(reduced: torch.Tensor) -> None:
        recorder.log.append(("hook", recorder.current().name))

    model.set_all_reduce_hook(hook, stream=hook_stream)
    lm_loss(model, _local(make_batches(1, BATCH)[0])).backward()
    log = recorder.log
    return [log[i - 2 : i + 3] for i, entry in enumerate(log) if entry[0] == "hook"]


def test_all_reduce_hook_runs_on_its_stream_between_waits(dist_pool):
    for windows in dist_pool(2).run(check_hook_stream_order):
        assert windows, "the root's hook never ran"
        for window in windows:
            assert window == [("wait_stream", "hook", "compute"), ("enter", "hook"), ("hook", "hook"),
                              ("exit", "hook"), ("wait_stream", "compute", "hook")], window


# ------------------------------------------------------------------------------- 3. refusals
def check_refusals() -> dict:
    model = lr.fully_shard(make_model())
    errors = {}
    for call in (lambda: model.set_custom_all_gather(object()), lambda: model.set_custom_reduce_scatter(print),
                 lambda: model.set_all_reduce_hook(3)):
        with pytest.raises(TypeError) as error:
            call()
        errors[len(errors)] = str(error.value)
    gather = CountingAllGather()
    model.set_custom_all_gather(gather)
    model.set_custom_all_gather(None)  # back to the in-place all-gather
    lm_loss(model, _local(make_batches(1, BATCH)[0])).backward()
    fp8 = lr.fully_shard(make_model(), fp8_all_gather=lr.Float8AllGather(tile=4))
    with pytest.raises(ValueError, match="fp8"):
        fp8.blocks[0].set_custom_all_gather(gather)
    return {"errors": errors, "calls_after_reset": gather.calls}


def test_custom_comms_refuse_what_they_cannot_use(dist_pool):
    result = dist_pool(2).run(check_refusals)[0]
    assert "set_custom_all_gather(<object" in result["errors"][0] and "allocate" in result["errors"][0], result
    assert "set_custom_reduce_scatter" in result["errors"][1] and "ReduceScatter" in result["errors"][1], result
    assert "set_all_reduce_hook(3)" in result["errors"][2], result
    assert result["calls_after_reset"] == 0, result
