"""Opt-in health and metrics endpoint: rank 0 serves ``GET /health`` (JSON) and ``GET /metrics`` (Prometheus).

Nothing here runs on the training thread except two attribute assignments per step
(:meth:`Monitor.step_finished`) and a dict swap per logging step (:meth:`Monitor.update`):

* every rank runs a daemon *heartbeat* thread that writes ``{"step", "last_step", "start", "progress"}``
  (wall-clock seconds; ``progress``: the last step or evaluation batch) under ``ragged_fsdp/heartbeat/<rank>`` in the default
  ``torch.distributed`` store every ``heartbeat_interval`` seconds;
* rank 0 runs an HTTP server in a daemon thread, bound to ``address`` (default
  loopback). It is bounded (``_BoundedHTTPServer``): an idle connection costs no thread
  and is closed after ``connection_timeout`` seconds (at most ``max_idle_connections``
  wait, the oldest is closed first); at most ``max_connections`` requests are served at
  once, each with that socket timeout; a request beyond them gets a quick 503.
  ``/health`` reads the heartbeats (a rank *reports* when its last step or evaluation batch
  (:meth:`Monitor.progressed`: a long validation is no stall), or its start before either, is
  at most ``health_timeout`` seconds old; clocks are compared
  across hosts, so keep them in NTP sync) and answers 200 while every rank reports, 503
  otherwise. ``/metrics`` is ``prometheus_client``'s WSGI app (text or OpenMetrics
  format by ``Accept``, gzip) over a registry holding one collector: the cumulative
  counters (read live) and the per-step gauges of the last logging window.

The server is ours, not ``prometheus_client.start_http_server``: that one starts a thread
per connection, unbounded and without timeouts, so idle clients could pile up threads in
the training process.

``RaggedFSDPMetrics(monitor_port=...)`` starts it at ``on_fit_start`` and stops it at
``on_fit_end``/``on_exception``/``teardown``; a plain loop can call ``start``/``stop``.
"""

from __future__ import annotations

import io
import json
import selectors
import socket
import sys
import threading
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import torch.distributed as dist
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lightning_ragged.engine.collective_errors import default_store
from lightning_ragged.layout.spec import is_positive_int
from lightning_ragged.observability.metrics import PREFIX, EngineMetrics

HEARTBEAT_KEY = "ragged_fsdp/heartbeat/"


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
        connection_timeout: float = 10.0,
        max_connections: int = 8,
        max_idle_connections: int = 64,
    ) -> None:
        if not isinstance(connection_timeout, (int, float)) or isinstance(connection_timeout, bool) or not (
            connection_timeout > 0
        ):
            raise ValueError(f"connection_timeout={connection_timeout!r} must be positive seconds, e.g. 10.0")
        for name, value in (("max_connections", max_connections), ("max_idle_connections", max_idle_connections)):
            if not is_positive_int(value):
                raise ValueError(f"{name}={value!r} must be a positive int, e.g. 8")
        self.metrics = metrics
        self.connection_timeout = float(connection_timeout)
        self.max_connections = max_connections
        self.max_idle_connections = max_idle_connections
        self.requested_port = port
        self.address = address
        self.health_timeout = health_timeout
        self.heartbeat_interval = heartbeat_interval
        self.serve = serve
        self.global_step = global_step
        self.last_step_time: Optional[float] = None
        self.progress_time: Optional[float] = None
        self.saving = False
        self.started_time = time.time()
        self.snapshot: dict[str, float] = {}
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.port: Optional[int] = None
        self._store = default_store()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        self._metrics_app = make_wsgi_app(registry)
        self._stop = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None
        self._server: Optional[_BoundedHTTPServer] = None
        self._server_thread: Optional[threading.Thread] = None

    # --------------------------------------------------- training thread
    def step_finished(self, step: int) -> None:
        self.global_step = step
        self.last_step_time = self.progress_time = time.time()

    def progressed(self) -> None:
        """Work other than a training step finished (an evaluation batch): this rank is alive."""
        self.progress_time = time.time()

    def saving_checkpoint(self, active: bool) -> None:
        """A checkpoint save began (True) or training went on after one (False). While a save runs, the heartbeat
        itself is this rank's progress: a save takes as long as it takes, and a stuck one ends in its collectives'
        timeout (``CheckpointTimeoutError``), so a liveness probe need not restart the job mid-save."""
        if self.saving and not active:
            self.progress_time = time.time()
        self.saving = active

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
        server_class = _IPv6Server if ":" in self.address else _BoundedHTTPServer
        try:
            self._server = server_class(
                (self.address, self.requested_port),
                _SilentHandler,
                max_connections=self.max_connections,
                connection_timeout=self.connection_timeout,
                max_idle_connections=self.max_idle_connections,
            )
        except OSError as error:
            warnings.warn(
                f"lightning_ragged monitor: cannot bind {self.address}:{self.requested_port} ({error}); "
                "training goes on without the /health and /metrics endpoint",
                RuntimeWarning,
                stacklevel=2,
            )
            self._server = None
            return
        self._server.set_app(self._app)
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
        try:
            self._store.set(f"{HEARTBEAT_KEY}{self.rank}", json.dumps(self._record()))
        except (RuntimeError, ValueError):
            pass  # the store is going away with the job; health will show this rank as missing

    def _record(self) -> dict[str, Any]:
        return {"step": self.global_step, "last_step": self.last_step_time, "start": self.started_time,
                "progress": time.time() if self.saving else self.progress_time, "saving": self.saving}

    def _beat_forever(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            self._beat()

    # ------------------------------------------------------------ health
    def health(self) -> dict[str, Any]:
        now = time.time()
        records = {self.rank: self._record()}
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
        saving = [rank for rank, record in sorted(records.items()) if record.get("saving")]
        for rank in range(self.world_size):
            record = records.get(rank)
            last = None if record is None else (record.get("progress") or record.get("last_step") or record.get("start"))
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
            "ranks_saving": saving,
            "health_timeout_s": self.health_timeout,
        }

    # ------------------------------------------------------------ routes
    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        """The WSGI app: ``/health`` is ours, ``/metrics`` is ``prometheus_client``'s."""
        path = environ.get("PATH_INFO", "").rstrip("/")
        try:
            if path == "/metrics":
                return self._metrics_app(environ, start_response)
            if path == "/health":
                health = self.health()
                code = "503 Service Unavailable" if health["status"] == "stalled" else "200 OK"
                return _reply(start_response, code, "application/json", json.dumps(health).encode())
            return _reply(start_response, "404 Not Found", "text/plain", b"not found: try /health or /metrics\n")
        except Exception as error:  # noqa: BLE001 - a monitoring bug must never reach training
            body = f"{type(error).__name__}: {error}\n".encode()
            return _reply(start_response, "500 Internal Server Error", "text/plain", body)


def _reply(start_response: Callable[..., Any], status: str, content_type: str, body: bytes) -> list[bytes]:
    start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body)))])
    return [body]


class _Collector:
    """Builds the metric families at scrape time from the monitor's live state."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Any]:
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
            ("ranks_saving", len(health["ranks_saving"]), "ranks saving a checkpoint now"),
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


class _SilentHandler(WSGIRequestHandler):
    """wsgiref's handler without the access log and tracebacks on the training job's stderr."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    def get_stderr(self) -> io.StringIO:
        return io.StringIO()  # a client that went away mid-reply is not the job's error


_BUSY_BODY = b"busy: too many connections to the lightning_ragged monitor; retry\n"
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\nConnection: close\r\n"
    + f"Content-Length: {len(_BUSY_BODY)}\r\n\r\n".encode()
    + _BUSY_BODY
)


class _BoundedHTTPServer(WSGIServer):
    """A WSGI server whose idle connections cost no thread and whose handler threads are bounded.

    The serving thread waits, in one selector, for new connections and for the first bytes
    of every accepted one. A connection gets a handler thread only once its request has
    arrived, at most ``max_connections`` at once, and its socket then has the timeout
    ``connection_timeout``; a request arriving while all are busy is answered 503 at once.
    A connection that sends nothing is closed after ``connection_timeout`` seconds; beyond
    ``max_idle_connections`` waiting ones the oldest is closed. ``server_close`` does not
    wait for handler threads (each ends within its timeout).
    """

    request_queue_size = 128  # the listen backlog (socketserver's 5 drops SYNs of a burst of clients)

    def __init__(
        self,
        address: Any,
        handler: Any,
        *,
        max_connections: int = 8,
        connection_timeout: float = 10.0,
        max_idle_connections: int = 64,
    ) -> None:
        # Set before binding: a bind that fails (the port is taken) calls server_close(), which reads them.
        self.max_connections = max_connections
        self.connection_timeout = connection_timeout
        self.max_idle_connections = max_idle_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._idle: dict[socket.socket, tuple[float, Any]] = {}  # accepted, no request yet; oldest first
        self._selector = selectors.DefaultSelector()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        super().__init__(address, handler)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        try:
            self._selector.register(self.socket, selectors.EVENT_READ)
            while not self._stopping.is_set():
                for key, _ in self._selector.select(poll_interval):
                    if self._stopping.is_set():
                        break
                    if key.fileobj is self.socket:
                        self._accept()
                    else:
                        self._dispatch(key.fileobj)  # type: ignore[arg-type]
                self._close_expired()
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop ``serve_forever`` (running in another thread) and wait until it returned."""
        self._stopping.set()
        self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        for request in list(self._idle):
            self._forget(request)
            self.shutdown_request(request)
        self._selector.close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # a client that timed out or went away: nothing to report on the job's stderr
        super().handle_error(request, client_address)

    # ------------------------------------------------------ serving thread
    def _accept(self) -> None:
        try:
            request, client_address = self.get_request()
        except OSError:
            return
        if len(self._idle) >= self.max_idle_connections:
            oldest = next(iter(self._idle))
            self._forget(oldest)
            self.shutdown_request(oldest)
        self._idle[request] = (time.monotonic() + self.connection_timeout, client_address)
        self._selector.register(request, selectors.EVENT_READ)

    def _dispatch(self, request: socket.socket) -> None:
        _, client_address = self._forget(request)
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            threading.Thread(
                target=self._handle, args=(request, client_address), name="ragged-fsdp-monitor-request", daemon=True
            ).start()
        except RuntimeError:  # no thread to be had
            self._slots.release()
            self.shutdown_request(request)

    def _refuse(self, request: socket.socket) -> None:
        try:
            request.setblocking(False)
            for _ in range(16):  # read what arrived, so that closing sends FIN (the client reads the 503), not RST
                if not request.recv(65536):
                    break
        except OSError:
            pass
        try:
            request.send(_BUSY)
        except OSError:
            pass
        self.shutdown_request(request)

    def _close_expired(self) -> None:
        now = time.monotonic()
        while self._idle:
            request, (deadline, _) = next(iter(self._idle.items()))
            if deadline > now:
                break
            self._forget(request)
            self.shutdown_request(request)

    def _forget(self, request: socket.socket) -> tuple[float, Any]:
        try:
            self._selector.unregister(request)
        except (KeyError, ValueError):
            pass
        return self._idle.pop(request, (0.0, None))

    # ------------------------------------------------------ handler thread
    def _handle(self, request: socket.socket, client_address: Any) -> None:
        try:
            request.settimeout(self.connection_timeout)
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - as socketserver.ThreadingMixIn
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()


class _IPv6Server(_BoundedHTTPServer):
    address_family = socket.AF_INET6
