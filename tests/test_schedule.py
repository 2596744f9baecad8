"""The engine's schedule on 2 and 3 gloo ranks: all-gathers saved, full buffers bounded, gradients landed.

The oracles are the single-process model (``check_training_matches_single_process``),
counts derived from the number of groups and DBuffers, and the live full buffers an
observer sees at every DBuffer event (the only places their number changes).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import lightning_ragged as lr
from lightning_ragged.engine.events import DBufferEvent
from tests.models import TinyLM, lm_loss, make_batches
from tests.test_fully_shard import BATCH, _local, _max_diff, check_training_matches_single_process

WORLD_SIZES = [2, 3]
LAYERS = 4


def _make(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(layers=LAYERS)


# ----------------------------------------------------------- keep_last_unsharded
def check_all_gathers_per_step(steps: int = 3) -> dict:
    model = lr.fully_shard(_make(), keep_last_unsharded=True)
    state = lr.get_state(model)
    data = make_batches(steps, BATCH)
    per_step = []
    for step in range(steps):
        before = state.stats.all_gathers
        lm_loss(model, _local(data[step])).backward()
        per_step.append(state.stats.all_gathers - before)
    return {
        "per_step": per_step,
        "block_buffers": sum(len(g.dbuffers) for g in state.groups),
        "root_buffers": len(state.root_group.dbuffers),
        "last_buffers": len(state.forward_order[-1].dbuffers),
        "last_is_last_block": state.forward_order[-1].module is model.blocks[-1],
        "left_unsharded": [b.is_unsharded for b in state.dbuffers()],
    }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_keep_last_unsharded_saves_one_all_gather_per_step(dist_pool, world_size):
    for result in dist_pool(world_size).run(check_all_gathers_per_step):
        every = 2 * result["block_buffers"] + result["root_buffers"]  # blocks twice, the root once
        assert result["last_is_last_block"]
        # the first step has no recorded order yet; from then on the last block is gathered once
        assert result["per_step"] == [every] + [every - result["last_buffers"]] * 2, result
        assert not any(result["left_unsharded"])  # resharded at its post-backward as before


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("accumulate", [False, True], ids=["step", "no_sync"])
def test_keep_last_unsharded_matches_single_process(dist_pool, world_size, accumulate):
    results = dist_pool(world_size).run(check_training_matches_single_process, dict(keep_last_unsharded=True), accumulate)
    assert max(r["max_diff"] for r in results) <= 1e-5, results[0]


# ------------------------------------------------------ max_inflight_all_gathers
class _LiveFullBuffers:
    """Observer: at every DBuffer event, how many block groups hold a full buffer (allocated or being gathered)."""

    def __init__(self, state) -> None:
        self.state = state
        self.most_groups = 0
        self.most_bytes = 0

    def on_event(self, event: DBufferEvent) -> None:
        live = [g for g in self.state.groups if any(b.is_unsharded for b in g.dbuffers)]
        self.most_groups = max(self.most_groups, len(live))
        nbytes = sum(b.unsharded.untyped_storage().nbytes() for g in live for b in g.dbuffers)
        self.most_bytes = max(self.most_bytes, nbytes)
        return None


def check_full_buffers_bounded(max_inflight: int, keep_last: bool, steps: int = 3) -> dict:
    data = make_batches(steps, BATCH)
    model = lr.fully_shard(_make(), max_inflight_all_gathers=max_inflight, keep_last_unsharded=keep_last)
    reference = _make()
    state = lr.get_state(model)
    observer = _LiveFullBuffers(state)
    for dbuffer in state.dbuffers():
        dbuffer.observers.append(observer)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    settled = []
    for step in range(steps):
        lm_loss(model, _local(data[step])).backward()
        # what optimizer.step() may rely on once backward returned: every collective finished
        settled.append(not any(
            b.reduce_pending or b.unshard_pending or b.has_unsharded_grad or b.is_unsharded for b in state.dbuffers()
        ) and all(p.grad is not None for p in model.parameters() if p.numel()))
        opt.step()
        opt.zero_grad()
        lm_loss(reference, data[step]).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    largest = max(sum(b.unsharded.numel() * b.unsharded.element_size() for b in g.dbuffers) for g in state.groups)
    return {
        "most_groups": observer.most_groups,
        "most_bytes": observer.most_bytes,
        "largest_group_bytes": largest,
        "settled": settled,
        "max_diff": _max_diff(lr.full_state_dict(model), reference),
    }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("max_inflight,keep_last", [(1, False), (2, True), (0, False)])
def test_full_buffers_bounded_by_max_inflight(dist_pool, world_size, max_inflight, keep_last):
    for result in dist_pool(world_size).run(check_full_buffers_bounded, max_inflight, keep_last):
        limit = 1 + max_inflight  # the running group and the ones gathered ahead of it
        assert result["most_groups"] <= limit, result
        assert result["most_bytes"] <= limit * result["largest_group_bytes"], result
        assert result["most_groups"] == limit, result  # the knob is reached: prefetch really runs that far ahead
        assert all(result["settled"]), result
        assert result["max_diff"] <= 1e-5, result


def test_max_inflight_all_gathers_refused_early(dist_pool):
    assert all("max_inflight_all_gathers=-1" in m and "int >= 0" in m for m in dist_pool(2).run(_bad_inflight))


def _bad_inflight() -> str:
    try:
        lr.fully_shard(_make(), max_inflight_all_gathers=-1)
    except ValueError as error:
        return str(error)
    return "no error"


# ------------------------------------------------ gradients landing in the buffer
# A reduce dtype of its own makes gradients land by one copy (no zero-fill, no add), in the narrower dtype
# (here the compute dtype); float64 keeps the comparison with single-process float32 training exact to rounding.
LANDING = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("accumulate", [False, True], ids=["step", "no_sync"])
def test_gradients_landed_by_copy_match_single_process(dist_pool, world_size, accumulate):
    results = dist_pool(world_size).run(check_training_matches_single_process, LANDING, accumulate)
    assert max(r["max_diff"] for r in results) <= 1e-5, results[0]


class _Writes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes written by zero_/fill_/add_/copy_ into the gradient buffers; ``add_`` into other float64 tensors
    (LANDING's reduce dtype) under ``"sum in the reduce dtype"``."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages = storages
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in ("aten::zero_", "aten::fill_", "aten::add_", "aten::copy_") and args[0].numel():
            key = name if args[0].untyped_storage()._cdata in self.storages else None  # across its resizes
            if key is None and name == "aten::add_" and args[0].dtype == torch.float64:
                key = "sum in the reduce dtype"
            if key is not None:
                self.bytes[key] = self.bytes.get(key, 0) + args[0].numel() * args[0].element_size()
        return out


def check_landing_writes() -> dict:
    """Which operators write the gradient buffers in one step, per mode (fp32: zero + autograd's add)."""
    result = {}
    for mode, kwargs in (("fp32", {}), ("landing", LANDING)):
        model = lr.fully_shard(_make(), **kwargs)
        state = lr.get_state(model)
        batch = _local(make_batches(1, BATCH)[0])
        writes = _Writes({b.unsharded_grad.untyped_storage()._cdata for b in state.dbuffers()})
        with writes:
            lm_loss(model, batch).backward()
        grad_bytes = sum(b.layout.buffer_numel * b.unsharded_grad.element_size() for b in state.dbuffers())
        padding = sum(b.layout.padding * b.unsharded_grad.element_size() for b in state.dbuffers())
        # gloo's reduce_mode="pairwise" adds each peer's copy of this rank's segment into this rank's own, cast
        summed = sum((b.world_size - 1) * b.layout.segment_size * b.reduce_dtype.itemsize for b in state.dbuffers())
        result[mode] = {"writes": writes.bytes, "grad_bytes": grad_bytes, "padding": padding, "summed": summed,
                        "grad_dtypes": {str(b.unsharded_grad.dtype) for b in state.dbuffers()}}
    return result


def test_first_gradients_land_without_zero_fill(dist_pool):
    result = dist_pool(2).run(check_landing_writes)[0]
    fp32, landing = result["fp32"], result["landing"]
    assert fp32["writes"].get("aten::zero_") == fp32["grad_bytes"], fp32  # zeroed whole, autograd adds
    assert landing["writes"].get("aten::copy_") == landing["grad_bytes"] - landing["padding"], landing
    assert landing["writes"].get("aten::zero_", 0) <= landing["padding"], landing  # only what no gradient writes
    assert landing["grad_dtypes"] == {"torch.float32"}, landing  # held in the compute dtype, not the reduce dtype
    # every parameter runs once: no second gradient is added; the reduction sums the peers' segments (in fp32)
    # into this rank's own, cast to the reduce dtype (fp64) outside the buffer
    assert "aten::add_" not in landing["writes"], landing
    assert landing["writes"].get("sum in the reduce dtype") == landing["summed"], landing
