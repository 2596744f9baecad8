"""The comm stream schedule (``engine/streams.py``) and the kept cast of the shard, on 2 and 3 gloo ranks.

There is no accelerator here, so fake streams are injected: they log every ``wait_stream``,
``wait_event``, ``record_event`` and stream entry in program order, which is the order the
device would see them. A dispatch mode logs each collective with the stream current at its
issue, an observer logs the DBuffers' events, and hooks on the modules log each use of a
group's parameters. The oracles: the ordering rules of ``streams.py`` checked on that log,
the single-process model (parity), counts derived from the number of DBuffers, and the same
training with the knob off (bitwise).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import lightning_ragged as lr
from lightning_ragged.engine.streams import CommStreams
from tests.models import lm_loss, make_batches, make_model
from tests.test_fully_shard import BATCH, _local, _max_diff

WORLD_SIZES = [2, 3]
STEPS = 3


# ------------------------------------------------------------------ the log
class Recorder:
    """Fake comm streams that log what the schedule asks of them; the current stream is the innermost entered."""

    def __init__(self, ordered: bool) -> None:
        self.log: list[tuple] = []
        self.stack: list[FakeStream] = []
        self.numbers = itertools.count()
        self.compute = FakeStream("compute", self)
        self.streams = CommStreams(FakeStream("all_gather", self), FakeStream("reduce", self), self.current, ordered)

    def current(self) -> "FakeStream":
        return self.stack[-1] if self.stack else self.compute


class FakeStream:
    def __init__(self, name: str, recorder: Recorder) -> None:
        self.name, self.recorder = name, recorder

    def wait_stream(self, stream: "FakeStream") -> None:
        self.recorder.log.append(("wait_stream", self.name, stream.name))

    def wait_event(self, event: int) -> None:
        self.recorder.log.append(("wait_event", self.name, event))

    def record_event(self) -> int:
        event = next(self.recorder.numbers)
        self.recorder.log.append(("record", self.name, event))
        return event

    def __enter__(self) -> "FakeStream":
        self.recorder.stack.append(self)
        self.recorder.log.append(("enter", self.name))
        return self

    def __exit__(self, *exc) -> None:
        self.recorder.stack.pop()
        self.recorder.log.append(("exit", self.name))


class CollectiveLog(TorchDispatchMode):
    """Logs every c10d collective with the stream current at its issue, its dtype kind and size."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            tensor = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            name = func._schema.name.split("::")[1]
            self.recorder.log.append(("collective", name, self.recorder.current().name, tensor.is_floating_point()))
        return func(*args, **(kwargs or {}))


class EventLog:
    """Observer: every DBuffer event, by the DBuffer's index."""

    def __init__(self, recorder: Recorder, index: dict[int, int]) -> None:
        self.recorder, self.index = recorder, index

    def on_event(self, event) -> None:
        self.recorder.log.append(("dbuffer", event.kind.name, self.index[id(event.dbuffer)]))


class TimingEvents:
    """An event factory for the probe's timer: which stream each timing event was recorded on."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.streams: list[str] = []

    def __call__(self) -> "TimingEvents":
        return self

    def record(self, stream: FakeStream | None = None) -> None:
        self.streams.append((stream or self.recorder.current()).name)

    def query(self) -> bool:
        return True

    def elapsed_time(self, end) -> float:
        return 0.0


def instrument(model, recorder: Recorder) -> dict[int, int]:
    """Inject the fake streams, subscribe the event log, log each module's use of its DBuffers (forward, backward)."""
    state = lr.get_state(model)
    state.set_comm_streams(recorder.streams)
    index = {id(dbuffer): i for i, dbuffer in enumerate(state.dbuffers())}
    for dbuffer in state.dbuffers():
        dbuffer.observers.append(EventLog(recorder, index))
    users: dict[int, tuple] = {}
    for group in state.all_groups:
        for module, _attr, dbuffer, _name in group.slots:
            if module is not model:  # the leaf modules that hold parameters: their kernels read them
                users.setdefault(id(module), (module, set()))[1].add(index[id(dbuffer)])
    for module, used in users.values():
        ids = tuple(sorted(used))
        module.register_forward_pre_hook(lambda _m, _a, ids=ids: recorder.log.append(("use", "forward", ids)))
        module.register_full_backward_pre_hook(lambda _m, _g, ids=ids: recorder.log.append(("use", "backward", ids)))
    return index


def check_log(log: list[tuple], ordered: bool, hsdp: bool) -> dict:
    """The ordering rules of ``streams.py`` on a log; the violations found and what was seen."""
    problems: list[str] = []
    waited: set[int] = set()
    unclaimed: dict[str, int] = {}
    gather_event: dict[int, int] = {}
    reduce_event: dict[int, int] = {}
    spans: dict[str, list[list[str]]] = {"all_gather": [], "reduce": []}
    span: list[str] | None = None
    seen = dict(uses=0, frees=0, steps=0)
    previous = None
    for i, entry in enumerate(log):
        kind = entry[0]
        if kind == "enter":
            if previous != ("wait_stream", entry[1], "compute"):
                problems.append(f"{i}: entered {entry[1]} without waiting for compute right before")
            span = []
        elif kind == "exit":
            spans[entry[1]].append(span)
            span = None
        elif kind == "wait_stream":
            if entry[1] == "compute" or entry[2] != "compute":
                problems.append(f"{i}: {entry}")
        elif kind == "record":
            if span is None:
                problems.append(f"{i}: event recorded on {entry[1]} outside its span")
            unclaimed[entry[1]] = entry[2]
        elif kind == "wait_event":
            if entry[1] != "compute":
                problems.append(f"{i}: {entry[1]} waited an event (only compute does)")
            waited.add(entry[2])
        elif kind == "collective":
            _, name, stream, floating = entry
            if "allgather" in name and stream != "all_gather":
                problems.append(f"{i}: all-gather issued on {stream}")
            elif floating and ("allreduce" in name or "reduce_scatter" in name):
                if stream != "reduce" and (ordered or not hsdp):  # CPU order: HSDP's replica follows at the wait
                    problems.append(f"{i}: gradient reduction {name} issued on {stream}")
            if span is not None:
                span.append(name)
        elif kind == "dbuffer":
            _, event, d = entry
            if event == "UNSHARD_ISSUED":
                gather_event[d] = unclaimed.pop("all_gather", None)
            elif event == "REDUCE_ISSUED":
                reduce_event[d] = unclaimed.pop("reduce", None)
            elif event == "UNSHARD_WAITED" and gather_event.get(d) not in waited:
                problems.append(f"{i}: all-gather of DBuffer {d} waited without compute waiting its event")
            elif event == "GRAD_BUFFER_FREED":
                seen["frees"] += 1
                if d in reduce_event and reduce_event[d] not in waited:
                    problems.append(f"{i}: gradient buffer {d} freed before compute waited its reduction")
        elif kind == "use":
            seen["uses"] += 1
            for d in entry[2]:
                if gather_event.get(d) not in waited:
                    problems.append(f"{i}: {entry[1]} use of DBuffer {d} before compute waited its all-gather")
        elif kind == "step":
            seen["steps"] += 1
            if not set(reduce_event.values()) <= waited:
                problems.append(f"{i}: optimizer step before compute waited every reduction")
        previous = entry
    if unclaimed:
        problems.append(f"events recorded but no collective issued after them: {unclaimed}")
    if None in gather_event.values() or None in reduce_event.values():
        problems.append("a collective was issued without an event recorded on its stream")
    return dict(problems=problems[:10], spans=spans, **seen)


def _hsdp_groups() -> dict:
    """HSDP on the whole world: shard groups of one rank, one replicate group of every rank."""
    world = dist.get_world_size()
    shard, _ = dist.new_subgroups_by_enumeration([[rank] for rank in range(world)])
    replicate, _ = dist.new_subgroups_by_enumeration([list(range(world))])
    return dict(process_group=shard, replicate_group=replicate)


def check_schedule(streams: str, hsdp: bool, reduce_mode: str | None) -> dict:
    """STEPS AdamW steps with no-op or fake streams; the log's verdict, counts and the distance to one process."""
    from lightning_ragged.observability.metrics import EngineMetrics

    kwargs = dict(_hsdp_groups() if hsdp else {}, reduce_mode=reduce_mode)
    data = make_batches(STEPS, BATCH)
    model = lr.fully_shard(make_model(), **kwargs)
    state = lr.get_state(model)
    recorder = Recorder(ordered=streams == "ordered")
    timing = TimingEvents(recorder)
    if streams != "noop":
        instrument(model, recorder)
        metrics = EngineMetrics(model, event_factory=timing)  # the probe's timer records on the comm streams
    reference = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.register_step_pre_hook(lambda *_: recorder.log.append(("step",)))
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(STEPS):
        with CollectiveLog(recorder):
            lm_loss(model, _local(data[step])).backward()
            opt.step()
        opt.zero_grad()
        lm_loss(reference, data[step]).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    if streams != "noop":
        metrics.close()
    segments = sum(b.layout.segment_size * b.unsharded_grad.element_size() for b in state.dbuffers())
    return {
        **check_log(recorder.log, streams == "ordered", hsdp),
        "stats": vars(state.stats).copy(),
        "dbuffers": len(list(state.dbuffers())),
        "segment_bytes": segments,
        "timing_streams": sorted(set(timing.streams)),
        "timed_on": {name: timing.streams.count(name) for name in ("all_gather", "reduce")},
        "max_diff": _max_diff(lr.full_state_dict(model), reference),
    }


CASES = {  # (streams, reduce_mode): the device schedule (ordered: synchronous collectives on the comm streams)
    "noop": ("noop", None),  # and the CPU one (the backend's async_op, Work.wait() at the wait)
    "fake-ordered-reduce-scatter": ("ordered", "reduce_scatter"),
    "fake-unordered-all-reduce": ("unordered", "all_reduce"),
}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", list(CASES))
def test_schedule_orders_streams_and_matches_single_process(dist_pool, world_size, case):
    streams, reduce_mode = CASES[case]
    for hsdp in (False, True):
        for result in dist_pool(world_size).run(check_schedule, streams, hsdp, reduce_mode):
            stats, dbuffers = result["stats"], result["dbuffers"]
            assert result["max_diff"] <= 1e-5, (hsdp, result)
            assert stats["reduces"] == STEPS * dbuffers, stats
            replicas = stats["reduces"] if hsdp else 0  # one replica all-reduce per reduction, of its segment
            assert stats["replica_all_reduces"] == replicas, stats
            assert stats["replica_all_reduce_bytes"] == (STEPS * result["segment_bytes"] if hsdp else 0), stats
            if streams == "noop":
                assert result["spans"] == {"all_gather": [], "reduce": []}  # nothing was logged: no fakes
                continue
            assert result["problems"] == [], (hsdp, result["problems"])
            gathers, reduces = result["spans"]["all_gather"], result["spans"]["reduce"]
            assert len(gathers) == stats["all_gathers"] and all(len(span) == 1 for span in gathers), gathers
            chained = 2 if hsdp and streams == "ordered" else 1  # HSDP on a device: the replica on the reduce stream
            assert len(reduces) == stats["reduces"] and all(len(span) == chained for span in reduces), reduces
            assert result["uses"] > 0 and result["frees"] == stats["reduces"] and result["steps"] == STEPS
            # timing events: the start and wait points on compute, the completion on the comm stream it ran on
            expected_timed = {"all_gather": stats["all_gathers"], "reduce": stats["reduces"]}
            assert result["timed_on"] == (expected_timed if streams == "ordered" else {"all_gather": 0, "reduce": 0})


def test_timer_takes_completion_from_the_comm_stream() -> None:
    """In flight is start (compute) to completion (comm stream); the stall is the compute stream's wait."""
    from lightning_ragged.observability.device_timing import CollectiveTimer

    class Clock:
        now = 0.0

    class Side:
        latency = 2.0  # the collective completes 2 ms after its start point

    class Event:
        def record(self, stream=None):
            self.at = Clock.now + (stream.latency if stream is not None else 0.0)

        def query(self):
            return True

        def elapsed_time(self, end):
            return end.at - self.at

    timer = CollectiveTimer(Event)
    timer.issued("gather", Side())  # S = 0 on compute, D = 2 on the comm stream
    Clock.now = 4.0
    timer.mark()  # W = 4: compute enqueued until here
    Clock.now = 5.0
    timer.waited("gather", gather=True)  # E = 5
    timer.collect()
    assert timer.all_gather_seconds == pytest.approx(0.002)  # D - S, not E - S
    assert timer.blocked_seconds == pytest.approx(0.001)  # E - W


# -------------------------------------------------------------- keep_cast_shard
MIXED = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


class _Casts(TorchDispatchMode):
    """Counts casts (``aten._to_copy``) that read a DBuffer's sharded segment."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages, self.count = storages, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage()._cdata in self.storages:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _train(keep: bool, fused: bool, accumulate: bool) -> dict:
    model = lr.fully_shard(make_model(), mp_policy=MIXED, keep_cast_shard=keep)
    state = lr.get_state(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    casts = _Casts({b.sharded.untyped_storage()._cdata for b in state.dbuffers()})
    data = make_batches(STEPS, BATCH)
    per_step, losses, kept = [], [], []
    for step in range(STEPS):
        before = casts.count
        local = _local(data[step])
        with casts:
            if accumulate:
                first, second = local.chunk(2)
                with lr.no_sync(model):
                    (lm_loss(model, first) * len(first) / len(local)).backward()
                loss = lm_loss(model, second) * len(second) / len(local)
            else:
                loss = lm_loss(model, local)
            loss.backward()
            kept.append(sum(b.shard_cast.kept_bytes for b in state.dbuffers()))
            opt.step()
        opt.zero_grad()
        per_step.append(casts.count - before)
        losses.append(loss.item())
    tokens = _local(data[0])[:, :-1]
    with torch.no_grad():
        evaluated = model(tokens)  # an evaluation forward: its cast is kept
        for param in model.parameters():  # a write no optimizer makes: seen by the shard's version counter
            param.mul_(0.5)
        edited = model(tokens)
    return dict(casts=per_step, losses=losses, kept=kept, full=lr.full_state_dict(model), evaluated=evaluated,
                edited=edited, blocks=sum(len(g.dbuffers) for g in state.groups), root=len(state.root_group.dbuffers),
                cast_bytes=sum(b.layout.segment_size * 2 for b in state.dbuffers()))


def check_keep_cast_shard() -> dict:
    runs = {(keep, fused, accumulate): _train(keep, fused, accumulate)
            for keep in (False, True) for fused, accumulate in ((False, False), (True, False), (True, True))}
    try:
        lr.fully_shard(make_model(), keep_cast_shard="yes")
        refused = "no error"
    except TypeError as error:
        refused = str(error)
    return dict(runs=runs, refused=refused)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_keep_cast_shard_casts_once_per_step_with_identical_numerics(dist_pool, world_size):
    for result in dist_pool(world_size).run(check_keep_cast_shard):
        runs = result["runs"]
        for (fused, accumulate) in ((False, False), (True, False), (True, True)):
            off, on = runs[(False, fused, accumulate)], runs[(True, fused, accumulate)]
            blocks, root = on["blocks"], on["root"]
            micro = 2 if accumulate else 1
            assert off["casts"] == [micro * (2 * blocks + root)] * STEPS, off["casts"]  # blocks twice, root once
            assert on["casts"] == [blocks + root] * STEPS, on["casts"]  # once per DBuffer per optimizer step
            assert on["kept"] == [on["cast_bytes"]] * STEPS and off["kept"] == [0] * STEPS
            # bitwise: the kept cast is the cast; a stale one (e.g. missed by fused AdamW) changes the losses
            assert on["losses"] == off["losses"], (fused, accumulate)
            assert all(torch.equal(on["full"][k], off["full"][k]) for k in off["full"]), (fused, accumulate)
            assert torch.equal(on["edited"], off["edited"]) and not torch.equal(on["edited"], on["evaluated"])
        assert "keep_cast_shard='yes'" in result["refused"] and "keep_cast_shard=True" in result["refused"]
