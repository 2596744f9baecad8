"""Observability: engine metrics, the Lightning callback and endpoint, the plan CLI, diagnostics.

Engine checks run on the shared 2-rank gloo pool; the Lightning fit runs once as a
2-process script (``tests/observability_fit.py``) whose results several tests read.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import lightning_ragged as lr
from tests.models import lm_loss, make_batches, make_model

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3
BATCH = 4


def _local(batch: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = batch.shape[0] // world
    return batch[rank * per : (rank + 1) * per]


def expected_traffic(state) -> dict:
    """All-gather and reduce bytes/counts per step from the planned buffer sizes alone.

    With ``reshard_after_forward=True`` every block group is gathered twice (forward, backward);
    the root group stays unsharded from its forward to the end of backward (once). Every
    DBuffer's flat gradient is reduced once.
    """
    gathers = gather_bytes = reduce_bytes = dbuffers = 0
    for group in state.all_groups:
        times = 1 if group.is_root else 2
        for dbuffer in group.dbuffers:
            size = dbuffer.layout.buffer_numel * dbuffer.unsharded.element_size()
            gathers += times
            gather_bytes += times * size
            reduce_bytes += dbuffer.layout.buffer_numel * torch.empty((), dtype=dbuffer.reduce_dtype).element_size()
            dbuffers += 1
    return dict(all_gathers=gathers, all_gather_bytes=gather_bytes, reduces=dbuffers, reduce_bytes=reduce_bytes)


def check_engine_metrics(mixed_precision: bool, keep_cast_shard: bool = False) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_ragged.observability.metrics import EngineMetrics

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mixed_precision else None
    model = lr.fully_shard(make_model(), mp_policy=policy, keep_cast_shard=keep_cast_shard)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = EngineMetrics(model)
    data = make_batches(STEPS, BATCH)
    state = lr.get_state(model)
    for step in range(STEPS):
        lm_loss(model, _local(data[step])).float().backward()
        optimizer.step()
        grad_bytes_after_step = sum(b.sharded_grad.numel() * b.sharded_grad.element_size() for b in state.dbuffers())
        optimizer.zero_grad()
        freed_by_zero_grad = all(b.sharded_grad is None for b in state.dbuffers())
        metrics.end_step()
    values = metrics.compute()
    cast = sum(dbuffer.layout.segment_size * 2 for dbuffer in state.dbuffers()) if mixed_precision else 0
    # a block is gathered twice a step (forward, backward re-gather); a kept cast serves both
    casts_per_bucket = {id(b): (1 if g.is_root or keep_cast_shard else 2) for g in state.all_groups for b in g.dbuffers}
    expected = expected_traffic(state)
    expected["engine_copy_bytes"] = sum(
        casts_per_bucket[id(b)] * b.layout.segment_size * 2 for b in state.dbuffers()
    ) if mixed_precision else 0
    layouts = [(b.layout.padding_ratio, b.layout.segment_size) for b in state.dbuffers()]
    metrics.close()
    assert not any(b.observers for b in state.dbuffers()), "close() must unsubscribe the probes"
    plain = dict(make_model().named_parameters())  # the root group holds what no block holds
    root_fraction = sum(p.numel() for n, p in plain.items() if not n.startswith("blocks.")) / sum(
        p.numel() for p in plain.values())
    return dict(values=values, expected=expected, layouts=layouts, cast=cast, root_fraction=root_fraction,
                grad_bytes_after_step=grad_bytes_after_step, freed_by_zero_grad=freed_by_zero_grad)


@pytest.mark.parametrize(
    "mixed_precision,keep_cast_shard", [(False, False), (True, False), (True, True)], ids=["fp32", "bf16", "bf16-kept-cast"]
)
def test_engine_metrics_match_planned_buffers(dist_pool, mixed_precision, keep_cast_shard):
    results = dist_pool(2).run(check_engine_metrics, mixed_precision, keep_cast_shard)
    for result in results:
        values, expected = result["values"], result["expected"]
        for key, want in expected.items():
            assert values[f"ragged_fsdp/{key}"] == pytest.approx(want), key
        assert values["ragged_fsdp/step_seconds"] > 0
        assert values["ragged_fsdp/all_gather_seconds"] > 0 and values["ragged_fsdp/reduce_seconds"] > 0
        assert 0.0 <= values["ragged_fsdp/comm_hidden_ratio"] <= 1.0
        assert values["ragged_fsdp/comm_blocked_seconds"] > 0
        assert values["ragged_fsdp/dbuffer_unsharded_peak_bytes"] > 0
        assert values["ragged_fsdp/dbuffer_grad_peak_bytes"] > 0
        # sharded gradients fill every segment after a step, and zero_grad(set_to_none=True) frees them
        # (only the .grad views hold them), so the gauge, read after zero_grad, shows none
        assert result["grad_bytes_after_step"] == values["ragged_fsdp/dbuffer_sharded_bytes"] > 0
        assert result["freed_by_zero_grad"] and values["ragged_fsdp/dbuffer_sharded_grad_bytes"] == 0
        assert values["ragged_fsdp/process_peak_memory_bytes"] >= values["ragged_fsdp/process_memory_bytes"] > 2**20
        assert values["ragged_fsdp/padding_ratio"] >= 0
        assert values["ragged_fsdp/segment_size_max"] == max(s for _, s in result["layouts"])
        assert values["ragged_fsdp/root_param_fraction"] == pytest.approx(result["root_fraction"])
        root_keys = [k for k in values if k.startswith("ragged_fsdp/groups/root") and k.endswith("/segment_size")]
        assert root_keys and all(values[k] in [s for _, s in result["layouts"]] for k in root_keys)
        assert values["ragged_fsdp/groups/blocks.0/padding_ratio"] in [p for p, _ in result["layouts"]]



class FakeDevice:
    """Timing events on a fake device clock the test sets (milliseconds); ``done`` decides ``query()``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.done = True
        self.made = 0

    def event(self) -> "FakeEvent":
        self.made += 1
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device, self.at = device, None

    def record(self) -> None:
        self.at = self.device.now

    def query(self) -> bool:
        return self.device.done

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.query() and end.query(), "elapsed_time read before the events completed (would sync)"
        return end.at - self.at


def check_device_timing_from_events() -> dict:
    from lightning_ragged.engine.events import EventKind, notify
    from lightning_ragged.observability.metrics import EngineMetrics

    device = FakeDevice()
    model = lr.fully_shard(make_model())
    metrics = EngineMetrics(model, event_factory=device.event)
    a, b = list(lr.get_state(model).dbuffers())[:2]
    # all-gather of a: issued at 0, compute until a reshard of b at 3, waited at 5 -> 5 ms in flight, 2 ms stalled
    for at, dbuffer, kind, collective in (
        (0.0, a, EventKind.UNSHARD_ISSUED, "all_gather"), (3.0, b, EventKind.RESHARDED, None),
        (5.0, a, EventKind.UNSHARD_WAITED, "all_gather"),
        # reduction of b: issued at 10, waited at 11 with nothing between -> 1 ms in flight, fully stalled
        (10.0, b, EventKind.REDUCE_ISSUED, "all_reduce"), (11.0, b, EventKind.REDUCE_WAITED, "all_reduce"),
    ):
        device.now = at
        notify(dbuffer, kind, collective, seconds=1.0)  # the CPU seconds must not be used on a "device"
    metrics.end_step()
    device.done = False  # not completed on the device yet: nothing read, nothing forced
    early = metrics.compute()
    device.done = True
    late = metrics.compute()
    for step in range(2):  # the real engine through the same path: every collective timed, nothing left pending
        lm_loss(model, _local(make_batches(2, BATCH)[step])).backward()
        metrics.end_step()
    real = metrics.compute()
    return dict(early=early, late=late, real=real, pending=metrics.probes[0].timer.pending, made=device.made)


def test_device_timing_reads_event_pairs_lazily(dist_pool):
    for result in dist_pool(2).run(check_device_timing_from_events):
        early, late, real = result["early"], result["late"], result["real"]
        for key in ("all_gather_seconds", "reduce_seconds", "comm_blocked_seconds", "comm_hidden_ratio"):
            assert early[f"ragged_fsdp/{key}"] == 0.0, key
        assert late["ragged_fsdp/all_gather_seconds"] == pytest.approx(0.005)
        assert late["ragged_fsdp/reduce_seconds"] == pytest.approx(0.001)
        assert late["ragged_fsdp/comm_blocked_seconds"] == pytest.approx(0.002 + 0.001)
        assert late["ragged_fsdp/comm_hidden_ratio"] == pytest.approx(1 - 0.003 / 0.006)
        assert result["pending"] == 0 and result["made"] > 5
        assert real["ragged_fsdp/all_gathers"] > 0  # the fake clock stood still: device times are zero
        assert real["ragged_fsdp/all_gather_seconds"] == real["ragged_fsdp/comm_blocked_seconds"] == 0.0

def check_excluded_span_device_times() -> dict:
    from lightning_ragged.engine.events import EventKind, notify
    from lightning_ragged.observability.metrics import EngineMetrics

    device = FakeDevice()
    model = lr.fully_shard(make_model())
    metrics = EngineMetrics(model, event_factory=device.event)
    a = next(iter(lr.get_state(model).dbuffers()))

    def all_gather(start: float) -> None:  # 5 ms in flight, waited for at once
        for at, kind in ((start, EventKind.UNSHARD_ISSUED), (start + 5.0, EventKind.UNSHARD_WAITED)):
            device.now = at
            notify(a, kind, "all_gather", seconds=1.0)

    all_gather(0.0)  # the training step's, not complete on the device when the validation starts
    device.done = False
    metrics.end_step()
    metrics.begin_excluded()
    all_gather(10.0)  # the validation's two
    all_gather(20.0)
    device.done = True  # everything completes during the validation
    metrics.totals()  # the monitor thread reads meanwhile
    metrics.end_excluded()
    metrics.end_step()  # a step without collectives
    window = metrics.compute()
    return {key: window[f"ragged_fsdp/{key}"] for key in ("all_gather_seconds", "comm_blocked_seconds")}


def test_an_excluded_span_leaves_device_times_out_and_keeps_the_training_ones(dist_pool):
    # Before: end_excluded folded the validation's device times (CUDA events) into the window: 7.5 ms per step
    # here instead of 2.5 (review of the metrics change)
    for result in dist_pool(2).run(check_excluded_span_device_times):
        assert result["all_gather_seconds"] == pytest.approx(0.005 / 2), result
        assert result["comm_blocked_seconds"] == pytest.approx(0.005 / 2), result


class SlowDevice(FakeDevice):
    """``query()`` takes 50 ms and counts how many threads are inside it at once."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = self.most = 0
        self.lock = threading.Lock()

    def event(self) -> "FakeEvent":
        self.made += 1
        return SlowEvent(self)


class SlowEvent(FakeEvent):
    def query(self) -> bool:
        device = self.device
        with device.lock:
            device.inside += 1
            device.most = max(device.most, device.inside)
        time.sleep(0.05)
        with device.lock:
            device.inside -= 1
        return True


def check_device_times_read_from_two_threads() -> dict:
    from lightning_ragged.engine.events import EventKind, notify
    from lightning_ragged.observability.metrics import EngineMetrics

    device = SlowDevice()
    model = lr.fully_shard(make_model())
    metrics = EngineMetrics(model, event_factory=device.event)
    a = next(iter(lr.get_state(model).dbuffers()))
    for start in (0.0, 10.0):  # two all-gathers of 5 ms each
        for at, kind in ((start, EventKind.UNSHARD_ISSUED), (start + 5.0, EventKind.UNSHARD_WAITED)):
            device.now = at
            notify(a, kind, "all_gather", seconds=1.0)
    metrics.end_step()
    errors: list[str] = []

    def scrape() -> None:  # the monitor's HTTP thread (Prometheus counters) beside the training thread
        try:
            metrics.totals()
        except Exception as error:  # noqa: BLE001 - reported to the test
            errors.append(repr(error))

    thread = threading.Thread(target=scrape)
    thread.start()
    try:
        window = metrics.compute()
    except Exception as error:  # noqa: BLE001
        errors.append(repr(error))
        window = {}
    thread.join()
    return dict(most=device.most, errors=errors, window=window.get("ragged_fsdp/all_gather_seconds"),
                total=metrics.totals()["all_gather_seconds"], pending=metrics.probes[0].timer.pending)


def test_device_times_are_read_by_one_thread_at_a_time(dist_pool):
    # Before: the monitor's scrape thread and the training thread both peeked the oldest event pair and both
    # popped it: the second popped a pair not yet completed (elapsed_time raises on CUDA) and the window and
    # totals lost or double-counted device seconds.
    for result in dist_pool(2).run(check_device_times_read_from_two_threads):
        assert result["most"] == 1 and result["errors"] == [], result
        assert result["pending"] == 0 and result["total"] == pytest.approx(0.010), result
        assert result["window"] == pytest.approx(0.010), result  # one step, both all-gathers, counted once


# ----------------------------------------------------------------------------- diagnostics
STALL_TIMEOUT_S = 2.0


def check_stalled_rank_is_named() -> dict:
    from lightning_ragged.engine.collective_errors import CollectiveTimeoutError
    from lightning_ragged.observability.metrics import EngineMetrics

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=STALL_TIMEOUT_S))
    model = lr.fully_shard(make_model(), process_group=group)
    metrics = EngineMetrics(model)
    metrics.set_step(7)
    data = make_batches(1, BATCH)
    if dist.get_rank() == 1:
        time.sleep(STALL_TIMEOUT_S + 6)  # stalled: never reaches the first all-gather in time
        return {}
    started = time.monotonic()
    try:
        lm_loss(model, _local(data[0])).backward()
    except CollectiveTimeoutError as error:
        return dict(
            seconds=time.monotonic() - started,
            message=str(error),
            missing=error.missing_ranks,
            group=error.group,
            collective=error.collective,
            step=error.step,
        )
    return dict(seconds=time.monotonic() - started, message="no error")


def test_stalled_rank_raises_named_timeout(dist_pool):
    result = dist_pool(2).run(check_stalled_rank_is_named)[0]
    assert result["message"] != "no error"
    assert result["missing"] == [1]
    # the root group has two DBuffers (embeddings | final norm): the first one stalls
    assert result["collective"] == "all_gather" and result["group"] == "root#0" and result["step"] == 7
    for words in ("all_gather", "'root#0'", "step 7", "ranks [1] did not arrive", f"within {STALL_TIMEOUT_S:g} s"):
        assert words in result["message"]
    assert result["seconds"] < STALL_TIMEOUT_S + 5, "the error must come within timeout + grace, not hang"


def check_oom_at_unshard_is_named() -> str:
    import lightning_ragged.engine.storage as storage
    from lightning_ragged.observability.diagnostics import UnshardOutOfMemoryError
    from lightning_ragged.observability.probes import probe

    model = lr.fully_shard(make_model())
    probe(model).step = 3
    original = storage.allocate

    def fail(tensor, nbytes):
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")

    storage.allocate = fail
    try:
        model(make_batches(1, 2)[0])
    except UnshardOutOfMemoryError as error:
        assert error.group == "root#0" and error.buffer_bytes > 0
        return str(error)
    finally:
        storage.allocate = original
    return "no error"


def test_oom_during_unshard_names_group_and_knob(dist_pool):
    message = dist_pool(2).run(check_oom_at_unshard_is_named)[0]
    assert "out of memory while unsharding FSDP group 'root#0'" in message
    assert "dbuffer_size" in message and "step 3" in message and "B (" in message


# ------------------------------------------------------------------ Lightning fit (one run)
@pytest.fixture(scope="module")
def fit_run(metrics_fits):
    """One 2-process ``Trainer.fit`` with the metrics callback and the endpoint (``tests/metrics_fits.py``)."""
    return json.loads((metrics_fits / "observability.json").read_text())


def test_callback_logs_named_keys_with_planned_bytes(fit_run):
    from tests.observability_fit import LOG_EVERY, STEPS

    records = fit_run["records"]
    # every LOG_EVERY optimizer steps, at the step Lightning logs that batch's own `self.log` values (before: one
    # step later, so the engine's numbers and the loss of the same step sat apart on the x-axis)
    assert [step for step, _ in records] == list(range(LOG_EVERY - 1, STEPS, LOG_EVERY)) == fit_run["loss_steps"]
    # validation ran inside fit (after steps 3 and 6); its all-gathers are in no step's counts (before: they were)
    assert fit_run["validations"] == 2, fit_run["validations"]
    buffers = fit_run["buffers"]
    gather_bytes = sum(b["bytes"] * (1 if b["root"] else 2) for b in buffers)
    reduce_bytes = sum(b["bytes"] for b in buffers)
    logged_gather_total = 0.0
    for _, values in records:
        assert values["ragged_fsdp/all_gather_bytes"] == gather_bytes
        assert values["ragged_fsdp/reduce_bytes"] == reduce_bytes
        assert values["ragged_fsdp/all_gathers"] == sum(1 if b["root"] else 2 for b in buffers)
        assert values["ragged_fsdp/reduces"] == len(buffers)
        assert 0 < values["ragged_fsdp/comm_blocked_seconds"] < values["ragged_fsdp/step_seconds"]
        assert 0.0 <= values["ragged_fsdp/comm_hidden_ratio"] <= 1.0
        assert values["ragged_fsdp/engine_copy_bytes"] == 0  # fp32 DBuffers: zero-copy
        assert values["ragged_fsdp/dbuffer_sharded_bytes"] == sum(b["bytes"] for b in buffers) / 2
        assert values["ragged_fsdp/dbuffer_unsharded_peak_bytes"] >= max(b["bytes"] for b in buffers)
        assert values["ragged_fsdp/process_peak_memory_bytes"] > 2**20
        for b in buffers:
            assert values[f"ragged_fsdp/groups/{b['group']}/segment_size"] == b["segment_size"]
            assert values[f"ragged_fsdp/groups/{b['group']}/padding_ratio"] == pytest.approx(b["padding_ratio"])
        logged_gather_total += values["ragged_fsdp/all_gather_bytes"] * LOG_EVERY
    assert logged_gather_total == gather_bytes * STEPS  # planned buffer sizes x steps


def test_endpoint_serves_health_and_metrics_during_fit_and_closes_after(fit_run):
    seen = fit_run["seen"]
    assert seen["health_status"] == 200
    health = seen["health"]
    assert health["status"] == "ok" and health["global_step"] == 3 and health["world_size"] == 2
    assert health["ranks_reporting"] == [0, 1] and health["ranks_missing"] == []
    assert 0 <= health["seconds_since_last_step"] < 30
    assert seen["metrics_status"] == 200 and seen["metrics_content_type"].startswith("text/plain")
    text = seen["metrics"]
    for name in ("ragged_fsdp_all_gather_bytes_total", "ragged_fsdp_step_all_gather_bytes",
                 "ragged_fsdp_step_comm_hidden_ratio", 'ragged_fsdp_group_segment_size{group="root#0"}',
                 "ragged_fsdp_ranks_reporting 2.0", "ragged_fsdp_ranks_saving 0.0", "ragged_fsdp_global_step 3.0"):
        assert name in text, name
    assert fit_run["after_fit"].startswith("closed")


def test_counts_after_a_resume_with_accumulation_and_health_during_a_long_validation(metrics_fits):
    """``tests/resume_metrics_fit.py``. Oracle: the fit before the resume (the same model and micro-batches: every
    step issues the same collectives). Before, the first step after the resume was read as 0 (Lightning restores
    it after ``on_fit_start``), so its first micro-batch counted as a step: that window's means were halved. And
    ``/health`` answered "stalled", every rank missing, during a validation longer than ``health_timeout``."""
    run = json.loads((metrics_fits / "resume.json").read_text())
    per_step = {(gathers, reduces) for _, gathers, reduces in run["first"]}
    # logged at Lightning's own steps (optimizer steps 1, 2 at 0, 1), restored with the loops on resume
    assert len(per_step) == 1 and [step for step, *_ in run["first"]] == [0, 1], run["first"]
    assert [step for step, *_ in run["resumed"]] == [2, 3, 4], run["resumed"]
    assert {(gathers, reduces) for _, gathers, reduces in run["resumed"]} == per_step, run
    health = run["health"]
    assert health["status"] == "ok" and health["ranks_missing"] == [] and health["global_step"] == 4, health
    assert health["seconds_since_last_step"] > 1.0  # longer than health_timeout without a training step
    # a checkpoint save longer than health_timeout, on every rank, is no stall either (before: 503, both missing)
    saving = run["health_saving"]
    assert saving["status"] == "ok" and saving["ranks_missing"] == [] and saving["ranks_saving"] == [0, 1], saving
    assert saving["global_step"] == 3 and saving["seconds_since_last_step"] > 1.0, saving
    assert health["ranks_saving"] == []  # training went on after the save
    # the save returned, then every rank hung longer than health_timeout: stalled (before the save's end cleared the
    # mark, a hang after it read "ok", ranks_saving [0, 1], until the next batch)
    after = run["health_after_save"]
    assert after["status"] == "stalled" and after["ranks_saving"] == [] and after["ranks_missing"] == [0, 1], after


def check_one_rank_shard_groups_count_only_replica_traffic() -> dict:
    """HSDP with one rank per shard group (``replicate_degree`` = world size): every rank holds everything, so
    nothing crosses the wire but the replicas' all-reduce. The oracle counts the c10d collectives torch issues
    (``CommDebugMode``). The engine's gathers and reductions still run (counted), with no byte sent; before, the
    whole buffers were reported as all-gathered and reduce-scattered bytes."""
    from torch.distributed.tensor.debug import CommDebugMode

    from tests.test_start import _hsdp_groups

    shard, replicate = _hsdp_groups(1)
    model = lr.fully_shard(make_model(), process_group=shard, replicate_group=replicate)
    stats = lr.get_state(model).stats
    with CommDebugMode() as comm:
        lm_loss(model, _local(make_batches(1, BATCH)[0])).backward()
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    return dict(all_gather_bytes=stats.all_gather_bytes, reduce_bytes=stats.reduce_bytes,
                replica_all_reduces=stats.replica_all_reduces,
                torch_all_gathers=sum(n for op, n in counts.items() if "gather" in op),
                torch_all_reduces=sum(n for op, n in counts.items() if "all_reduce" in op or "allreduce" in op),
                dbuffers=len(list(lr.get_state(model).dbuffers())))


def test_one_rank_shard_groups_count_only_replica_traffic(dist_pool):
    for result in dist_pool(2).run(check_one_rank_shard_groups_count_only_replica_traffic):
        assert result["all_gather_bytes"] == result["torch_all_gathers"] == 0, result
        assert result["reduce_bytes"] == 0 and result["replica_all_reduces"] == result["dbuffers"], result
        assert result["torch_all_reduces"] >= result["dbuffers"], result


# ------------------------------------------------------------------------------ plan CLI
def _planner_table():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import planner_table

    return planner_table


# Known answers: one decoder block of each preset, written out by hand from the models' public
# config.json files, with the names and module order of the transformers modules (the plan CLI builds
# the model from its PRESETS with transformers; the planner benchmark plans the CLI's).
def llama3_70b() -> list:
    """hidden_size 8192, num_attention_heads 64, num_key_value_heads 8 (head_dim 128), intermediate_size 28672."""
    hidden, kv, inter = 8192, 8 * 128, 28672
    return [
        ("self_attn.q_proj.weight", (64 * 128, hidden)),
        ("self_attn.k_proj.weight", (kv, hidden)),
        ("self_attn.v_proj.weight", (kv, hidden)),
        ("self_attn.o_proj.weight", (hidden, 64 * 128)),
        ("mlp.gate_proj.weight", (inter, hidden)),
        ("mlp.up_proj.weight", (inter, hidden)),
        ("mlp.down_proj.weight", (hidden, inter)),
        ("input_layernorm.weight", (hidden,)),
        ("post_attention_layernorm.weight", (hidden,)),
    ]


def _deepseek_v3_moe_layer(routed_experts: list) -> list:
    """hidden_size 7168; MLA: q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64,
    v_head_dim 128, num_attention_heads 128; the routed experts; router 256 x 7168; n_shared_experts 1 x
    moe_intermediate_size 2048."""
    hidden, heads, inter = 7168, 128, 2048
    attention = [
        ("self_attn.q_a_proj.weight", (1536, hidden)),
        ("self_attn.q_a_layernorm.weight", (1536,)),
        ("self_attn.q_b_proj.weight", (heads * (128 + 64), 1536)),
        ("self_attn.kv_a_proj_with_mqa.weight", (512 + 64, hidden)),
        ("self_attn.kv_a_layernorm.weight", (512,)),
        ("self_attn.kv_b_proj.weight", (heads * (128 + 128), 512)),
        ("self_attn.o_proj.weight", (hidden, heads * 128)),
    ]
    return attention + routed_experts + [
        ("mlp.gate.weight", (256, hidden)),
        ("mlp.shared_experts.gate_proj.weight", (inter, hidden)),
        ("mlp.shared_experts.up_proj.weight", (inter, hidden)),
        ("mlp.shared_experts.down_proj.weight", (hidden, inter)),
        ("input_layernorm.weight", (hidden,)),
        ("post_attention_layernorm.weight", (hidden,)),
    ]


def deepseek_v3_fused() -> list:
    """The MoE layer with its 256 routed experts (moe_intermediate_size 2048) fused: gate+up and down."""
    return _deepseek_v3_moe_layer([
        ("mlp.experts.gate_up_proj", (256, 2 * 2048, 7168)),
        ("mlp.experts.down_proj", (256, 7168, 2048)),
    ])


def deepseek_v3_separate() -> list:
    """The MoE layer with every routed expert's three matrices as separate tensors (768 of them)."""
    experts = []
    for expert in range(256):
        experts += [
            (f"mlp.experts.{expert}.gate_proj.weight", (2048, 7168)),
            (f"mlp.experts.{expert}.up_proj.weight", (2048, 7168)),
            (f"mlp.experts.{expert}.down_proj.weight", (7168, 2048)),
        ]
    return _deepseek_v3_moe_layer(experts)


def gpt_oss_120b() -> list:
    """hidden_size 2880, num_attention_heads 64 x head_dim 64, num_key_value_heads 8, attention_bias, sinks;
    num_local_experts 128 fused (HF layout), intermediate_size 2880, expert biases; router 128 x 2880 + bias."""
    hidden, q, kv, experts, inter = 2880, 64 * 64, 8 * 64, 128, 2880
    return [
        ("self_attn.sinks", (64,)),
        ("self_attn.q_proj.weight", (q, hidden)),
        ("self_attn.q_proj.bias", (q,)),
        ("self_attn.k_proj.weight", (kv, hidden)),
        ("self_attn.k_proj.bias", (kv,)),
        ("self_attn.v_proj.weight", (kv, hidden)),
        ("self_attn.v_proj.bias", (kv,)),
        ("self_attn.o_proj.weight", (hidden, q)),
        ("self_attn.o_proj.bias", (hidden,)),
        ("mlp.router.weight", (experts, hidden)),
        ("mlp.router.bias", (experts,)),
        ("mlp.experts.gate_up_proj", (experts, hidden, 2 * inter)),
        ("mlp.experts.gate_up_proj_bias", (experts, 2 * inter)),
        ("mlp.experts.down_proj", (experts, inter, hidden)),
        ("mlp.experts.down_proj_bias", (experts, hidden)),
        ("input_layernorm.weight", (hidden,)),
        ("post_attention_layernorm.weight", (hidden,)),
    ]


def test_plan_cli_row_of_a_fused_expert_stack_is_a_row_of_one_expert():
    """A row of [E, a, b] was a whole expert (a*b): DeepSeek-V3's MoE block at 1,024 ranks padded 161% (S the
    one expert's gate_up, 29,360,128) where the planner table, cutting at rows of one expert, plans 1.04%."""
    table = _planner_table()
    done = subprocess.run(
        [sys.executable, "-m", "lightning_ragged.plan", "--config", "deepseek-v3", "--world-size", "1024",
         "--alignment", "16", "--dbuffer-size", "1TiB", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    (moe,) = [g for g in json.loads(done.stdout)["groups"] if "MoE" in g["group"]]
    layout = lr.plan(table.row_block_specs(table.MODELS["DeepSeek-V3 (experts fused)"](), 1), 1024, alignment=16)
    assert moe["dbuffers"][0]["segment_size"] == layout.segment_size == 11_354_112
    assert moe["dbuffers"][0]["padding_ratio"] == pytest.approx(layout.padding_ratio) and layout.padding_ratio < 0.011
    from lightning_ragged.layout.granularity import resolve_granularity

    experts = torch.empty(4, 6, 10, device="meta")
    assert [resolve_granularity(p, "mlp.experts.w", experts, block_rows=4) for p in ("row", "muon", "block")] == [10, 60, 40]
    assert resolve_granularity("row", "conv.weight", torch.empty(8, 3, 5, 5, device="meta")) == 75  # 4-D: a filter


def test_plan_cli_preset_matches_plan_called_directly():
    from lightning_ragged.layout.granularity import resolve_granularity
    from lightning_ragged.cli.model_groups import PRESETS, describe_model

    done = subprocess.run(
        [sys.executable, "-m", "lightning_ragged.plan", "--config", "llama3-70b", "--world-size", "1024", "--json",
         "--dbuffer-size", "1TiB"],  # one DBuffer per group (the default, fully_shard's 256 MiB, splits the block)
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    block = next(g for g in report["groups"] if g["group"] == "layers")
    assert block["count"] == 80
    # The same block, written out independently (known answer above), planned directly.
    shapes = llama3_70b()
    kinds = {kind.name: kind for kind in describe_model(PRESETS["llama3-70b"]).groups}
    assert kinds["layers"].shapes == shapes
    assert kinds["embed_tokens"].shapes == [("weight", (128256, 8192))]  # untied: a group of its own
    assert _planner_table().MODELS["Llama-3-70B"]() == shapes
    specs = [
        lr.TensorSpec(name, math.prod(shape), resolve_granularity("row", name, torch.empty(shape, device="meta")))
        for name, shape in shapes
    ]
    layout = lr.plan(specs, 1024)
    dbuffer = block["dbuffers"][0]
    assert dbuffer["segment_size"] == layout.segment_size
    assert dbuffer["padding"] == layout.padding
    assert dbuffer["padding_ratio"] == pytest.approx(layout.padding_ratio)
    assert report["memory"]["params"] == 4 * sum(
        g["count"] * sum(b["segment_size"] for b in g["dbuffers"]) for g in report["groups"]
    )


def test_plan_cli_table_replicate_degree_and_shapes_of_other_presets(capsys):
    from lightning_ragged.cli.model_groups import PRESETS, describe_model
    from lightning_ragged.cli.plan import main

    models = _planner_table().MODELS
    def kind(preset: str, label: str, **kwargs):
        return next(k for k in describe_model(PRESETS[preset], **kwargs).groups if k.name.startswith(label))

    assert kind("gpt-oss-120b", "layers").shapes == gpt_oss_120b()
    assert kind("deepseek-v3", "layers 3-", experts="separate").shapes == deepseek_v3_separate()
    assert kind("deepseek-v3", "layers 3-", experts="fused").shapes == deepseek_v3_fused()
    assert models["GPT-OSS-120B (experts fused)"]() == gpt_oss_120b()
    assert models["DeepSeek-V3 (experts separate)"]() == deepseek_v3_separate()
    assert models["DeepSeek-V3 (experts fused)"]() == deepseek_v3_fused()
    assert main(["--config", "gpt-oss-120b", "--world-size", "64", "--replicate-degree", "4"]) == 0
    out = capsys.readouterr().out
    assert "sharded over 16 ranks" in out and "| segment S |" in out and "block cuts avoided" in out
    assert "optimizer states" in out and "largest unsharded group" in out


def test_plan_cli_reads_a_transformers_config_json(tmp_path, capsys):
    from lightning_ragged.cli.plan import main

    config = dict(model_type="qwen2", hidden_size=64, intermediate_size=160, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=3, vocab_size=1000, tie_word_embeddings=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["--config", str(tmp_path / "config.json"), "--world-size", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [g["group"] for g in report["groups"]] == ["layers", "root"]
    # as fully_shard makes them: the root's embeddings before the blocks, its norm after (the head is tied)
    assert [len(g["dbuffers"]) for g in report["groups"]] == [1, 2]
    assert report["groups"][0]["count"] == 3
    # Qwen2's q/k/v projections have biases (64 + 32 + 32 per layer); the tied head adds nothing.
    qkv_bias = 64 + 32 + 32
    assert report["total_params"] == 3 * (2 * 64 + 4 * 64 * 64 // 1 - 2 * 64 * 32 + qkv_bias + 3 * 64 * 160) + 1000 * 64 + 64


def test_plan_stays_the_planner_function():
    """``lightning_ragged.plan`` is one thing, the function: importing the ``-m`` entry as a module is refused
    (it would rebind the package attribute) with the two names to use, and the function still works after."""
    import importlib

    with pytest.raises(ImportError, match=r"from lightning_ragged import plan.*lightning_ragged\.cli\.plan"):
        importlib.import_module("lightning_ragged.plan")
    assert callable(lr.plan) and lr.plan.__module__.startswith("lightning_ragged.layout.")
    layout = lr.plan([lr.TensorSpec("w", 12, 3)], 2)
    assert layout.segment_size == 6


def test_plan_cli_plot(tmp_path):
    from lightning_ragged.cli.plan import main

    out = tmp_path / "padding.png"
    assert main(["--config", "llama3-70b", "--world-size", "64", "--plot", str(out)]) == 0
    assert out.stat().st_size > 10_000
