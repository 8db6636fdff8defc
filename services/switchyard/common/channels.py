"""The one place Switchyard opens gRPC channels to its own services.

Every channel between Switchyard's services comes from here: the
orchestrator's clients of retrieval and the dispatcher, the launcher's health
checks, ``switchyard run``, the bench client and the tests. Each carries:

- **No HTTP proxy.** grpc core routes a channel through ``http_proxy`` /
  ``https_proxy`` / ``grpc_proxy`` unless ``grpc.enable_http_proxy`` is 0; a
  corporate or developer proxy then sits between two pods of the same stack
  (and a multi-address target is sent as one ``CONNECT`` it cannot serve).
  Internal traffic never uses a proxy. Only the upstream model client honours
  the proxy variables (:mod:`switchyard.gateway.proxy`).
- **Keepalive** (``server.keepalive_time_s`` / ``keepalive_timeout_s``):
  a ping on a quiet connection, which is closed, failing its calls UNAVAILABLE,
  when the peer does not answer in time. A dead peer is found in seconds, not
  at the next TCP retransmission timeout. Servers accept pings every 10 s
  (``grpc.http2.min_ping_interval_without_data_ms`` in
  :func:`switchyard.common.server.server_options`); clients ping no more often,
  so no server answers GOAWAY "too_many_pings" (gRFC A8, client-side keepalive).
- **Message limits**: ``server.max_message_bytes`` both ways, as the servers.
- **Its own connections** (``grpc.use_local_subchannel_pool``): grpc core
  otherwise shares one connection per address among a process's channels,
  and with it the reconnect backoff of a server that went away, so a channel
  opened to whatever listens there now failed its calls at once.
- **round_robin**: a target that resolves to several addresses (``dns:///`` of a
  Kubernetes headless Service, ``ipv4:127.0.0.1:5001,127.0.0.1:5002``) spreads
  calls over all of them instead of pinning every call to the first.
- **Deadline propagation**: a call started inside :func:`deadline_scope` gets at
  most the scope's remaining time as its timeout, so every downstream hop of a
  task ends when the task's own deadline does.
- **TLS** when ``server.tls.enabled``: the peer checked against
  ``ca_file``; under mTLS this service's certificate presented too.
- **Tracing**: the client span interceptors when tracing is on
  (:func:`switchyard.common.telemetry.client_interceptors`).
- **Connection counts**: a channel opened inside an event loop watches its
  connectivity state; each time its connection leaves READY (a GOAWAY for the
  server's ``max_connection_age_s`` or a drain, or a broken connection) it
  counts ``switchyard_grpc_channel_disconnects_total{peer}``, and each time it
  is READY again ``switchyard_grpc_channel_reconnects_total{peer}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
from typing import Any, Iterator

import grpc

from switchyard.common.config import ServerConfig
from switchyard.common.metrics import CHANNEL_DISCONNECTS, CHANNEL_RECONNECTS, PEER_SERVICES, bounded

log = logging.getLogger(__name__)

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("switchyard_deadline", default=None)

ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
"""gRPC service config selecting the round_robin policy (gRFC A24 ``loadBalancingConfig``)."""


MAX_CALL_TIMEOUT_S = 1e9
"""Longest timeout a caller may give one gRPC call, seconds (about 31 years). gRPC holds a deadline as int64
nanoseconds of its clock: past about 7e9 s from now it overflows, and the call fails at once with
DEADLINE_EXCEEDED; the commands that take a timeout refuse one above this."""


MAX_RECONNECT_BACKOFF_MS = 2000
"""Longest wait between reconnection attempts to one address (gRPC's default is 120 s)."""


def channel_options(config: ServerConfig | None = None) -> list[tuple[str, Any]]:
    """The options every internal channel is opened with (see the module docstring)."""
    config = config or ServerConfig()
    return [
        ("grpc.enable_http_proxy", 0),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        # the ack wait grpc core applies to every ping, keepalive's included (its own default is a minute):
        # without it a peer stopped mid-stream was not found within keepalive_time_s + keepalive_timeout_s
        ("grpc.http2.ping_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.service_config", ROUND_ROBIN),
        *([("grpc.ssl_target_name_override", config.tls.server_name)] if config.tls.server_name else []),
        # A replica that went away is retried at most this far apart, so one
        # that comes back (or a new pod behind the same address) gets calls
        # within 2 s, not after gRPC's default backoff of up to 120 s.
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        # Each channel owns its connections. grpc core otherwise shares one subchannel per address among all
        # the process's channels, backoff state included: after a server at an address went away, a channel
        # opened to the server that listens there now (a restarted replica, a new pod given the old IP and
        # port) failed its calls at once, UNAVAILABLE "connections to all backends failing ... Connection
        # refused", until another channel's reconnect backoff to the old server ran out.
        ("grpc.use_local_subchannel_pool", 1),
    ]


# ---------------------------------------------------------------------------- deadlines


@contextlib.contextmanager
def deadline_scope(deadline: float | None) -> Iterator[None]:
    """Calls started in this block (in this task's context) end by ``deadline``.

    Args:
        deadline: a ``time.monotonic()`` instant, or None for no bound. A scope
            inside another keeps the earlier of the two deadlines.
    """
    outer = _DEADLINE.get()
    if deadline is None or (outer is not None and outer <= deadline):
        yield
        return
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def beyond_deadline() -> contextvars.Context:
    """A copy of the current context outside any :func:`deadline_scope`: for a task started now that must still
    run once the scope's deadline has passed (telling a peer that the work it bounded ended); its calls are
    bounded by their own timeouts only."""
    context = contextvars.copy_context()
    context.run(_DEADLINE.set, None)
    return context


def remaining_s() -> float | None:
    """Seconds left before the current :func:`deadline_scope`'s deadline (>= 0), or None outside one."""
    deadline = _DEADLINE.get()
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def bounded_timeout(timeout_s: float | None) -> float | None:
    """``timeout_s`` cut to the current scope's remaining time (None: no bound from either)."""
    left = remaining_s()
    if left is None:
        return timeout_s
    return left if timeout_s is None else min(timeout_s, left)


class _BoundedCall:
    """A multi-callable whose calls get at most the current scope's remaining time as timeout."""

    __slots__ = ("_inner",)

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __call__(self, request: Any, *, timeout: float | None = None, **kwargs: Any) -> Any:
        return self._inner(request, timeout=bounded_timeout(timeout), **kwargs)


async def watch_connectivity(channel: grpc.aio.Channel, peer: str, target: str) -> None:
    """Count ``channel``'s lost connections and reconnections until it shuts down.

    ``wait_for_state_change`` may wake after the state went away from READY and
    back (a GOAWAY answered by an immediate reconnect): READY seen again after
    READY counts one disconnect and one reconnect. Never connects by itself.
    """
    ready = grpc.ChannelConnectivity.READY
    state = channel.get_state(try_to_connect=False)
    was_ready = state == ready
    while state != grpc.ChannelConnectivity.SHUTDOWN:
        await channel.wait_for_state_change(state)
        new = channel.get_state(try_to_connect=False)
        if state == ready:
            CHANNEL_DISCONNECTS.labels(peer).inc()
            log.debug("channel to %s (%s) lost its connection (GOAWAY or broken); now %s", peer, target, new.name)
            if new == ready:
                CHANNEL_RECONNECTS.labels(peer).inc()
        elif new == ready and was_ready:
            CHANNEL_RECONNECTS.labels(peer).inc()
        was_ready = was_ready or new == ready
        state = new


class _DeadlineChannel(grpc.aio.Channel):
    """A ``grpc.aio.Channel`` whose unary and server-streaming calls honour :func:`deadline_scope`;
    the rest of the channel's interface is the wrapped channel's.

    A wrapper rather than a client interceptor: grpc.aio runs every intercepted call
    through an extra task, a cost each call of the request path would pay. Inside an
    event loop it also runs :func:`watch_connectivity` until it is closed.
    """

    def __init__(self, channel: grpc.aio.Channel, peer: str = "other", target: str = "") -> None:
        self._channel = channel
        self._watch: asyncio.Task[None] | None = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._watch = loop.create_task(watch_connectivity(channel, peer, target), name=f"watch channel {target}")

    async def close(self, grace: float | None = None) -> None:
        """Close the channel (``grpc.aio.Channel.close``) and end its connectivity watch."""
        await self._channel.close(grace)
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch

    def unary_unary(self, *args: Any, **kwargs: Any) -> _BoundedCall:
        return _BoundedCall(self._channel.unary_unary(*args, **kwargs))

    def unary_stream(self, *args: Any, **kwargs: Any) -> _BoundedCall:
        return _BoundedCall(self._channel.unary_stream(*args, **kwargs))

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return self._channel.stream_unary(*args, **kwargs)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return self._channel.stream_stream(*args, **kwargs)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()

    async def __aenter__(self) -> "_DeadlineChannel":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ---------------------------------------------------------------------------- channels


def open_channel(
    target: str, config: ServerConfig | None = None, *, tracer_provider: Any = None, peer: str = "other"
) -> grpc.aio.Channel:
    """An asyncio channel to one of Switchyard's services.

    Args:
        target: ``host:port``, or any gRPC target (``dns:///name:port``,
            ``ipv4:a:p,b:p``).
        config: ``server`` (message limits, keepalive); defaults when None.
        tracer_provider: trace with this provider (tests); None: the global
            one, and no tracing interceptor when tracing is off.
        peer: the service at ``target`` (orchestrator, retrieval, dispatcher),
            the ``peer`` label of the connection counters; else ``other``.
    """
    from switchyard.common import telemetry  # telemetry imports config; keep this module light

    interceptors = telemetry.client_interceptors(tracer_provider, target) or None
    credentials = _credentials(config)
    if credentials is None:
        channel = grpc.aio.insecure_channel(target, options=channel_options(config), interceptors=interceptors)
    else:
        channel = grpc.aio.secure_channel(target, credentials, options=channel_options(config), interceptors=interceptors)
    label = bounded(peer, PEER_SERVICES)
    return _DeadlineChannel(channel, label, target)


def open_sync_channel(target: str, config: ServerConfig | None = None) -> grpc.Channel:
    """A blocking channel with the same options and TLS (health checks from synchronous code)."""
    credentials = _credentials(config)
    if credentials is None:
        return grpc.insecure_channel(target, options=channel_options(config))
    return grpc.secure_channel(target, credentials, options=channel_options(config))


def _credentials(config: ServerConfig | None) -> grpc.ChannelCredentials | None:
    """TLS credentials from ``server.tls`` (a client certificate under mTLS), or None for plain text."""
    if config is None or not config.tls.enabled:
        return None
    cert, key, ca = config.tls.read()
    if config.tls.require_client_auth:
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.ssl_channel_credentials(root_certificates=ca)


__all__ = [
    "beyond_deadline",
    "bounded_timeout",
    "channel_options",
    "deadline_scope",
    "open_channel",
    "open_sync_channel",
    "remaining_s",
]
