"""The comm stream schedule (``engine/streams.py``) and the kept cast of the shard, on 2 and 3 gloo ranks.

There is no accelerator here, so fake streams are injected: they log every ``wait_stream``,
``wait_event``, ``record_event`` and stream entry in program order, which is the order the
device would see them. A dispatch mode logs each kernel with the stream current at it (the
storages it touched and created; collectives by name), finalizers log the death of storages a
side stream read, an observer logs the DBuffers' events, and hooks on the modules log each use
of a group's parameters. The oracles: the ordering and memory rules of ``streams.py`` checked on
that log, the single-process model (parity; for fp8 with the per-tile fake-quantization of
``test_fp8_gather.py``), the same sharded training on the CPU's no-op streams (bitwise), the
storage actually allocated (the probe's byte gauges), counts derived from the number of DBuffers,
and the same training with the knob off (bitwise).
"""

from __future__ import annotations

import itertools
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import lightning_ragged as lr
from lightning_ragged.engine import streams as streams_module
from lightning_ragged.engine.streams import NO_STREAMS, CommStreams
from tests.models import lm_loss, make_batches, make_model
from tests.test_fp8_gather import _fake_quant_step
from tests.test_fully_shard import BATCH, _local, _max_diff

WORLD_SIZES = [2, 3]
STEPS = 3
MIXED = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
FP8_TILE = 4


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


def _sid(tensor: torch.Tensor) -> int:
    """A storage's identity (stable across ``resize_``; reused only after it died)."""
    return tensor.untyped_storage()._cdata


class KernelLog(TorchDispatchMode):
    """Logs every c10d collective with the stream current at its issue, its dtype kind; and every kernel (views
    excluded: they touch no memory) as ("op", stream, "namespace::name", storages touched, storages created; a
    storage can be born at a dead one's address, e.g. one a backend made inside a collective, so every birth is
    logged, ``torch.tensor(data)``'s at its ``lift_fresh``). Made
    on compute and touched by a side stream, a storage gets a finalizer that logs ("dead", storage) when it is
    freed (what a backend allocates inside a collective is the side stream's, as the buffers made there)."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.made_on_compute: dict[int, weakref.ref] = {}
        self.watched: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        stream, name = self.recorder.current().name, func._schema.name
        if func.namespace == "c10d":
            self.recorder.log.append(("collective", name.split("::")[1], stream, inputs[0].is_floating_point()))
        out = func(*args, **kwargs)
        if func is torch.ops.aten.lift_fresh.default:  # torch.tensor(data): an alias of a tensor born outside the mode
            self.recorder.log.append(("op", stream, name, frozenset({_sid(out)}), frozenset({_sid(out)})))
            return out
        if func.is_view or func is torch.ops.aten.set_.source_Storage_storage_offset:
            return out
        touched = {_sid(t) for t in inputs}
        created = {_sid(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)} - touched
        self.recorder.log.append(("op", stream, name, frozenset(touched | created), frozenset(created)))
        if stream == "compute":
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and _sid(tensor) in created:
                    self.made_on_compute[_sid(tensor)] = weakref.ref(tensor.untyped_storage())
            return out
        for tensor in inputs:
            storage, sid = tensor.untyped_storage(), _sid(tensor)
            made = self.made_on_compute.get(sid)
            if sid not in self.watched and made is not None and made() is storage:
                self.watched.add(sid)
                weakref.finalize(storage, self._dead, sid)
        return out

    def _dead(self, sid: int) -> None:
        self.watched.discard(sid)
        self.recorder.log.append(("dead", sid))


class EventLog:
    """Observer: every DBuffer event, by the DBuffer's index, and whether its full buffer is allocated then."""

    def __init__(self, recorder: Recorder, index: dict[int, int]) -> None:
        self.recorder, self.index = recorder, index

    def on_event(self, event) -> None:
        allocated = event.dbuffer.unsharded.untyped_storage().nbytes() > 0
        self.recorder.log.append(("dbuffer", event.kind.name, self.index[id(event.dbuffer)], allocated))


class ProbeCheck:
    """Observer after the probe's: its full-buffer gauge against the storage really allocated, at every event."""

    def __init__(self, engine_probe, dbuffers: list) -> None:
        self.probe, self.dbuffers = engine_probe, dbuffers
        self.mismatches: list[tuple[int, int]] = []
        self.actual_peak = 0

    def on_event(self, event) -> None:
        actual = sum(b.unsharded.untyped_storage().nbytes() for b in self.dbuffers if not b.full_is_shard)
        self.actual_peak = max(self.actual_peak, actual)
        if self.probe.unsharded_bytes != actual:
            self.mismatches.append((self.probe.unsharded_bytes, actual))


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
    """The ordering and memory rules of ``streams.py`` on a log; the violations found and what was seen.

    An event recorded on a stream is finished for compute once compute waited it or a later event of that
    stream (a stream runs in order). Rule 1: a side stream is entered right after it waited for compute.
    Rule 2: compute uses a group only after waiting its all-gather, steps only after waiting every reduction.
    Rule 3: compute touches nothing a side stream touched before waiting that stream's event (so nothing
    allocated there is read early); a storage a side stream read dies, a full buffer is freed (RESHARDED)
    and a gradient buffer is freed only after compute waited the event of the last collective on them.
    """
    problems: list[str] = []
    waited: set[int] = set()
    stream_of: dict[int, str] = {}
    done: dict[str, int] = {}
    touched_by: dict[int, int] = {}  # storage -> the latest side event that touched it
    span_storages: set[int] = set()
    unclaimed: dict[str, int] = {}
    gather_event: dict[int, int] = {}
    reduce_event: dict[int, int] = {}
    allocated: dict[str, dict[int, set[bool]]] = {"UNSHARD_ISSUED": {}, "UNSHARD_WAITED": {}}
    spans: dict[str, list[list[str]]] = {"all_gather": [], "reduce": []}
    span: list[str] | None = None
    seen = dict(uses=0, frees=0, steps=0, resharded=0, deaths=0, compute_reads=0)
    previous = None

    def finished(event: int | None) -> bool:
        return event is not None and event <= done.get(stream_of.get(event, ""), -1)

    for i, entry in enumerate(log):
        kind = entry[0]
        if kind == "enter":
            if previous != ("wait_stream", entry[1], "compute"):
                problems.append(f"{i}: entered {entry[1]} without waiting for compute right before")
            span, span_storages = [], set()
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
            stream_of[entry[2]] = entry[1]
            touched_by.update(dict.fromkeys(span_storages, entry[2]))
        elif kind == "wait_event":
            if entry[1] != "compute":
                problems.append(f"{i}: {entry[1]} waited an event (only compute does)")
            waited.add(entry[2])
            stream = stream_of[entry[2]]
            done[stream] = max(done.get(stream, -1), entry[2])
        elif kind == "collective":
            _, name, stream, floating = entry
            if "allgather" in name and stream != "all_gather":
                problems.append(f"{i}: all-gather issued on {stream}")
            elif floating and ("allreduce" in name or "reduce_scatter" in name):
                if stream != "reduce" and (ordered or not hsdp):  # CPU order: HSDP's replica follows at the wait
                    problems.append(f"{i}: gradient reduction {name} issued on {stream}")
            if span is not None:
                span.append(name)
        elif kind == "op":
            _, stream, name, touched, created = entry
            for sid in created:  # a new storage (maybe at a dead one's address): nothing touched it yet
                touched_by.pop(sid, None)
            if stream != "compute":
                span_storages |= touched
            elif not (name.startswith("c10d::") and hsdp and not ordered):  # CPU order: the replica at the wait
                early = [sid for sid in touched if sid in touched_by and not finished(touched_by[sid])]
                seen["compute_reads"] += sum(1 for sid in touched if sid in touched_by)
                if early:
                    problems.append(f"{i}: compute ran {name} on memory a side stream touched, before waiting it")
        elif kind == "dead":
            seen["deaths"] += 1
            if entry[1] in touched_by and not finished(touched_by.pop(entry[1])):
                problems.append(f"{i}: a tensor a side stream read was freed before compute waited that stream")
        elif kind == "dbuffer":
            _, event, d, is_allocated = entry
            if event in allocated:
                allocated[event].setdefault(d, set()).add(is_allocated)
            if event == "UNSHARD_ISSUED":
                gather_event[d] = unclaimed.pop("all_gather", None)
            elif event == "REDUCE_ISSUED":
                reduce_event[d] = unclaimed.pop("reduce", None)
            elif event == "UNSHARD_WAITED" and gather_event.get(d) not in waited:
                problems.append(f"{i}: all-gather of DBuffer {d} waited without compute waiting its event")
            elif event == "RESHARDED":
                seen["resharded"] += 1
                if not finished(gather_event.get(d)):
                    problems.append(f"{i}: full buffer {d} freed before compute waited its latest all-gather")
            elif event == "GRAD_BUFFER_FREED":
                seen["frees"] += 1
                if d in reduce_event and not finished(reduce_event[d]):
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
        if kind != "dead":  # a finalizer may run on a backend thread at any point
            previous = entry
    if unclaimed:
        problems.append(f"events recorded but no collective issued after them: {unclaimed}")
    if None in gather_event.values() or None in reduce_event.values():
        problems.append("a collective was issued without an event recorded on its stream")
    return dict(problems=problems[:10], spans=spans, allocated=allocated, **seen)


def _hsdp_groups() -> dict:
    """HSDP on the whole world: shard groups of one rank, one replicate group of every rank."""
    world = dist.get_world_size()
    shard, _ = dist.new_subgroups_by_enumeration([[rank] for rank in range(world)])
    replicate, _ = dist.new_subgroups_by_enumeration([list(range(world))])
    return dict(process_group=shard, replicate_group=replicate)


KNOBS = {  # the fully_shard arguments of each configuration
    "fp32": {},
    "bf16": dict(mp_policy=MIXED),
    "keep-cast": dict(mp_policy=MIXED, keep_cast_shard=True),
    "fp8": dict(fp8_all_gather=lr.Float8AllGather(tile=FP8_TILE)),
    "fp8-keep": dict(fp8_all_gather=lr.Float8AllGather(tile=FP8_TILE), keep_cast_shard=True),  # the chunk kept
}


def check_schedule(streams: str, hsdp: bool, reduce_mode: str | None, knob: str) -> dict:
    """STEPS AdamW steps with no-op or fake streams; the log's verdict, counts and the distance to the oracle:
    one process (fp32; fp8: fake-quantized weights), or the same sharding on no-op streams, keep_cast_shard off."""
    from lightning_ragged.observability.metrics import EngineMetrics
    from lightning_ragged.observability.probes import probe

    # the fake streams play a device's schedule: the backend's all-gather, as on a device (not gloo's pairwise)
    kwargs = dict(_hsdp_groups() if hsdp else {}, reduce_mode=reduce_mode,
                  gather_mode=None if streams == "noop" else "all_gather")
    data = make_batches(STEPS, BATCH)
    model = lr.fully_shard(make_model(), **kwargs, **KNOBS[knob])
    state = lr.get_state(model)
    dbuffers = list(state.dbuffers())
    recorder = Recorder(ordered=streams == "ordered")
    timing = TimingEvents(recorder)
    noop_streams = state.comm_streams is NO_STREAMS  # what a CPU model gets
    if streams != "noop":
        instrument(model, recorder)
        metrics = EngineMetrics(model, event_factory=timing)  # the probe's timer records on the comm streams
        probe_check = ProbeCheck(probe(model), dbuffers)  # the probe EngineMetrics subscribed
        for dbuffer in dbuffers:
            dbuffer.observers.append(probe_check)
    sharded_reference = "mp_policy" in KNOBS[knob]
    reference = lr.fully_shard(make_model(), **kwargs, mp_policy=MIXED) if sharded_reference else make_model()
    fp8_names = {name for b in dbuffers if b.fp8_gather is not None for name in b.sharded_params}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.register_step_pre_hook(lambda *_: recorder.log.append(("step",)))
    opt.register_step_post_hook(lambda *_: recorder.log.append(("stepped",)))
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(STEPS):
        with KernelLog(recorder):
            lm_loss(model, _local(data[step])).backward()
            opt.step()
        opt.zero_grad()
        if sharded_reference:
            lm_loss(reference, _local(data[step])).backward()
        elif fp8_names:
            _fake_quant_step(reference, fp8_names, data[step], FP8_TILE)
        else:
            lm_loss(reference, data[step]).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    if streams != "noop":
        metrics.close()
    full = lr.full_state_dict(model)
    if sharded_reference:
        expected = lr.full_state_dict(reference)
        max_diff = max((full[k].float() - expected[k].float()).abs().max().item() for k in expected)
    else:
        max_diff = _max_diff(full, reference)
    segments = sum(b.layout.segment_size * b.unsharded_grad.element_size() for b in dbuffers)
    return {
        **check_log(recorder.log, streams == "ordered", hsdp),
        "stats": vars(state.stats).copy(),
        "dbuffers": len(dbuffers),
        "fp8_dbuffers": {i for i, b in enumerate(dbuffers) if b.fp8_gather is not None},
        "segment_bytes": segments,
        "timing_streams": sorted(set(timing.streams)),
        "timed_on": {name: timing.streams.count(name) for name in ("all_gather", "reduce")},
        "max_diff": max_diff,
        "noop_streams": noop_streams,
        "source_streams": _source_streams(recorder.log, {_sid(b.sharded) for b in dbuffers}),
        "probe": None if streams == "noop" else (probe_check.mismatches[:5], probe_check.probe.unsharded_peak_bytes,
                                                probe_check.actual_peak),
    }


def _source_streams(log: list[tuple], shards: set[int]) -> list[str]:
    """The streams of the kernels that read a shard to make an all-gather's source (a cast, an fp8 quantization):
    every kernel on a shard but the collectives (fp32 sends the shard itself) and the optimizer step's."""
    streams, stepping = set(), False
    for entry in log:
        stepping = entry[0] == "step" or (stepping and entry[0] != "stepped")
        if entry[0] == "op" and not stepping and not entry[2].startswith("c10d::") and entry[3] & shards:
            streams.add(entry[1])
    return sorted(streams)


CASES = {  # (streams, reduce_mode, knob): the device schedule (ordered: synchronous collectives on the comm streams)
    "noop": ("noop", None, "fp32"),  # and the CPU one (the backend's async_op, Work.wait() at the wait)
    "fake-ordered-reduce-scatter": ("ordered", "reduce_scatter", "fp32"),
    "fake-unordered-all-reduce": ("unordered", "all_reduce", "fp32"),
    "fake-ordered-bf16": ("ordered", "reduce_scatter", "bf16"),
    "fake-ordered-keep-cast": ("ordered", "reduce_scatter", "keep-cast"),
    "fake-ordered-fp8": ("ordered", "all_reduce", "fp8"),
    "fake-ordered-fp8-keep": ("ordered", "reduce_scatter", "fp8-keep"),
}
SOURCE_STREAMS = {  # where a gather's source is made from the shard: a fresh one beside compute, a kept one on it
    "fp32": [], "bf16": ["all_gather"], "keep-cast": ["compute"], "fp8": ["all_gather"], "fp8-keep": ["compute"],
}
KEPT = ("keep-cast", "fp8-keep")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", list(CASES))
def test_schedule_orders_streams_and_matches_single_process(dist_pool, world_size, case):
    streams, reduce_mode, knob = CASES[case]
    for hsdp in (False, True):
        for result in dist_pool(world_size).run(check_schedule, streams, hsdp, reduce_mode, knob):
            stats, dbuffers = result["stats"], result["dbuffers"]
            # one process: the fp32 parity bound of the engine's tests; bitwise against the same sharding
            assert result["max_diff"] <= (0.0 if knob in ("bf16", "keep-cast") else 1e-5), (hsdp, result["max_diff"])
            assert stats["reduces"] == STEPS * dbuffers, stats
            replicas = stats["reduces"] if hsdp else 0  # one replica all-reduce per reduction, of its segment
            assert stats["replica_all_reduces"] == replicas, stats
            assert stats["replica_all_reduce_bytes"] == (STEPS * result["segment_bytes"] if hsdp else 0), stats
            assert result["noop_streams"]  # a CPU model runs on no-op streams (the fakes replace them here)
            if streams == "noop":
                continue
            assert result["problems"] == [], (hsdp, result["problems"])
            assert result["compute_reads"] > 0 and result["resharded"] > 0  # the memory checks saw something
            assert (result["deaths"] > 0) == (knob in KEPT), result["deaths"]  # compute's kept sources, freed
            gathers, reduces = result["spans"]["all_gather"], result["spans"]["reduce"]
            assert len(gathers) == stats["all_gathers"] and all(len(span) == 1 for span in gathers), gathers
            chained = 2 if hsdp and streams == "ordered" else 1  # HSDP on a device: the replica on the reduce stream
            assert len(reduces) == stats["reduces"] and all(len(span) == chained for span in reduces), reduces
            assert result["uses"] > 0 and result["frees"] == stats["reduces"] and result["steps"] == STEPS
            # timing events: the start and wait points on compute, the completion on the comm stream it ran on
            expected_timed = {"all_gather": stats["all_gathers"], "reduce": stats["reduces"]}
            assert result["timed_on"] == (expected_timed if streams == "ordered" else {"all_gather": 0, "reduce": 0})
            assert result["source_streams"] == SOURCE_STREAMS[knob], result["source_streams"]
            # an fp8 DBuffer's full buffer exists from its wait on (the dequantize), every other one from its issue
            fp8 = result["fp8_dbuffers"]
            assert bool(fp8) == knob.startswith("fp8")
            issued, waited = result["allocated"]["UNSHARD_ISSUED"], result["allocated"]["UNSHARD_WAITED"]
            assert issued and all(issued[d] == {d not in fp8} for d in issued), issued
            assert all(waited[d] == {True} for d in waited) and set(waited) == set(issued), waited
            mismatches, peak, actual_peak = result["probe"]
            assert mismatches == [] and peak == actual_peak > 0, result["probe"]  # the probe counts real storage


def _schedule_log() -> list[tuple]:
    """A correct log: a kept cast K of shard S gathered into full buffer F, used, freed; gradient buffer G reduced."""
    S, K, F, A, G, H = range(6)
    return [
        ("op", "compute", "aten::_to_copy", {S, K}, {K}),
        ("wait_stream", "all_gather", "compute"), ("enter", "all_gather"),
        ("collective", "_allgather_base_", "all_gather", True),
        ("op", "all_gather", "c10d::_allgather_base_", {F, K}, set()),
        ("record", "all_gather", 0), ("exit", "all_gather"), ("dbuffer", "UNSHARD_ISSUED", 0, True),
        ("wait_event", "compute", 0), ("dbuffer", "UNSHARD_WAITED", 0, True),
        ("use", "forward", (0,)), ("op", "compute", "aten::mm", {F, A}, {A}),
        ("dbuffer", "RESHARDED", 0, False), ("dead", K),
        ("op", "compute", "aten::zero_", {G}, set()),
        ("wait_stream", "reduce", "compute"), ("enter", "reduce"),
        ("collective", "allreduce_", "reduce", True), ("op", "reduce", "c10d::allreduce_", {G}, set()),
        ("record", "reduce", 1), ("exit", "reduce"), ("dbuffer", "REDUCE_ISSUED", 0, True),
        ("wait_event", "compute", 1), ("dbuffer", "REDUCE_WAITED", 0, True),
        ("op", "compute", "aten::mul", {G, H}, {H}), ("dbuffer", "GRAD_BUFFER_FREED", 0, True), ("step",),
    ]


def _before(log: list[tuple], entry: tuple, anchor: tuple) -> list[tuple]:
    """``log`` with ``entry`` moved right before ``anchor``."""
    moved = [e for e in log if e != entry]
    moved.insert(moved.index(anchor), entry)
    return moved


GATHERED, REDUCED = ("wait_event", "compute", 0), ("wait_event", "compute", 1)
BROKEN = {  # one rule broken each: (the log, what check_log must say)
    "used before the wait": (lambda log: _before(log, GATHERED, ("dbuffer", "RESHARDED", 0, False)),
                             ["forward use of DBuffer 0 before", "compute ran aten::mm on memory a side stream"]),
    "full buffer freed early": (lambda log: _before(log, ("dbuffer", "RESHARDED", 0, False), GATHERED),
                                ["full buffer 0 freed before compute waited its latest all-gather"]),
    "kept cast freed early": (lambda log: _before(log, ("dead", 1), GATHERED),
                              ["a tensor a side stream read was freed before compute waited"]),
    "gradient buffer freed early": (lambda log: _before(log, ("dbuffer", "GRAD_BUFFER_FREED", 0, True), REDUCED),
                                    ["gradient buffer 0 freed before compute waited its reduction"]),
    "reduced segment read early": (lambda log: _before(log, ("op", "compute", "aten::mul", {4, 5}, {5}), REDUCED),
                                   ["compute ran aten::mul on memory a side stream touched"]),
    "stepped early": (lambda log: _before(log, ("step",), REDUCED), ["optimizer step before compute waited"]),
    "side stream did not wait": (lambda log: [e for e in log if e != ("wait_stream", "all_gather", "compute")],
                                 ["entered all_gather without waiting for compute"]),
}


@pytest.mark.parametrize("broken", list(BROKEN))
def test_check_log_flags_each_broken_rule(broken):
    """The log checker itself: silent on a correct log, naming the rule on a log that breaks one."""
    assert check_log(_schedule_log(), ordered=True, hsdp=False)["problems"] == []
    make, expected = BROKEN[broken]
    problems = check_log(make(_schedule_log()), ordered=True, hsdp=False)["problems"]
    assert all(any(text in p for p in problems) for text in expected), problems


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


class _Casts(TorchDispatchMode):
    """Counts casts (``aten._to_copy``) that read a DBuffer's sharded segment."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages, self.count = storages, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage()._cdata in self.storages:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _train(keep: bool, fused: bool, mode: str) -> dict:
    """STEPS steps: one batch ("plain"), two micro-batches, the first under no_sync ("accumulate"), or the same with
    the last micro-batch's forward and backward in the closure of ``opt.step(closure)``, as Lightning runs them."""
    model = lr.fully_shard(make_model(), mp_policy=MIXED, keep_cast_shard=keep)
    state = lr.get_state(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    casts = _Casts({b.sharded.untyped_storage()._cdata for b in state.dbuffers()})
    data = make_batches(STEPS, BATCH)
    per_step, losses, kept = [], [], []
    for step in range(STEPS):
        before = casts.count
        local = _local(data[step])
        last = local
        with casts:
            if mode != "plain":
                first, last = local.chunk(2)
                with lr.no_sync(model):  # after a closure step: must not see the cast of the weights before it
                    (lm_loss(model, first) * len(first) / len(local)).backward()

            def closure() -> torch.Tensor:
                loss = lm_loss(model, last) * len(last) / len(local)
                loss.backward()
                kept.append(sum(b.shard_cast.kept_bytes for b in state.dbuffers()))
                return loss

            if mode == "closure":
                loss = opt.step(closure)
            else:
                loss = closure()
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


KEEP_RUNS = ((False, "plain"), (True, "plain"), (True, "accumulate"), (True, "closure"))  # (fused AdamW, mode)


def check_keep_cast_shard() -> dict:
    runs = {(keep, fused, mode): _train(keep, fused, mode) for keep in (False, True) for fused, mode in KEEP_RUNS}
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
        for fused, mode in KEEP_RUNS:
            off, on = runs[(False, fused, mode)], runs[(True, fused, mode)]
            blocks, root = on["blocks"], on["root"]
            micro = 1 if mode == "plain" else 2
            assert off["casts"] == [micro * (2 * blocks + root)] * STEPS, off["casts"]  # blocks twice, root once
            # once per DBuffer per optimizer step; a closure's forward comes after the step's pre-hook dropped them
            forwards = 2 if mode == "closure" else 1
            assert on["casts"] == [forwards * (blocks + root)] * STEPS, (mode, on["casts"])
            assert on["kept"] == [on["cast_bytes"]] * STEPS and off["kept"] == [0] * STEPS
            # bitwise: the kept cast is the cast; a stale one (missed by fused AdamW, or kept past a closure's
            # step without the post-step hook) changes the losses
            assert on["losses"] == off["losses"], (fused, mode)
            assert all(torch.equal(on["full"][k], off["full"][k]) for k in off["full"]), (fused, mode)
            assert torch.equal(on["edited"], off["edited"]) and not torch.equal(on["edited"], on["evaluated"])
        assert "keep_cast_shard='yes'" in result["refused"] and "keep_cast_shard=True" in result["refused"]


# -------------------------------------------------------------- device streams
class _TorchStream:
    """Stands in for ``torch.Stream``: remembers how it was made."""

    made: list[dict] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        _TorchStream.made.append(kwargs)


def test_device_streams_on_an_accelerator_are_two_high_priority_streams(monkeypatch):
    """``device_streams`` / ``has_streams`` against a fake accelerator (oracle: the calls torch would receive)."""
    cuda1 = torch.device("cuda", 1)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: ("current", device))
    monkeypatch.setattr(torch, "Stream", _TorchStream)
    _TorchStream.made.clear()
    assert streams_module.has_streams(cuda1) and streams_module.has_streams("cuda")
    assert not streams_module.has_streams(torch.device("cpu")) and not streams_module.has_streams(None)
    made = streams_module.device_streams(cuda1)
    assert _TorchStream.made == [dict(device=cuda1, priority=-1)] * 2  # high priority, on the model's device
    assert made.all_gather is not made.reduce and made.ordered
    assert made.compute == ("current", cuda1)  # looked up at each use: the current stream of that device
    assert made.timing_stream(True) is made.all_gather and made.timing_stream(False) is made.reduce
    assert streams_module.device_streams(torch.device("cpu")) is NO_STREAMS
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: None)
    assert streams_module.device_streams(cuda1) is NO_STREAMS
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert streams_module.device_streams(cuda1) is NO_STREAMS
    assert len(_TorchStream.made) == 2  # the CPU answers made none
    assert NO_STREAMS.timing_stream(True) is None and not NO_STREAMS.ordered
