"""The world-1 fast path: a shard group of one rank issues no collective and copies nothing.

Oracles: the same model trained on one process without ``fully_shard`` (fp32: bit for bit,
the same kernels on the same values in the same order), torch's FSDP2 at world size 1 (bf16),
``CommDebugMode`` (every c10d collective dispatched) and a copy counter that, beyond
``CopyCounter``'s copy-like operators, also counts the bytes collectives write and ``out=``
scalings, which is where the engine moved data at world size 1 before (a gathered copy of the
shard, an in-place all-reduce, a scaled copy into the sharded gradient). HSDP over one-rank
shard groups keeps the full path (its schedule is ``tests/test_streams.py``'s HSDP cases).
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_leaves

import lightning_ragged as lr
from lightning_ragged import checkpoint as ck
from lightning_ragged.engine.events import EventKind
from lightning_ragged.observability.copy_counter import CopyCounter
from lightning_ragged.observability.probes import probe
from tests.models import WIDTH, lm_loss, make_batches, make_model

STEPS = 5
BATCH = 6
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class _MovedBytes(CopyCounter):
    """``CopyCounter`` plus the bytes every c10d collective writes and every ``aten::mul(..., out=)``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = func._schema.name
        if func.namespace == "c10d" or (name == "aten::mul" and "out" in kwargs):
            target = kwargs["out"] if "out" in kwargs else args[0]  # a collective's first argument: its output
            tensors = [t for t in tree_leaves(target) if isinstance(t, torch.Tensor)]
            self.by_op[name] += sum(t.numel() * t.element_size() for t in tensors)
        return out


class _Events:
    """Observer: how many events of each kind the DBuffers told."""

    def __init__(self) -> None:
        self.counts: dict[EventKind, int] = {}

    def on_event(self, event) -> None:
        self.counts[event.kind] = self.counts.get(event.kind, 0) + 1


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _equal(full: dict[str, torch.Tensor], reference: nn.Module) -> bool:
    expected = reference.state_dict()
    return full.keys() == expected.keys() and all(torch.equal(full[k], expected[k]) for k in expected)


# ------------------------------------------------------------------- fp32: plain training
def check_fp32_is_plain_training() -> dict:
    """5 AdamW steps sharded at world 1 vs unsharded; collectives, moved bytes, memory and events per step."""
    data = make_batches(STEPS, BATCH)
    reference = make_model()
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model = lr.fully_shard(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = lr.get_state(model)
    engine_probe = probe(model)
    events = _Events()
    for dbuffer in state.dbuffers():
        dbuffer.observers.append(events)
    collectives, extra_bytes, same_loss, freed, at_rest = [], [], [], [], []
    for step in range(STEPS):
        with _MovedBytes() as plain_moved:
            reference_loss = _train_step(reference, reference_opt, data[step])
        with CommDebugMode() as comm, _MovedBytes() as moved:
            loss = lm_loss(model, data[step])
            loss.backward()
            grads = [weakref.ref(p.grad.untyped_storage()) for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
        gc.collect()
        collectives.append(comm.get_total_counts())
        extra_bytes.append(moved.total_bytes - plain_moved.total_bytes)
        same_loss.append(torch.equal(loss, reference_loss))
        freed.append(all(b.sharded_grad is None for b in state.dbuffers()) and all(g() is None for g in grads))
        at_rest.append(all(p.dim() == 1 and hasattr(p, "ragged_shard") for p in model.parameters()))
    stats = state.stats
    return {
        "bitwise": _equal(lr.full_state_dict(model), reference),
        "same_loss": same_loss,
        "collectives": collectives,
        "stats": (stats.all_gathers, stats.all_gather_bytes, stats.reduces, stats.reduce_bytes, stats.flag_syncs),
        "extra_bytes": extra_bytes,
        "aliased": [b.full_is_shard and b.unsharded.data_ptr() == b.sharded.data_ptr() for b in state.dbuffers()],
        "freed": freed,
        "at_rest": at_rest,
        "probe": (engine_probe.unsharded_peak_bytes, engine_probe.unsharded_bytes, engine_probe.grad_bytes,
                  engine_probe.grad_peak_bytes, engine_probe.engine_copy_bytes),
        "events": {kind.name: count for kind, count in events.counts.items()},
        "dbuffers": len(list(state.dbuffers())),
    }


def test_fp32_world1_is_plain_training_without_collectives_or_copies(dist_pool):
    result = dist_pool(1).run(check_fp32_is_plain_training)[0]
    assert result["bitwise"] and all(result["same_loss"]), result
    assert result["collectives"] == [0] * STEPS, result  # forward, backward, optimizer step, zero_grad
    assert result["stats"] == (0, 0, 0, 0, 0), result
    assert result["extra_bytes"] == [0] * STEPS, result  # nothing moved beyond what the plain model moves
    assert all(result["aliased"]), result
    assert all(result["freed"]) and all(result["at_rest"]), result
    peak, unsharded, grad_now, grad_peak, copies = result["probe"]
    assert (peak, unsharded, grad_now, copies) == (0, 0, 0, 0) and grad_peak > 0, result
    # no memory changes for the full buffer (no unshard/reshard events); every gradient buffer
    # allocated is adopted (freed as a buffer) once, at its "reduction", issued and waited
    events, per_run = result["events"], STEPS * result["dbuffers"]
    assert events == {"GRAD_BUFFER_ALLOCATED": per_run, "GRAD_BUFFER_FREED": per_run,
                      "REDUCE_ISSUED": per_run, "REDUCE_WAITED": per_run}, result


# ---------------------------------------------------------------- bf16: FSDP2 at world 1
def check_bf16_matches_fsdp2() -> dict:
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    data = make_batches(STEPS, BATCH)
    model = lr.fully_shard(make_model(), mp_policy=BF16)
    fsdp2 = make_model()
    for block in fsdp2.blocks:
        fsdp2_fully_shard(block, mp_policy=BF16)
    fsdp2_fully_shard(fsdp2, mp_policy=BF16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fsdp2_opt = torch.optim.AdamW(fsdp2.parameters(), lr=1e-2)
    same_loss, collectives, copies = [], [], []
    for step in range(STEPS):
        with CommDebugMode() as comm, _MovedBytes() as moved:
            loss = _train_step(model, optimizer, data[step])
        with _MovedBytes() as fsdp2_moved:
            fsdp2_loss = _train_step(fsdp2, fsdp2_opt, data[step])
        same_loss.append(torch.equal(loss, fsdp2_loss))
        collectives.append(comm.get_total_counts())
        copies.append((moved.total_bytes, fsdp2_moved.total_bytes))
    full = lr.full_state_dict(model)
    expected = {k: v.full_tensor() for k, v in fsdp2.state_dict().items()}
    return {
        "same_params": full.keys() == expected.keys() and all(torch.equal(full[k], expected[k]) for k in full),
        "same_loss": same_loss,
        "collectives": collectives,
        "copies": copies,
        "aliased": [b.full_is_shard for b in lr.get_state(model).dbuffers()],
    }


def test_bf16_world1_matches_fsdp2_bit_for_bit(dist_pool):
    result = dist_pool(1).run(check_bf16_matches_fsdp2)[0]
    # Both cast the fp32 master to bf16, run the same bf16 kernels, cast the bf16 gradients to
    # fp32 and scale by 1/1: the same operations in the same order, so the tolerance is 0.
    assert result["same_params"] and all(result["same_loss"]), result
    assert result["collectives"] == [0] * STEPS, result
    assert not any(result["aliased"]), result  # a cast needs a full buffer of its own
    assert all(ours < theirs for ours, theirs in result["copies"]), result  # the cast is our only copy


# ------------------------------------------------------------------ no_sync accumulation
def check_no_sync_accumulation() -> dict:
    data = make_batches(3, BATCH)
    reference = make_model()
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model = lr.fully_shard(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = lr.get_state(model).stats
    counts = []
    for batch in data:
        first, second = batch.chunk(2)
        (lm_loss(reference, first) * 0.5).backward()
        (lm_loss(reference, second) * 0.5).backward()
        with CommDebugMode() as accumulating, lr.no_sync(model):  # one mode per forward: its module tracker
            (lm_loss(model, first) * 0.5).backward()
        with CommDebugMode() as synchronized:
            (lm_loss(model, second) * 0.5).backward()
        counts.append(accumulating.get_total_counts() + synchronized.get_total_counts())
        for opt in (reference_opt, optimizer):
            opt.step()
            opt.zero_grad()
    return {"bitwise": _equal(lr.full_state_dict(model), reference), "counts": counts, "reduces": stats.reduces}


def test_no_sync_accumulation_world1_is_plain_accumulation(dist_pool):
    result = dist_pool(1).run(check_no_sync_accumulation)[0]
    assert result["bitwise"], result
    assert result["counts"] == [0, 0, 0] and result["reduces"] == 0, result


# ----------------------------------------------- unused parameter, accumulation, clipping
class _WithUnused(nn.Module):
    """The test model plus a head it never calls: its parameters get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = make_model()
        self.unused = nn.Linear(WIDTH, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(tokens)


def check_unused_accumulate_clip() -> dict:
    """Two backwards without zero_grad (the accumulating write), then clipping; grads vs the plain model's."""
    torch.manual_seed(0)
    reference = _WithUnused()
    torch.manual_seed(0)
    model = lr.fully_shard(_WithUnused())
    data = make_batches(2, BATCH)
    for batch in data:
        for net in (reference, model):
            lm_loss(net, batch).backward()
    sharded = dict(model.named_parameters())
    unused_none = {n: sharded[n].grad is None for n in ("unused.weight", "unused.bias")}
    grads_equal = all(torch.equal(sharded[n].grad, p.grad.reshape(-1)) for n, p in reference.named_parameters()
                      if p.grad is not None)
    used_have_grads = all(sharded[n].grad is not None for n, p in reference.named_parameters() if p.grad is not None)
    with CommDebugMode() as comm:
        norm = lr.clip_grad_norm_(model, max_norm=0.05)
    reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.05)
    clipped = max((sharded[n].grad - p.grad.reshape(-1)).abs().max().item() for n, p in reference.named_parameters()
                  if p.grad is not None)
    return {
        "unused_none": unused_none, "grads_equal": grads_equal, "used_have_grads": used_have_grads,
        "norm": (norm.item(), reference_norm.item()), "clipped_diff": clipped,
        "clip_collectives": comm.get_total_counts(),
    }


def test_unused_parameter_keeps_grad_none_and_clipping_matches_torch(dist_pool):
    result = dist_pool(1).run(check_unused_accumulate_clip)[0]
    assert all(result["unused_none"].values()), result  # as DDP and the plain model: never used, still None
    assert result["grads_equal"] and result["used_have_grads"], result  # accumulation: the same adds
    norm, reference_norm = result["norm"]
    # the norm sums the squares per flat buffer instead of per tensor: fp32 reassociation only
    assert abs(norm - reference_norm) <= 1e-6 * reference_norm, result
    # it really clipped; clipped to a total norm of 0.05 every element is below 0.05 (ulp ~4e-9): a few ulps
    assert norm > 0.05 and result["clipped_diff"] <= 1e-8, result
    assert result["clip_collectives"] == 0, result  # a shard group of one rank: its local norm is the norm


# ------------------------------------------------------------------------ checkpoints
def _local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for index, param in enumerate(optimizer.param_groups[0]["params"]):
        for key, value in optimizer.state[param].items():
            out[f"opt.{index}.{key}"] = value.clone()
    return out


def check_world1_round_trip(root: str) -> dict:
    """Save at step 2 of 4, resume a model of another seed from it: bit-identical to the uninterrupted run."""
    data = make_batches(4, BATCH)
    model = lr.fully_shard(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        _train_step(model, optimizer, data[step])
    ck.save(root, model, [optimizer], {"step": 2})
    saved = lr.full_state_dict(model)
    for step in range(2, 4):
        _train_step(model, optimizer, data[step])
    resumed = lr.fully_shard(make_model(seed=7))
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    extra = ck.load(root, resumed, [resumed_opt])
    for step in range(extra["step"], 4):
        _train_step(resumed, resumed_opt, data[step])
    got, expected = _local_state(resumed, resumed_opt), _local_state(model, optimizer)
    return {"saved": saved, "final": lr.full_state_dict(model),
            "bitwise": got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)}


def check_world2_loads(root: str) -> dict:
    """Load the world-1 checkpoint resharded over 2 ranks, train the same 2 steps on half batches each."""
    rank = dist.get_rank()
    data = make_batches(4, BATCH)
    model = lr.fully_shard(make_model(seed=7))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = ck.load(root, model, [optimizer])
    loaded = lr.full_state_dict(model)
    for step in range(extra["step"], 4):
        _train_step(model, optimizer, data[step][rank * BATCH // 2 : (rank + 1) * BATCH // 2])
    return {"loaded": loaded, "final": lr.full_state_dict(model)}


def test_world1_checkpoint_round_trip_and_load_at_world2(dist_pool, tmp_path: Path):
    root = str(tmp_path / "world1")
    result = dist_pool(1).run(check_world1_round_trip, root)[0]
    assert result["bitwise"], result
    for resumed in dist_pool(2).run(check_world2_loads, root):
        assert all(torch.equal(resumed["loaded"][k], v) for k, v in result["saved"].items())  # loading copies
        # two ranks sum two half-batch gradients (gloo, fp32): the tolerance of the resharded resumes
        # of test_checkpoint.py
        assert max((resumed["final"][k] - v).abs().max().item() for k, v in result["final"].items()) < 1e-5


# --------------------------------------------------------------------- fp8 all-gather
def check_fp8_keeps_its_gather() -> dict:
    from tests.test_fp8_gather import check_training

    model = lr.fully_shard(make_model(), fp8_all_gather=lr.Float8AllGather(tile=4))
    state = lr.get_state(model)
    lm_loss(model, make_batches(1, BATCH)[0]).backward()
    fp8 = [b for b in state.dbuffers() if b.fp8_gather is not None]
    return {
        "training": check_training(4),
        "fp8_aliased": [b.full_is_shard for b in fp8],
        "others_aliased": [b.full_is_shard for b in state.dbuffers() if b.fp8_gather is None],
        "all_gathers": state.stats.all_gathers,
        "fp8_dbuffers": len(fp8),
    }


def test_fp8_all_gather_keeps_its_path_at_world1(dist_pool):
    result = dist_pool(1).run(check_fp8_keeps_its_gather)[0]
    # the fp8 weights dequantize into a full buffer of their own (the master shard must stay fp32)
    assert result["fp8_dbuffers"] > 0 and not any(result["fp8_aliased"]) and all(result["others_aliased"]), result
    assert result["all_gathers"] == 2 * result["fp8_dbuffers"], result  # block groups: forward + backward re-gather
    # test_fp8_gather.py's oracle, single-process fake-quantized training, and its tolerance
    assert result["training"]["max_diff"] <= 1e-5, result["training"]


# ------------------------------------------------------------------- the device schedule
def check_stream_schedule() -> dict:
    """``tests/test_streams.py``'s fake streams and ordering rules at world 1: the cast on the all-gather stream."""
    from tests.test_streams import Recorder, check_log, instrument

    data = make_batches(3, BATCH)
    result = {}
    for name, policy in (("fp32", None), ("bf16", BF16)):
        model = lr.fully_shard(make_model(), mp_policy=policy)
        recorder = Recorder(ordered=True)
        instrument(model, recorder)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        optimizer.register_step_pre_hook(lambda *_, log=recorder.log: log.append(("step",)))
        for batch in data:
            _train_step(model, optimizer, batch)
        state = lr.get_state(model)
        unshards = len(data) * sum(len(g.dbuffers) * (1 if g.is_root else 2) for g in state.all_groups)
        result[name] = dict(check_log(recorder.log, ordered=True, hsdp=False), unshards=unshards,
                            reductions=len(data) * len(list(state.dbuffers())))
    return result


def test_stream_schedule_at_world1_follows_the_ordering_rules(dist_pool):
    result = dist_pool(1).run(check_stream_schedule)[0]
    bf16, fp32 = result["bf16"], result["fp32"]
    # bf16: every cast runs in an all-gather span compute waits before any use, every gradient
    # buffer is adopted after compute waited its (empty) reduce span; no collective anywhere
    assert bf16["problems"] == [], bf16
    assert len(bf16["spans"]["all_gather"]) == bf16["unshards"] and not any(bf16["spans"]["all_gather"]), bf16
    for run in (bf16, fp32):
        assert len(run["spans"]["reduce"]) == run["frees"] == run["reductions"], run
        assert not any(run["spans"]["reduce"]) and run["steps"] == 3, run
    assert fp32["spans"]["all_gather"] == [], fp32  # the shards are the full buffer: nothing to issue
