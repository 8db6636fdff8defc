"""Per-process metrics every service exposes: the metrics HTTP endpoint,
container CPU throttling from cgroup ``cpu.stat`` and event-loop lag.

The metrics port also serves CPU profiles on demand
(``/debug/pprof/profile?seconds=N``, common/profiling.py) when the service
passes a :class:`~switchyard.common.profiling.ProfileEndpoint`.

A service calls, once at start-up::

    start_metrics_server(config.metrics_port, "retrieval", host=config.server.host)
    start_loop_lag_monitor(0.1)   # inside the running event loop

CPU throttling is read from the cgroup's ``cpu.stat`` at scrape time, so the
numbers are the kernel's own counters and cost nothing between scrapes.
Layouts (Linux kernel documentation, Documentation/admin-guide/cgroup-v2.rst
"cpu.stat" and Documentation/scheduler/sched-bwc.rst for v1):

- cgroup v2, ``/sys/fs/cgroup/cpu.stat``: ``nr_periods``, ``nr_throttled``,
  ``throttled_usec`` (microseconds).
- cgroup v1, ``/sys/fs/cgroup/cpu,cpuacct/cpu.stat`` or
  ``/sys/fs/cgroup/cpu/cpu.stat``: ``nr_periods``, ``nr_throttled``,
  ``throttled_time`` (nanoseconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import sys
import threading
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Histogram, Info, make_wsgi_app
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from switchyard import __version__
from switchyard.common import untrusted
from switchyard.common.metrics import EVENT_LOOP_LAG

log = logging.getLogger(__name__)

CGROUP_V2_CPU_STAT = Path("/sys/fs/cgroup/cpu.stat")
CGROUP_V1_CPU_STATS = (Path("/sys/fs/cgroup/cpu,cpuacct/cpu.stat"), Path("/sys/fs/cgroup/cpu/cpu.stat"))

SERVICE_INFO = Info("switchyard_service", "Which Switchyard service this process serves, and its version.")


def parse_cpu_stat(text: str) -> dict[str, int]:
    """Parse ``cpu.stat`` text (``key value`` per line) into ``{key: int}``.

    Lines that are not two fields with an integer value are skipped.
    """
    stats: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                stats[parts[0]] = int(parts[1])
            except ValueError:
                continue
    return stats


def throttling_from_stats(stats: dict[str, int]) -> tuple[int, int, float] | None:
    """``(periods, throttled_periods, throttled_seconds)`` from parsed ``cpu.stat``.

    Recognises v2 (``throttled_usec``) and v1 (``throttled_time``, ns). Returns
    None when the file has no CPU bandwidth counters (cpu controller not enabled).
    """
    if "nr_periods" not in stats or "nr_throttled" not in stats:
        return None
    if "throttled_usec" in stats:
        seconds = stats["throttled_usec"] / 1e6
    elif "throttled_time" in stats:
        seconds = stats["throttled_time"] / 1e9
    else:
        return None
    return stats["nr_periods"], stats["nr_throttled"], seconds


def find_cpu_stat() -> Path | None:
    """The cgroup ``cpu.stat`` of this process's container: v2 first, then v1; None if absent."""
    for path in (CGROUP_V2_CPU_STAT, *CGROUP_V1_CPU_STATS):
        if path.is_file():
            return path
    return None


class CgroupCpuThrottlingCollector(Collector):
    """Prometheus collector reading cgroup CPU throttling at scrape time.

    Series (counters, so Prometheus names end in ``_total``):

    - ``switchyard_cpu_periods_total``: CFS enforcement periods elapsed.
    - ``switchyard_cpu_throttled_periods_total``: periods in which the cgroup hit its quota.
    - ``switchyard_cpu_throttled_seconds_total``: time the cgroup's threads were held back.

    Args:
        path: the ``cpu.stat`` file; None finds it with :func:`find_cpu_stat`
            on each scrape. A missing or unreadable file yields no series.
    """

    def __init__(self, path: Path | str | None = None) -> None:
        self._path = Path(path) if path is not None else None

    def describe(self) -> Iterable[CounterMetricFamily]:
        return []  # values come from a file that may appear later; no fixed description

    def collect(self) -> Iterator[CounterMetricFamily]:
        path = self._path or find_cpu_stat()
        if path is None:
            return
        try:
            parsed = throttling_from_stats(parse_cpu_stat(path.read_text()))
        except OSError as exc:
            log.debug("cannot read %s: %s", path, exc)
            return
        if parsed is None:
            return
        periods, throttled, seconds = parsed
        yield CounterMetricFamily(
            "switchyard_cpu_periods", "CPU bandwidth enforcement periods elapsed (cgroup cpu.stat nr_periods).",
            value=periods,
        )
        yield CounterMetricFamily(
            "switchyard_cpu_throttled_periods",
            "Periods in which the container used its whole CPU quota and was throttled (cgroup cpu.stat nr_throttled).",
            value=throttled,
        )
        yield CounterMetricFamily(
            "switchyard_cpu_throttled_seconds",
            "Time the container's threads were throttled (cgroup cpu.stat throttled_usec / throttled_time).",
            value=seconds,
        )


_lock = threading.Lock()
_process_collectors_registered = False
_servers: list = []


def register_process_collectors(registry: CollectorRegistry = REGISTRY) -> None:
    """Register the cgroup CPU throttling collector on ``registry`` (once per process for the default)."""
    global _process_collectors_registered
    with _lock:
        if registry is REGISTRY:
            if _process_collectors_registered:
                return
            _process_collectors_registered = True
        registry.register(CgroupCpuThrottlingCollector())


MAX_CONNECTIONS = 16
"""The most connections one metrics port serves at once (a scrape or two, a profile, a ``switchyard top``): one
past it is answered 503 with Retry-After and closed. Each connection held a thread of the service's process for
as long as its client kept it open, sending nothing: a client opening thousands took that many threads from the
service (and its container's pids limit)."""
IDLE_TIMEOUT_S = 10.0
"""Longest wait for a metrics client's next bytes, seconds (the socket's timeout): a connection that sends no
whole request within it is closed, its thread freed."""


class _Silent(WSGIRequestHandler):
    def setup(self) -> None:
        self.timeout = self.server.idle_timeout_s  # the socket's, for every read and write of this connection
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        """Log nothing (scrapes come every few seconds)."""

    def get_environ(self) -> dict[str, Any]:
        """wsgiref's environ, with the request's socket (profiling.CONNECTION_KEY): a profile whose caller
        closed it is stopped (profiling.caller_gone)."""
        from switchyard.common.profiling import CONNECTION_KEY

        return {**super().get_environ(), CONNECTION_KEY: self.connection}


def _server_class(host: str, port: int) -> tuple[type[WSGIServer], str]:
    """A thread-per-request WSGI server class for ``host``'s address family (IPv4 or IPv6), and the address
    to bind; as prometheus_client's ``start_wsgi_server`` does it. At most :data:`MAX_CONNECTIONS` at once
    (one past it: 503), each closed after :data:`IDLE_TIMEOUT_S` without bytes from its client."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
    text = f"metrics port busy: {MAX_CONNECTIONS} connections open, the most it serves at once; retry\n".encode()
    busy = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(text)) + text

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = family
        idle_timeout_s = IDLE_TIMEOUT_S

        def process_request(self, request: Any, client_address: Any) -> None:
            if not slots.acquire(blocking=False):  # refused on the accepting thread, which never waits on it
                with contextlib.suppress(OSError):
                    request.settimeout(0)
                    request.send(busy)  # a few hundred bytes: the socket's buffer takes them at once
                self.shutdown_request(request)
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                slots.release()
                raise

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                slots.release()

        def handle_error(self, request: Any, client_address: Any) -> None:
            if isinstance(sys.exc_info()[1], TimeoutError):  # a client that went quiet: closed, not a traceback
                return
            super().handle_error(request, client_address)

    return Server, sockaddr[0]


def _routes(metrics: Callable[..., Any], profile: Callable[..., Any] | None) -> Callable[..., Any]:
    from switchyard.common.profiling import PATH

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO")
        if profile is not None and path == PATH:
            return profile(environ, start_response)
        if path in METRICS_PATHS:
            if environ.get("REQUEST_METHOD") == "HEAD":  # RFC 9110 section 9.3.2: GET's headers, no body
                # (prometheus_client answers HEAD 405); wsgiref still writes the body a handler returns, and
                # sets Content-Length from it where none is given: 0, not the GET's length (RFC 9110 8.6)
                answered: list[tuple[str, list[tuple[str, str]]]] = []
                body = b"".join(metrics({**environ, "REQUEST_METHOD": "GET"},
                                        lambda status, headers, *exc: answered.append((status, headers))))
                status, headers = answered[0]
                if not any(name.lower() == "content-length" for name, _ in headers):
                    headers = [*headers, ("Content-Length", str(len(body)))]
                start_response(status, headers)
                return [b""]
            return metrics(environ, start_response)
        # prometheus_client serves the metrics at any path: a request meant for the HTTP face (or a typo)
        # got 200 and the exposition text
        body = (f"not found: {untrusted.shown(path)}; this is a metrics port: /metrics"
                + (f" and {PATH}" if profile is not None else "") + "\n").encode()
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8"),
                                         ("Content-Length", str(len(body)))])
        return [body]

    return app


METRICS_PATHS = frozenset({"/metrics", "/"})
"""Where a metrics port serves the exposition (Prometheus's default metrics_path, and the root)."""


def start_metrics_server(port: int, service: str, host: str = "127.0.0.1", profile: Callable[..., Any] | None = None) -> int:
    """Serve Prometheus metrics of this process at ``http://host:port/metrics``.

    Registers the per-process collectors (CPU throttling) and sets
    ``switchyard_service_info{service=..., version=...}``. The HTTP server runs
    in a daemon thread (prometheus_client's WSGI app, a thread per request).

    Args:
        port: TCP port; 0 picks a free one (tests).
        service: orchestrator, retrieval or dispatcher.
        host: bind address, ``127.0.0.1`` locally, ``0.0.0.0`` in a container.
        profile: the WSGI app of ``/debug/pprof/profile`` (common/profiling.py ``ProfileEndpoint``); None: not served.

    Returns:
        The bound port.

    Raises:
        OSError: the port could not be bound (the message names host, port and, when it is in use, the key).
    """
    register_process_collectors()
    SERVICE_INFO.info({"service": service, "version": __version__})
    try:
        server_class, address = _server_class(host, port)
        server = make_server(address, port, _routes(make_wsgi_app(REGISTRY), profile), server_class, handler_class=_Silent)
    except OSError as exc:
        why = exc.strerror
        if exc.errno == errno.EADDRINUSE:  # the gRPC port's words (server.bind_failure), naming this port's key
            why = (f"is another process using it? Choose another port ({service}.metrics_port in "
                   "config/switchyard.json, or `switchyard up --free-ports`)")
        raise OSError(exc.errno, f"could not bind the metrics port {host}:{port} for {service}: {why}") from exc
    threading.Thread(target=server.serve_forever, name=f"{service}-metrics", daemon=True).start()
    _servers.append(server)
    bound = int(server.server_port)
    log.info("%s metrics on http://%s:%d/metrics", service, host, bound)
    return bound


def stop_metrics_servers() -> None:
    """Shut down every metrics HTTP server this process started (tests, clean exit)."""
    while _servers:
        server = _servers.pop()
        server.shutdown()
        server.server_close()


async def _measure_loop_lag(interval_s: float, histogram: Histogram) -> None:
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time()
        await asyncio.sleep(interval_s)
        histogram.observe(max(0.0, loop.time() - asked - interval_s))


def start_loop_lag_monitor(interval_s: float = 0.1, histogram: Histogram = EVENT_LOOP_LAG) -> asyncio.Task[None]:
    """Start a task on the running loop that measures event-loop lag.

    Every ``interval_s`` seconds it sleeps ``interval_s`` and records in
    ``histogram`` (default ``switchyard_event_loop_lag_seconds``) how much
    later than asked it woke: the time something held the loop. Cancel the
    returned task to stop it.

    Raises:
        ValueError: ``interval_s`` is not in (0, 60].
        RuntimeError: no running event loop.
    """
    if not 0 < interval_s <= 60:
        raise ValueError(f"interval_s: expected a number of seconds in (0, 60] (got {interval_s!r})")
    return asyncio.get_running_loop().create_task(_measure_loop_lag(interval_s, histogram), name="loop-lag-monitor")


__all__ = [
    "CgroupCpuThrottlingCollector",
    "find_cpu_stat",
    "parse_cpu_stat",
    "register_process_collectors",
    "start_loop_lag_monitor",
    "start_metrics_server",
    "stop_metrics_servers",
    "throttling_from_stats",
]
