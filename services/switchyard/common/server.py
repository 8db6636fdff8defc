"""Server bootstrap shared by the three services.

grpc.aio on uvloop with health checking, reflection (v1 and v1alpha: common/reflection.py) and
message-size limits.
Optionally a second, plain-text port serves the same health statuses and
nothing else (``<service>.health_port``): kubelet's grpc probes cannot speak
TLS, so with ``server.tls`` on they are pointed there.
SIGTERM or SIGINT flips every service to NOT_SERVING, lets in-flight streams
finish within ``server.shutdown_grace_s``, stops the service's background
tasks and returns, so the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import AsyncIterator, Protocol, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from switchyard.common.config import ConfigError, ServerConfig
from switchyard.common.grpc_decoding import DecodeRefusal
from switchyard.common.metrics import SERVING
from switchyard.common.reflection import enable_server_reflection

log = logging.getLogger(__name__)

GRPC_SERVICES: dict[str, str] = {
    "orchestrator": "agent.AgentService",
    "retrieval": "agent.RetrievalService",
    "dispatcher": "agent.InferenceService",
}
"""Each service's gRPC service by the service's name: what it serves, and the health service name its readiness
is asked by (``switchyard up``, the orchestrator's readiness of its downstreams, the pods' gRPC probes)."""


class Service(Protocol):
    """What a Switchyard service gives the bootstrap.

    A service may also declare, by subclassing them, the optional parts the bootstrap uses:
    :class:`Drains`, :class:`InterceptsCalls`, :class:`HealthOwner`.
    """

    name: str
    """Short name: orchestrator, retrieval or dispatcher."""
    grpc_service_names: Sequence[str]
    """Full names of the gRPC services it serves, e.g. ``agent.AgentService``."""

    def register(self, server: grpc.aio.Server) -> None:
        """Add the servicers to ``server``."""

    async def start(self) -> None:
        """Start background tasks (queue workers, schedulers). Called before serving."""

    async def stop(self) -> None:
        """Stop background tasks. Called after the server drained."""


class Drains(ABC):
    """A service told when its server starts draining (SIGTERM), before the server stops."""

    @abstractmethod
    async def begin_drain(self) -> None:
        """Refuse new work from now on and end long-lived streams once their work is done."""


class EndsStreams(ABC):
    """A service that ends its own streams still running when the drain ends, each with a status naming the stop.
    The server's cancel of what is left reads only 'Cancelling all calls', and a stream served on another face
    (the orchestrator's HTTP face calls the servicer's RunTask) was cut with no word at all."""

    @abstractmethod
    async def end_streams(self, after_s: float) -> None:
        """Let the streams in flight run up to ``after_s`` seconds, then end each one left with its error."""


STREAM_END_MARGIN_S = 1.0
"""How long after a service that :class:`EndsStreams` ended its streams the server cancels what is left."""


class InterceptsCalls(ABC):
    """A service that puts interceptors of its own on its server (the orchestrator: authentication)."""

    @abstractmethod
    def server_interceptors(self) -> Sequence[grpc.aio.ServerInterceptor]:
        """The interceptors, run after the ones :func:`start_server` is given (tracing): refusals are traced."""


class HealthOwner(ABC):
    """A service that sets its own health statuses (readiness that follows its dependencies)."""

    @abstractmethod
    async def watch_health(self, health: health.aio.HealthServicer) -> None:
        """Called once the server serves, instead of setting ``grpc_service_names`` SERVING."""


async def set_health(health_servicer: health.aio.HealthServicer, service: Service, serving: bool,
                     overall: bool = False) -> None:
    """``service``'s health names (``grpc_service_names``; the server's overall status ``""`` too when ``overall``)
    SERVING or NOT_SERVING, and its ``switchyard_serving`` gauge 1 or 0."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in (*service.grpc_service_names, *([""] if overall else [])):
        await health_servicer.set(name, status)
    SERVING.labels(service.name).set(1 if serving else 0)


async def begin_drain(service: Service) -> None:
    """Tell a service that drains (:class:`Drains`) that the server starts draining."""
    if isinstance(service, Drains):
        await service.begin_drain()


def edge_interceptors(service: Service) -> list[grpc.aio.ServerInterceptor]:
    """Interceptors a service asks for on its own server (:class:`InterceptsCalls`)."""
    return list(service.server_interceptors()) if isinstance(service, InterceptsCalls) else []


def server_options(config: ServerConfig) -> list[tuple[str, int]]:
    """grpc.aio server options from ``server``: message limits, keepalive, connection age."""
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # Off: a second process on the same port must fail loudly, not share it.
        ("grpc.so_reuseport", 0),
        # Keepalive: the server pings quiet clients too, so the streams of a client
        # that died without closing its connection end within keepalive_time_s +
        # keepalive_timeout_s (their handlers see CANCELLED), and accepts client
        # pings every 10 s (common/channels.py pings no more often).
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        # grpc core waits this long for any ping's ack (its own default is a minute) whatever the keepalive
        # timeout says: without it a peer stopped mid-stream (SIGSTOP, a hung host) was not found for a minute
        # or more, its streams hanging (common/channels.py)
        ("grpc.http2.ping_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        # Calls that arrived but that the server has not yet handed to a servicer. Past grpc core's
        # defaults (1,000 soft, 3,000 hard) it cancels them at random, a bare CANCELLED that no
        # servicer sees or counts (a 3,000-call burst lost 23 %). Switchyard refuses overload
        # itself, by name: the queues' capacities answer RESOURCE_EXHAUSTED.
        ("grpc.server.max_pending_requests", config.max_pending_rpcs),
        ("grpc.server.max_pending_requests_hard_limit", config.max_pending_rpcs),
        # ...and any that waited 30 s: server.max_unrequested_time_s instead (an hour by default); a
        # waiting call is bounded by its caller's deadline.
        ("grpc.server_max_unrequested_time_in_server", config.max_unrequested_time_s),
        # Connection age (gRFC A9): after max_connection_age_s a connection gets
        # GOAWAY, so its client re-resolves (dns:/// of a headless Service) and
        # round_robin finds the pods added since; running calls keep the grace.
        ("grpc.max_connection_age_ms", int(config.max_connection_age_s * 1000)),
        ("grpc.max_connection_age_grace_ms", int(config.max_connection_age_grace_s * 1000)),
    ]



class HealthServicer(health.aio.HealthServicer):
    """grpc.health.v1.Health with ``List`` as well as ``Check`` and ``Watch``.

    ``List`` (added to health.proto in 2024; grpcio-health-checking answers it
    UNIMPLEMENTED) returns a snapshot of every registered service's status,
    the server as a whole under the empty name included.
    """

    async def List(  # noqa: N802 - gRPC method name
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        # _server_status is the parent's table of service -> status (what Check reads).
        statuses = {
            name: health_pb2.HealthCheckResponse(status=status) for name, status in self._server_status.items()
        }
        return health_pb2.HealthListResponse(statuses=statuses)


# The health-only port answers probes: requests are a service name, and a probe
# needs no more than a few calls at once (past the limit: RESOURCE_EXHAUSTED).
HEALTH_SERVER_OPTIONS = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 4096)]
HEALTH_SERVER_MAX_CALLS = 64


@dataclass
class RunningServer:
    """A started server: its bound port and health servicer (and the health-only port, when asked for)."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    services: tuple[Service, ...]
    health_server: grpc.aio.Server | None = None
    health_port: int | None = None

    async def stop(self, grace: float) -> None:
        """NOT_SERVING, drain in-flight RPCs for up to ``grace`` s, then stop the services."""
        names = ", ".join(s.name for s in self.services)
        log.info("%s: health NOT_SERVING, draining for up to %.1f s", names, grace)
        for service in self.services:
            SERVING.labels(service.name).set(0)
        await self.health.enter_graceful_shutdown()
        for service in self.services:
            await begin_drain(service)
        ending = [service.end_streams(grace) for service in self.services if isinstance(service, EndsStreams)]
        if ending:  # those services end theirs at ``grace``, each with its status; the server's cancel comes after
            stopping = asyncio.ensure_future(self.server.stop(grace + STREAM_END_MARGIN_S))
            try:
                await asyncio.gather(*ending)
            finally:
                await stopping
        else:
            await self.server.stop(grace)
        if self.health_server is not None:  # answered NOT_SERVING to probes while the calls drained
            await self.health_server.stop(None)
        log.info("%s: gRPC server stopped", names)
        for service in reversed(self.services):
            await service.stop()
            log.info("%s: background tasks stopped", service.name)


def _add_port(server: grpc.aio.Server, address: str, config: ServerConfig) -> int:
    """Bind ``address``: TLS with ``server.tls`` on (client certificates required under mTLS), else plain."""
    tls = config.tls
    if not tls.enabled:
        return server.add_insecure_port(address)
    cert, key, ca = tls.read()
    if cert is None or key is None:
        raise ConfigError("server.tls: a server needs cert_file and key_file (the certificate it presents)")
    from switchyard.common.tls_check import served_certificate_problem  # cryptography only where TLS is on

    problem = served_certificate_problem(cert, f"server.tls.cert_file {tls.cert_file}", ca,
                                         f"server.tls.ca_file {tls.ca_file}")
    if problem is not None:
        raise ConfigError(f"{problem}; every peer's TLS handshake would fail: install a certificate valid now "
                          "(or set this host's clock right)")
    credentials = grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca if tls.require_client_auth else None,
        require_client_auth=tls.require_client_auth,
    )
    return server.add_secure_port(address, credentials)


HOST_SETTING = "server.host (config/switchyard.json) or SWITCHYARD_HOST"
"""Where the address every service listens on is set: the settings a bind failure on the host names."""


def bind_error(host: str, port: int) -> OSError | None:
    """What binding ``host:port`` now raises, as grpcio binds (SO_REUSEADDR, no SO_REUSEPORT): None when it can be
    bound, ``socket.gaierror`` when the host name does not resolve, else the bind's OSError (``EADDRINUSE``:
    another process listens there). ``host`` may be a bracketed IPv6 address (``[::1]``)."""
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # getaddrinfo takes it bare
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(sockaddr)
    except OSError as exc:  # socket.gaierror too
        return exc
    return None


def bind_failure(host: str, port: int, what: str = "", port_setting: str = "") -> str:
    """Why ``host:port`` could not be bound, in words naming the setting to change (grpcio says only "Failed to
    bind"): the host name does not resolve, is not an address of this machine, or the port is taken (the one
    case where another process is to blame); found by resolving the name and binding a probe socket as grpcio
    would (no SO_REUSEPORT).

    Args:
        host, port: the address that failed (port 0: any free port).
        what: what the address is for, before it in the message (``"the health port "``); empty: the gRPC port.
        port_setting: how to choose another port, in parentheses after the in-use hint.
    """
    address = f"{what}{host}:{port}"
    exc = bind_error(host, port)
    if isinstance(exc, socket.gaierror):
        return (f"could not bind {address}: the host name {host!r} does not resolve ({exc.strerror}); set "
                f"{HOST_SETTING} to a name or address of this machine, e.g. 127.0.0.1 or 0.0.0.0")
    if exc is not None:
        if exc.errno == errno.EADDRINUSE:
            return (f"could not bind {address}: is another process using it? Choose another port"
                    + (f" ({port_setting})" if port_setting else ""))
        if exc.errno == errno.EADDRNOTAVAIL:
            resolved = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0][4][0]
            return (f"could not bind {address}: {host!r} ({resolved}) is not an address of this machine; set "
                    f"{HOST_SETTING} to one of its addresses, e.g. 127.0.0.1 or 0.0.0.0")
        return f"could not bind {address}: {exc.strerror or exc}"
    return f"could not bind {address}: grpcio refused it, and the address can be bound now (taken a moment ago?)"


def _health_only_server(health_servicer: health.aio.HealthServicer, address: str) -> tuple[grpc.aio.Server, int]:
    """A plain-text server bound to ``address`` serving ``health_servicer`` (the main server's statuses) only.

    No application service, no reflection, no interceptors: a probe sees what
    the main port's Health/Check would answer, and nothing else is reachable.

    Raises:
        RuntimeError: the port could not be bound.
    """
    server = grpc.aio.server(options=HEALTH_SERVER_OPTIONS, maximum_concurrent_rpcs=HEALTH_SERVER_MAX_CALLS)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        host, _, port = address.rpartition(":")
        raise RuntimeError(bind_failure(host, int(port), "the health port ", "<service>.health_port, or "
                                        "SWITCHYARD_HEALTH_PORT"))
    return server, bound


async def start_server(
    services: Sequence[Service],
    host: str,
    port: int,
    config: ServerConfig,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    health_port: int | None = None,
) -> RunningServer:
    """Start ``services`` on one grpc.aio server bound to ``host:port`` (0 = any free port).

    With ``health_port`` (0 = any free port), ``host:health_port`` also serves
    the same health statuses in plain text, and nothing else.

    Raises:
        RuntimeError: a port could not be bound; the message says why (:func:`bind_failure`).
    """
    own = [i for service in services for i in edge_interceptors(service)]  # after tracing: refusals are traced
    refusal = DecodeRefusal(",".join(s.name for s in services))  # innermost: tracing and auth see its refusal
    server = grpc.aio.server(options=server_options(config), interceptors=[*interceptors, *own, refusal])
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    for service in services:
        service.register(server)
        names.extend(service.grpc_service_names)
    enable_server_reflection(names, server)  # v1 and v1alpha
    try:
        bound = _add_port(server, f"{host}:{port}", config)
    except RuntimeError:  # grpcio raises "Failed to bind to address ..." where older releases returned 0
        bound = 0
    if bound == 0:
        raise RuntimeError(bind_failure(host, port, port_setting="config/switchyard.json, or `switchyard up "
                                        "--free-ports`"))
    health_server, health_bound = (
        _health_only_server(health_servicer, f"{host}:{health_port}") if health_port is not None else (None, None)
    )
    for service in services:
        await service.start()
    await server.start()
    if health_server is not None:
        await health_server.start()
    for service in services:
        if isinstance(service, HealthOwner):
            await service.watch_health(health_servicer)
            continue
        await set_health(health_servicer, service, serving=True)
    log.info("%s listening on %s:%d%s", ", ".join(s.name for s in services), host, bound,
             f" (health only, plain text, on port {health_bound})" if health_server is not None else "")
    if config.tls.enabled:
        from switchyard.common.tls_check import describe_tls  # cryptography only where TLS is on

        log.info("%s: %s", ", ".join(s.name for s in services), describe_tls(config.tls))
    return RunningServer(server, bound, health_servicer, tuple(services), health_server, health_bound)


@contextlib.asynccontextmanager
async def running(
    services: Sequence[Service], config: ServerConfig, host: str = "127.0.0.1", port: int = 0, grace: float = 1.0,
    health_port: int | None = None,
) -> AsyncIterator[RunningServer]:
    """Serve ``services`` for the body of an ``async with`` (tests, embedded use)."""
    srv = await start_server(services, host, port, config, health_port=health_port)
    try:
        yield srv
    finally:
        await srv.stop(grace)


async def serve_until_signal(srv: RunningServer, grace: float) -> None:
    """Block until SIGTERM or SIGINT, then stop ``srv`` gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("signal received, shutting down")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await srv.stop(grace)
