"""Opt-in health and metrics endpoint: rank 0 serves ``GET /health`` (JSON) and ``GET /metrics`` (Prometheus).

Nothing here runs on the training thread except two attribute assignments per step
(:meth:`Monitor.step_finished`) and a dict swap per logging step (:meth:`Monitor.update`):

* every rank runs a daemon *heartbeat* thread that writes ``{"step", "last_step", "start"}``
  (wall-clock seconds) under ``ragged_fsdp/heartbeat/<rank>`` in the default
  ``torch.distributed`` store every ``heartbeat_interval`` seconds;
* rank 0 runs a ``ThreadingHTTPServer`` in a daemon thread, bound to ``address``
  (default loopback). ``/health`` reads the heartbeats (a rank *reports* when its last
  step, or its start before the first step, is at most ``health_timeout`` seconds old;
  clocks are compared across hosts, so keep them in NTP sync) and answers 200 while every
  rank reports, 503 otherwise. ``/metrics`` renders, with ``prometheus_client``, the
  cumulative counters (read live) and the per-step gauges of the last logging window.

``RaggedFSDPMetrics(monitor_port=...)`` starts it at ``on_fit_start`` and stops it at
``on_fit_end``/``on_exception``/``teardown``; a plain loop can call ``start``/``stop``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator, Optional

import torch.distributed as dist

from lightning_ragged.metrics import PREFIX, EngineMetrics

HEARTBEAT_KEY = "ragged_fsdp/heartbeat/"


def _store() -> Optional[dist.Store]:
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


class Monitor:
    """Heartbeats on every rank; on the serving rank, the HTTP endpoint."""

    def __init__(
        self,
        metrics: EngineMetrics,
        port: int = 8080,
        address: str = "127.0.0.1",
        health_timeout: float = 300.0,
        heartbeat_interval: float = 5.0,
        serve: bool = True,
        global_step: int = 0,
    ) -> None:
        self.metrics = metrics
        self.requested_port = port
        self.address = address
        self.health_timeout = health_timeout
        self.heartbeat_interval = heartbeat_interval
        self.serve = serve
        self.global_step = global_step
        self.last_step_time: Optional[float] = None
        self.started_time = time.time()
        self.snapshot: dict[str, float] = {}
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.port: Optional[int] = None
        self._store = _store()
        self._stop = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None
        self._server: Optional[ThreadingHTTPServer] = None
        self._server_thread: Optional[threading.Thread] = None

    # --------------------------------------------------- training thread
    def step_finished(self, step: int) -> None:
        self.global_step = step
        self.last_step_time = time.time()

    def update(self, values: dict[str, float]) -> None:
        self.snapshot = values

    # --------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._stop.clear()
        self.started_time = time.time()
        if self._store is not None:
            self._beat()  # the key exists before anyone asks for it
            self._heartbeat = threading.Thread(target=self._beat_forever, name="ragged-fsdp-heartbeat", daemon=True)
            self._heartbeat.start()
        if self.serve:
            self._start_server()

    def _start_server(self) -> None:
        monitor = self

        class Handler(_Handler):
            pass

        Handler.monitor = monitor
        server_class = _IPv6Server if ":" in self.address else ThreadingHTTPServer
        try:
            self._server = server_class((self.address, self.requested_port), Handler)
        except OSError as error:
            warnings.warn(
                f"lightning_ragged monitor: cannot bind {self.address}:{self.requested_port} ({error}); "
                "training goes on without the /health and /metrics endpoint",
                RuntimeWarning,
                stacklevel=2,
            )
            self._server = None
            return
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._server_thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name="ragged-fsdp-monitor", daemon=True
        )
        self._server_thread.start()

    def stop(self) -> None:
        """Stop serving (the port is closed when this returns) and stop the heartbeat."""
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._server_thread is not None:
            self._server_thread.join(timeout=5)
            self._server_thread = None
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
            self._heartbeat = None

    @property
    def url(self) -> Optional[str]:
        if self.port is None:
            return None
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}"

    # --------------------------------------------------------- heartbeat
    def _beat(self) -> None:
        record = {"step": self.global_step, "last_step": self.last_step_time, "start": self.started_time}
        try:
            self._store.set(f"{HEARTBEAT_KEY}{self.rank}", json.dumps(record))
        except (RuntimeError, ValueError):
            pass  # the store is going away with the job; health will show this rank as missing

    def _beat_forever(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            self._beat()

    # ------------------------------------------------------------ health
    def health(self) -> dict[str, Any]:
        now = time.time()
        records = {self.rank: {"step": self.global_step, "last_step": self.last_step_time, "start": self.started_time}}
        if self._store is not None:
            for rank in range(self.world_size):
                if rank == self.rank:
                    continue
                key = f"{HEARTBEAT_KEY}{rank}"
                try:
                    if self._store.check([key]):
                        records[rank] = json.loads(self._store.get(key))
                except (RuntimeError, ValueError):
                    pass
        reporting, missing = [], []
        for rank in range(self.world_size):
            record = records.get(rank)
            last = None if record is None else (record.get("last_step") or record.get("start"))
            (reporting if last is not None and now - last <= self.health_timeout else missing).append(rank)
        since = None if self.last_step_time is None else round(now - self.last_step_time, 3)
        if missing:
            status = "stalled"
        elif self.last_step_time is None:
            status = "starting"
        else:
            status = "ok"
        return {
            "status": status,
            "global_step": self.global_step,
            "seconds_since_last_step": since,
            "world_size": self.world_size,
            "ranks_reporting": reporting,
            "ranks_missing": missing,
            "health_timeout_s": self.health_timeout,
        }

    # ----------------------------------------------------------- metrics
    def prometheus_text(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry)


class _Collector:
    """Builds the metric families at scrape time from the monitor's live state."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        monitor = self.monitor
        for key, value in monitor.metrics.totals().items():
            help_text = f"cumulative {key.replace('_', ' ')} of the sharded engine on rank {monitor.rank}"
            family = CounterMetricFamily(f"ragged_fsdp_{key}", help_text)
            family.add_metric([], value)
            yield family
        health = monitor.health()
        for name, value, help_text in (
            ("global_step", health["global_step"], "optimizer steps finished"),
            ("seconds_since_last_step", health["seconds_since_last_step"], "seconds since rank 0 finished a step"),
            ("world_size", health["world_size"], "ranks in the job"),
            ("ranks_reporting", len(health["ranks_reporting"]), "ranks that finished a step within the timeout"),
        ):
            if value is not None:
                yield GaugeMetricFamily(f"ragged_fsdp_{name}", help_text, value=value)
        groups: dict[str, GaugeMetricFamily] = {}
        for key, value in monitor.snapshot.items():
            name = key[len(PREFIX) :] if key.startswith(PREFIX) else key
            if name.startswith("groups/"):
                _, group, field = name.split("/", 2)
                family = groups.get(field)
                if family is None:
                    family = groups[field] = GaugeMetricFamily(
                        f"ragged_fsdp_group_{field}", f"{field.replace('_', ' ')} of one FSDP group", labels=["group"]
                    )
                family.add_metric([group], value)
            else:
                yield GaugeMetricFamily(
                    f"ragged_fsdp_step_{name}", f"{name.replace('_', ' ')} (last logging window)", value=value
                )
        yield from groups.values()


class _Handler(BaseHTTPRequestHandler):
    monitor: Monitor

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            if path == "/health":
                health = self.monitor.health()
                body = json.dumps(health).encode()
                self._reply(503 if health["status"] == "stalled" else 200, "application/json", body)
            elif path == "/metrics":
                from prometheus_client import CONTENT_TYPE_LATEST

                self._reply(200, CONTENT_TYPE_LATEST, self.monitor.prometheus_text())
            else:
                self._reply(404, "text/plain", b"not found: try /health or /metrics\n")
        except Exception as error:  # noqa: BLE001 - a monitoring bug must never reach training
            self._reply(500, "text/plain", f"{type(error).__name__}: {error}\n".encode())

    def _reply(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # no access log on the training job's stderr


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6
