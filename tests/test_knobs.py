"""Issue 10: bad ``RaggedFSDPStrategy`` arguments fail in the constructor, and the endpoint is bounded.

Every test here runs in this process: constructing the strategy must neither start a
process nor initialize ``torch.distributed`` (a fixture makes both fail loudly). The
endpoint tests talk to 127.0.0.1 only.
"""

from __future__ import annotations

import http.client
import inspect
import json
import multiprocessing
import socket
import subprocess
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy


@pytest.fixture(autouse=True)
def no_process_starts(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("constructing RaggedFSDPStrategy must not start a process or a process group")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.Process, "start", refuse)
    yield
    assert not dist.is_initialized()


def _strategy(**kwargs):
    from lightning_ragged import RaggedFSDPStrategy

    return RaggedFSDPStrategy(**kwargs)


class Block(nn.Module):
    pass


def _wrong_arity(name):
    return 1


# (knob, bad value, error, fix): the message must name the knob, show the value and say the fix.
BAD = [
    ("shard_granularity", "rows", ValueError, "did you mean 'row'?"),
    ("shard_granularity", 5, TypeError, "a callable (name, param) -> elements"),
    ("shard_granularity", _wrong_arity, TypeError, "lambda name, param: 256"),
    ("block_rows", 0, ValueError, "pass a positive int such as 128"),  # with the default "row" granularity
    ("block_rows", "128", TypeError, "block_rows=128"),
    ("block_rows", True, TypeError, "block_rows=128"),
    ("dbuffer_size", 0, ValueError, "256 * 2**20"),
    ("dbuffer_size", 2.5e8, TypeError, "dbuffer_size=250000000"),
    ("dbuffer_size", "256MB", TypeError, "dbuffer_size=256 * 2**20"),
    ("dbuffer_size", "recomended", TypeError, "did you mean 'recommended'?"),
    ("dbuffer_size", "auto", TypeError, "dbuffer_size='recommended' (the value the metrics callback wrote"),
    ("planning_algorithm", "optimial", ValueError, "did you mean 'optimal'?"),
    ("planning_algorithm", None, TypeError, "planning_algorithm='optimal'"),
    ("reshard_after_forward", "False", TypeError, "False (keep until backward)"),
    ("reshard_after_forward", 0, ValueError, "a positive int that divides"),
    ("reshard_after_forward", 1.0, TypeError, "True (free after forward)"),
    ("group_modules", "Block", TypeError, "group_modules=['Block']"),
    ("group_modules", [nn.Linear(2, 2)], TypeError, "pass its class (Linear) or its name ('Linear')"),
    ("group_modules", [int], TypeError, "group_modules=[Block]"),
    ("group_modules", nn.ModuleList([nn.Linear(2, 2)]), TypeError, "group_modules=['Block']"),
    ("activation_checkpointing", Block, TypeError, "activation_checkpointing=[Block]"),
    ("activation_checkpointing", [3], TypeError, "activation_checkpointing=['Block']"),
    ("activation_checkpointing", [""], ValueError, "activation_checkpointing=['Block']"),
    ("replicate_degree", 0, ValueError, "replicate_degree=2 (2 replicas), 'node'"),
    ("replicate_degree", "2", TypeError, "replicate_degree=2"),
    ("replicate_degree", "nodes", ValueError, "did you mean 'node'?"),
    ("replicate_degree", True, TypeError, "replicate_degree=2"),
    ("replicate_degree", 1.5, TypeError, "replicate_degree=2"),
    ("state_dict_type", "local", ValueError, "use one of ('sharded', 'full')"),
    ("state_dict_type", "Full", ValueError, "did you mean 'full'?"),
    ("checkpoint_compression", "yes", TypeError, "checkpoint_compression=True"),
    ("async_checkpoint", "no", TypeError, "async_checkpoint=False"),
    ("async_checkpoint", None, TypeError, "async_checkpoint=False"),
    ("sync_grads_each_micro_batch", 1, TypeError, "sync_grads_each_micro_batch=True"),
    ("metrics", "false", TypeError, "metrics=False"),
    ("monitor_port", 70000, ValueError, "monitor_port=8080 (0: any free port)"),
    ("monitor_port", -1, ValueError, "monitor_port=8080"),
    ("monitor_port", "8080", TypeError, "monitor_port=8080"),
    ("monitor_port", True, TypeError, "or None for no endpoint"),
    ("monitor_port", 8080.0, TypeError, "monitor_port=8080"),
    ("monitor_address", 127, TypeError, "monitor_address='127.0.0.1'"),
    ("monitor_address", "http://127.0.0.1:8080", ValueError, "the port goes to monitor_port"),
    ("monitor_address", "", ValueError, "monitor_address='127.0.0.1'"),
    ("process_group_backend", "ncl", ValueError, "did you mean 'nccl'?"),
    ("process_group_backend", "cpu:glo", ValueError, "did you mean 'gloo'?"),
    ("process_group_backend", 1, TypeError, "'cpu:gloo,cuda:nccl'"),
    ("timeout", 30, TypeError, "timeout=timedelta(seconds=30)"),
    ("timeout", 1.5, TypeError, "timeout=timedelta(seconds=1.5)"),
    ("timeout", "30s", TypeError, "timeout=timedelta(minutes=30)"),
    ("timeout", timedelta(seconds=-1), ValueError, "timeout=timedelta(minutes=30)"),
    ("sync_module_states", "True", TypeError, "sync_module_states=True"),
    ("broadcast_buffers", 0, TypeError, "broadcast_buffers=False"),
    ("trust_checkpoint", "yes", TypeError, "trust_checkpoint=True"),
    ("verify_checksums", None, TypeError, "verify_checksums=False"),
    # **kwargs: only fully_shard's parameters that the strategy does not set itself
    ("shard_granulrity", "row", TypeError, "did you mean shard_granularity='row'?"),
    ("reduce_mod", "all_reduce", TypeError, "did you mean reduce_mode='all_reduce'?"),
    ("precision", "bf16-mixed", TypeError, "L.Trainer(precision='bf16-mixed')"),
    ("frobnicate", 1, TypeError, "go to lightning_ragged.fully_shard, which takes"),
    ("reduce_mode", "allreduce", ValueError, "did you mean 'all_reduce'?"),
    ("gather_mode", "allgather", ValueError, "did you mean 'all_gather'?"),
    ("alignment", 0, ValueError, "alignment=16 or None"),
    ("alignment", 16.0, TypeError, "alignment=16 or None"),
    ("max_inflight_all_gathers", -1, ValueError, "max_inflight_all_gathers=1"),
    ("max_inflight_all_gathers", 1.0, TypeError, "max_inflight_all_gathers=1"),
    ("keep_last_unsharded", "yes", TypeError, "keep_last_unsharded=True"),
    ("keep_cast_shard", 1, TypeError, "keep_cast_shard=True"),
    ("blocks_per_group", 0, ValueError, "blocks_per_group=2"),
    ("planning", "optimal", ValueError, "use one of ('auto',)"),
    ("memory_budget_bytes", "80GB", TypeError, "memory_budget_bytes=80 * 10**9"),
    ("mp_policy", MixedPrecisionPolicy(), TypeError, "L.Trainer(precision='bf16-mixed')"),
    ("process_group", None, TypeError, "replicate_degree=..."),
    ("device", "cuda", TypeError, "L.Trainer(accelerator=..., devices=...)"),
]


@pytest.mark.parametrize(("knob", "value", "error", "fix"), BAD, ids=[f"{k}={v!r}"[:40] for k, v, _, _ in BAD])
def test_bad_knob_is_refused_in_the_constructor(knob, value, error, fix) -> None:
    with pytest.raises(error) as caught:
        _strategy(**{knob: value})
    message = str(caught.value)
    assert message.startswith(f"RaggedFSDPStrategy({knob}=")
    assert repr(value)[:30] in message  # long values are shortened (reprlib)
    assert fix in message


def test_auto_replicate_degree_needs_the_auto_planner() -> None:
    with pytest.raises(ValueError, match=r"replicate_degree='auto'.*planning='auto' and memory_budget_bytes"):
        _strategy(replicate_degree="auto")


def test_auto_planning_conflicts_are_refused_in_the_constructor() -> None:
    # before: accepted here, then every rank failed in setup, ~10 s into fit
    for kwargs, words in (
        (dict(memory_budget_bytes=10**9), r"memory_budget_bytes=1000000000\) only applies to planning='auto'"),
        (dict(planning="auto"), r"planning='auto'\).*pass memory_budget_bytes"),
        (dict(planning="auto", memory_budget_bytes=10**9, blocks_per_group=2), r"drop blocks_per_group"),
        (dict(process_group_backend="gloo "), r"process_group_backend='gloo '.*holds spaces"),
    ):
        with pytest.raises(ValueError, match=words):
            _strategy(**kwargs)
    _strategy(planning="auto", memory_budget_bytes=10**9)


def test_every_knob_has_a_check_and_kwargs_are_fully_shards() -> None:
    from lightning_ragged import RaggedFSDPStrategy, fully_shard
    from lightning_ragged.lightning.knobs import KNOB_CHECKS, SET_BY_STRATEGY, engine_kwarg_names

    parameters = inspect.signature(RaggedFSDPStrategy.__init__).parameters.values()
    assert set(KNOB_CHECKS) == {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    engine = set(inspect.signature(fully_shard).parameters)
    assert set(engine_kwarg_names()) == engine - set(SET_BY_STRATEGY) - set(KNOB_CHECKS) == {
        "reduce_mode", "gather_mode", "alignment", "keep_last_unsharded", "max_inflight_all_gathers", "keep_cast_shard",
        "blocks_per_group", "planning", "memory_budget_bytes", "fp8_all_gather",
    }
    assert set(SET_BY_STRATEGY) <= engine


def test_compression_without_zstandard_is_refused_with_the_install_command(monkeypatch) -> None:
    from torch.distributed.checkpoint._extension import ZStandard

    monkeypatch.setattr(ZStandard, "is_available", staticmethod(lambda: False))
    with pytest.raises(ValueError, match=r"checkpoint_compression=True.*pip install zstandard"):
        _strategy(checkpoint_compression=True)


GOOD = [
    {},
    *({"shard_granularity": policy} for policy in ("element", "row", "block", "matrix")),
    {"shard_granularity": "block", "block_rows": 256},
    {"shard_granularity": lambda name, param: 256},
    {"dbuffer_size": 64 * 2**20},
    {"dbuffer_size": "recommended"},
    {"planning_algorithm": "greedy"},
    {"reshard_after_forward": False},
    {"reshard_after_forward": 2},
    {"group_modules": [Block], "activation_checkpointing": ["Block"]},
    {"group_modules": ("Block", "torch.nn.Linear"), "activation_checkpointing": []},
    {"replicate_degree": "node"},
    {"replicate_degree": 2},
    {"state_dict_type": "full"},
    {"checkpoint_compression": True, "async_checkpoint": True},
    {"sync_grads_each_micro_batch": True, "metrics": False},
    {"monitor_port": 0},
    {"monitor_port": 8080, "monitor_address": "::1"},
    {"monitor_port": 65535, "monitor_address": "0.0.0.0"},
    {"monitor_address": "localhost"},
    {"process_group_backend": "gloo"},
    {"timeout": timedelta(minutes=2)},
    {"timeout": None},
    {"reduce_mode": "reduce_scatter", "alignment": 16},
    {"reduce_mode": None, "alignment": None},
    {"gather_mode": "all_gather"},
    {"gather_mode": "pairwise", "reduce_mode": "pairwise"},
    {"keep_last_unsharded": True, "max_inflight_all_gathers": 2},
    {"blocks_per_group": 2},
    {"planning": "auto", "memory_budget_bytes": 80 * 10**9},
    {"planning": "auto", "memory_budget_bytes": 80 * 10**9, "replicate_degree": "auto"},
    {"shard_granularity": "muon"},
    {"sync_module_states": False, "broadcast_buffers": False},
    {"trust_checkpoint": True, "verify_checksums": False},
]


@pytest.mark.parametrize("kwargs", GOOD, ids=[",".join(g) or "defaults" for g in GOOD])
def test_defaults_and_documented_alternatives_construct(kwargs) -> None:
    from torch.distributed.checkpoint._extension import ZStandard

    if kwargs.get("checkpoint_compression") and not ZStandard.is_available():
        pytest.skip("zstandard is not installed")
    strategy = _strategy(**kwargs)
    for knob, value in kwargs.items():
        if knob in ("reduce_mode", "gather_mode", "alignment", "keep_last_unsharded", "max_inflight_all_gathers", "blocks_per_group",
                    "planning", "memory_budget_bytes"):
            assert strategy._engine_kwargs[knob] == value
        elif knob == "timeout":
            assert strategy._timeout == value
        elif knob == "process_group_backend":
            assert strategy.process_group_backend == value
        elif knob in ("group_modules", "activation_checkpointing"):
            assert getattr(strategy, knob) == list(value)
        elif knob in ("trust_checkpoint", "verify_checksums"):
            assert getattr(strategy.ragged_checkpoints, knob) == value
        elif knob not in ("checkpoint_compression", "async_checkpoint"):
            assert getattr(strategy, knob) == value


def test_trainer_with_a_bad_strategy_instance_fails_before_launch() -> None:
    """The typo from the issue: refused when the strategy is built, not 9-44 s into fit."""
    with pytest.raises(TypeError, match=r"did you mean shard_granularity='row'"):
        _strategy(shard_granulrity="row")


def test_a_replicate_degree_that_cannot_divide_the_world_fails_at_trainer_construction() -> None:
    # Before, both processes started and failed ~13 s later, when the process groups were built.
    import lightning as L

    with pytest.raises(ValueError, match=r"replicate_degree=3 \(3\) must divide the world size 2 \(num_nodes=1 x "
                                         r"devices=2\)"):
        L.Trainer(accelerator="cpu", devices=2, strategy=_strategy(replicate_degree=3), logger=False)
    with pytest.raises(ValueError, match=r"replicate_degree=4 \(4\) must divide the world size 6 \(num_nodes=2 x "
                                         r"devices=3\)"):
        L.Trainer(accelerator="cpu", devices=3, num_nodes=2, strategy=_strategy(replicate_degree=4), logger=False)
    L.Trainer(accelerator="cpu", devices=2, strategy=_strategy(replicate_degree=2), logger=False)  # divides: fine


# -------------------------------------------------------------------- bounded endpoint
def _request_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ragged-fsdp-monitor-request"]


def _get(port: int, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _read_until_closed(client: socket.socket) -> bytes:
    """What the server sent before closing (bounded: the server closes every connection)."""
    client.settimeout(10)
    chunks = []
    try:
        for _ in range(64):
            chunk = client.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    finally:
        client.close()
    return b"".join(chunks)


def test_endpoint_bounds_idle_and_slow_connections_and_still_answers() -> None:
    from lightning_ragged.observability.monitor import Monitor

    bound = 4
    monitor = Monitor(None, port=0, connection_timeout=0.5, max_connections=bound, max_idle_connections=16)
    before = threading.active_count()
    monitor.start()  # no process group here: the server thread only, no heartbeat
    clients: list[socket.socket] = []
    try:
        assert monitor.address == "127.0.0.1" and monitor.port
        # 50 idle connections wait in the serving thread's selector; the 34 oldest are closed at once.
        clients = [socket.create_connection(("127.0.0.1", monitor.port), timeout=10) for _ in range(50)]
        status, body = _get(monitor.port, "/health")  # served after the 50 were accepted (one listen queue)
        assert status == 200 and json.loads(body)["status"] == "starting"
        assert threading.active_count() - before <= 1 + bound
        assert all(_read_until_closed(c) == b"" for c in clients)  # all closed by the server, none answered

        # 50 requests that never finish their headers: each holds a handler thread until its timeout.
        clients = []
        for _ in range(50):
            client = socket.create_connection(("127.0.0.1", monitor.port), timeout=10)
            client.sendall(b"GET /health HTTP/1.0\r\n")
            clients.append(client)
        peak, replies = 0, []
        for client in clients:
            peak = max(peak, len(_request_threads()), threading.active_count() - before - 1)
            replies.append(_read_until_closed(client))
        assert peak <= bound
        busy = [r for r in replies if r.startswith(b"HTTP/1.0 503")]
        assert busy and all(b"too many connections" in r for r in busy)
        assert all(r == b"" or r in busy for r in replies)  # the admitted ones time out, unanswered

        for thread in _request_threads():
            thread.join(timeout=10)
        assert _request_threads() == []
        status, body = _get(monitor.port, "/health")
        assert status == 200 and json.loads(body)["global_step"] == 0
        assert _get(monitor.port, "/nope")[0] == 404
    finally:
        for client in clients:
            client.close()
        monitor.stop()
    assert monitor._server is None


def test_a_taken_monitor_port_warns_and_training_goes_on() -> None:
    # Before, the failed bind's server_close() read attributes not set yet: an AttributeError escaped the
    # monitor's `except OSError`, failed rank 0's on_fit_start and left the other ranks waiting 60 s in a barrier.
    from lightning_ragged.observability.monitor import Monitor

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    monitor = Monitor(None, port=holder.getsockname()[1])
    try:
        with pytest.warns(RuntimeWarning, match=r"cannot bind 127\.0\.0\.1:\d+ .*Address already in use.*training "
                                                r"goes on without the /health and /metrics endpoint"):
            monitor.start()
        assert monitor._server is None
    finally:
        monitor.stop()
        holder.close()


@pytest.mark.parametrize(
    ("knob", "value"), [("connection_timeout", 0), ("max_connections", 0), ("max_idle_connections", True)]
)
def test_monitor_bounds_are_validated(knob, value) -> None:
    from lightning_ragged.observability.monitor import Monitor

    with pytest.raises(ValueError, match=knob):
        Monitor(None, **{knob: value})


@pytest.mark.parametrize("name, fix", [
    ("mesh", "replicate_degree"), ("offload_policy", "stay on the device"),
    ("ignored_params", "requires_grad=False"), ("shard_placement_fn", "shard_granularity"),
])
def test_fsdp2_arguments_the_strategy_cannot_take_are_refused_in_its_constructor(name: str, fix: str) -> None:
    with pytest.raises(TypeError, match=rf"{name}=.*not a strategy argument.*{fix}"):
        _strategy(**{name: object()})


def test_a_backend_this_torch_lacks_is_refused_before_processes_start() -> None:
    # Before: accepted, then every spawned rank failed in init_process_group ("Distributed package doesn't have
    # NCCL built in"), from the CLI sweep. Where the build has it, it constructs.
    import torch.distributed as dist

    for value in ("nccl", "cpu:gloo,cuda:nccl", "mpi"):
        backend = value.rpartition(":")[2]
        if dist.is_backend_available(backend):
            assert _strategy(process_group_backend=value).process_group_backend == value
        else:
            with pytest.raises(ValueError, match=f"process_group_backend=.*'{backend}' is not available in this "
                                                 "torch build.*pass 'gloo' \\(CPU\\)"):
                _strategy(process_group_backend=value)


def test_metrics_callback_arguments_are_checked_in_its_constructor() -> None:
    """Before, RaggedFSDPMetrics took anything: monitor_port=70000 failed inside fit as a bare OverflowError from
    rank 0's bind, heartbeat_interval=0 spun the heartbeat thread on the store."""
    import inspect

    from lightning_ragged.lightning.callbacks import RaggedFSDPMetrics
    from lightning_ragged.lightning.metrics_knobs import METRICS_CHECKS

    assert set(inspect.signature(RaggedFSDPMetrics).parameters) == set(METRICS_CHECKS)
    bad = [("monitor_port", 70000, ValueError), ("monitor_port", "8080", TypeError), ("heartbeat_interval", 0, ValueError),
           ("health_timeout", -1, ValueError), ("log_every_n_steps", "5", TypeError),
           ("count_copies_every_n_steps", -1, ValueError), ("monitor_address", 123, TypeError),
           ("memory_budget_bytes", "80GB", TypeError), ("tuning", "no", TypeError),
           ("collective_timeout", float("inf"), ValueError)]
    for name, value, error in bad:
        with pytest.raises(error, match=rf"RaggedFSDPMetrics\({name}=.*pass"):
            RaggedFSDPMetrics(**{name: value})
    RaggedFSDPMetrics(log_every_n_steps=None, monitor_port=0, collective_timeout=None, memory_budget_bytes=2**30)
    # a healthy rank's last report can be one heartbeat old: before, /health answered 503 "stalled" every few steps
    with pytest.raises(ValueError, match=r"health_timeout=1\) must be at least twice heartbeat_interval=10"):
        RaggedFSDPMetrics(health_timeout=1, heartbeat_interval=10)
    RaggedFSDPMetrics(health_timeout=1.0, heartbeat_interval=0.1)
